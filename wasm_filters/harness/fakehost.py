"""ctypes driver for the native filter builds (`build.sh --native`): the same C filter code,
linked against fake_host.c instead of Envoy. Tests call the filter's exported proxy-wasm
callbacks in the order Envoy does and inspect what the filter did to the fake host.

A -lean build (no per-request contexts) serves one configuration per VM, as Envoy runs it with a
vm_id per configuration: here each `configure` of a lean build loads a fresh copy of the library,
i.e. a new VM with its own globals.

With MESHFN_FUZZ_RECORD=DIR, each plugin configuration's life (its configuration, then every
header, property, stream and body chunk the test drives) is also written to
DIR/<filter>/<sha1> in the script format of wasm_filters/fuzz/fuzz_filter.c: the native tests
seed the filters' fuzz corpora (tests/fuzz/make_seeds.py)."""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from meshfn.common import env

REQUEST_HEADERS, REQUEST_TRAILERS, RESPONSE_HEADERS, RESPONSE_TRAILERS = 0, 1, 2, 3
CONTINUE, PAUSE = 0, 1

_P = ctypes.POINTER(ctypes.c_char)
_ids = itertools.count(1000)


@dataclass
class LocalResponse:
    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]


def _decode_pairs(raw: bytes) -> list[tuple[bytes, bytes]]:
    """proxy-wasm serialized header map: u32 count, (u32 klen, u32 vlen)*, then k\\0v\\0 ..."""
    count = int.from_bytes(raw[:4], "little")
    sizes = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "little") for i in range(2 * count)]
    pos = 4 + 8 * count
    pairs = []
    for i in range(count):
        k = raw[pos : pos + sizes[2 * i]]
        pos += sizes[2 * i] + 1
        v = raw[pos : pos + sizes[2 * i + 1]]
        pos += sizes[2 * i + 1] + 1
        pairs.append((k, v))
    return pairs


_OPTIONAL = (
    "proxy_on_context_create",
    "proxy_on_delete",
    "proxy_on_request_body",
    "proxy_on_response_headers",
    "proxy_on_done",
)


class FakeHost:
    def __init__(self, library: Path) -> None:
        self.library = library
        self._vms = itertools.count()
        self._vm_dir: tempfile.TemporaryDirectory[str] | None = None
        self._bind(ctypes.CDLL(str(library)))
        # no per-request context callbacks: the lean build (one configuration per VM)
        self.lean = "proxy_on_context_create" not in self.exports
        self._configured = False
        record = env.FUZZ_RECORD.get()
        filter_name = library.name.removesuffix("_native.so").removesuffix("-lean")
        self._record_dir = Path(record) / filter_name if record else None
        self._script: list[bytes] = []
        self._roots: set[int] = set()

    def _note(self, line: bytes) -> None:
        if self._record_dir is not None and self._script:
            self._script.append(line.replace(b"\n", b" "))

    def _flush(self) -> None:
        if self._record_dir is None or not self._script:
            return
        data = b"\n".join(self._script) + b"\n"
        self._script = []
        if len(data) <= 16384:
            self._record_dir.mkdir(parents=True, exist_ok=True)
            (self._record_dir / hashlib.sha1(data).hexdigest()).write_bytes(data)

    def _bind(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        u32, sz = ctypes.c_uint32, ctypes.c_size_t
        # callbacks a filter does not need are not exported (Envoy then skips them too)
        self.exports = {name for name in _OPTIONAL if hasattr(lib, name)}
        for name, args, res in [
            *[(n, [u32, u32], None) for n in ("proxy_on_context_create",) if n in self.exports],
            ("proxy_on_configure", [u32, u32], u32),
            ("proxy_on_request_headers", [u32, u32, u32], u32),
            *[
                (n, [u32, u32, u32], u32)
                for n in ("proxy_on_request_body", "proxy_on_response_headers")
                if n in self.exports
            ],
            *[(n, [u32], None) for n in ("proxy_on_delete",) if n in self.exports],
            ("host_reset", [], None),
            ("host_set_config", [ctypes.c_char_p, sz], None),
            ("host_set_body", [ctypes.c_char_p, sz], None),
            ("host_header_add", [u32, ctypes.c_char_p, sz, ctypes.c_char_p, sz], None),
            ("host_headers_clear", [u32], None),
            ("host_header_count", [u32], sz),
            (
                "host_header_at",
                [
                    u32,
                    sz,
                    ctypes.POINTER(_P),
                    ctypes.POINTER(sz),
                    ctypes.POINTER(_P),
                    ctypes.POINTER(sz),
                ],
                ctypes.c_int,
            ),
            ("host_property", [ctypes.c_char_p, sz, ctypes.c_char_p, sz], None),
            (
                "host_state",
                [ctypes.c_char_p, sz, ctypes.POINTER(_P), ctypes.POINTER(sz)],
                ctypes.c_int,
            ),
            ("host_log_count", [], sz),
            ("host_log_at", [sz, ctypes.POINTER(_P), ctypes.POINTER(sz)], ctypes.c_int),
            ("host_metric", [ctypes.c_char_p], ctypes.c_longlong),
            (
                "host_local_response",
                [ctypes.POINTER(_P), ctypes.POINTER(sz), ctypes.POINTER(_P), ctypes.POINTER(sz)],
                ctypes.c_int,
            ),
            ("host_foreign_calls", [], ctypes.c_int),
            ("host_fail_set_property", [ctypes.c_int], None),
            ("host_live_bytes", [], sz),
            ("host_sha256", [ctypes.c_char_p, sz, ctypes.c_char_p], None),
            ("host_sha256_chunked", [ctypes.c_char_p, sz, sz, ctypes.c_char_p], None),
            ("host_hmac_sha256", [ctypes.c_char_p, sz, ctypes.c_char_p, sz, ctypes.c_char_p], None),
        ]:
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = res

    # ---------------------------------------------------------------- plugin lifecycle

    def new_vm(self) -> None:
        """A lean build's next configuration needs a VM of its own: a fresh copy of the library
        (dlopen returns the loaded one for the same path)."""
        if self._vm_dir is None:
            self._vm_dir = tempfile.TemporaryDirectory(prefix="fakehost-vm-")
        copy = Path(self._vm_dir.name) / f"vm{next(self._vms)}.so"
        shutil.copyfile(self.library, copy)
        self._bind(ctypes.CDLL(str(copy)))

    def configure(self, config: bytes | None) -> tuple[int, bool]:
        """New root context configured with `config`; returns (root id, accepted)."""
        if self.lean and self._configured:
            self.new_vm()
        self._configured = True
        if self._record_dir is not None:
            self._flush()
            self._script = [(config or b"").replace(b"\n", b" ")]
        self.lib.host_reset()
        root = next(_ids)
        self._roots.add(root)
        if "proxy_on_context_create" in self.exports:
            self.lib.proxy_on_context_create(root, 0)
        self.lib.host_set_config(config, len(config) if config is not None else 0)
        ok = bool(self.lib.proxy_on_configure(root, len(config) if config else 0))
        return root, ok

    def reconfigure(self, root: int, config: bytes) -> bool:
        self._note(b"C" + config)
        self.lib.host_set_config(config, len(config))
        return bool(self.lib.proxy_on_configure(root, len(config)))

    def delete(self, context: int) -> None:
        self._note(b"R" if context in self._roots else b"D")
        if "proxy_on_delete" in self.exports:
            self.lib.proxy_on_delete(context)

    # ---------------------------------------------------------------- one request

    def stream(self, root: int) -> int:
        """A new HTTP context; resets request state (headers, properties, body, filter state)."""
        self._note(b"Z")
        self.lib.host_reset()
        ctx = next(_ids)
        if "proxy_on_context_create" in self.exports:
            self.lib.proxy_on_context_create(ctx, root)
        return ctx

    def set_headers(self, which: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.lib.host_headers_clear(which)
        for k, v in headers:
            self.lib.host_header_add(which, k, len(k), v, len(v))

    def headers(self, which: int) -> list[tuple[bytes, bytes]]:
        out = []
        k, v = _P(), _P()
        kn, vn = ctypes.c_size_t(), ctypes.c_size_t()
        for i in range(self.lib.host_header_count(which)):
            self.lib.host_header_at(
                which, i, ctypes.byref(k), ctypes.byref(kn), ctypes.byref(v), ctypes.byref(vn)
            )
            out.append((ctypes.string_at(k, kn.value), ctypes.string_at(v, vn.value)))
        return out

    def header(self, which: int, name: bytes) -> bytes | None:
        for k, v in self.headers(which):
            if k.lower() == name.lower():
                return v
        return None

    def set_property(self, path: bytes, value: bytes) -> None:
        self._note(b"P" + path.replace(b"\0", b"|") + b"=" + value.replace(b"\0", b"|"))
        self.lib.host_property(path, len(path), value, len(value))

    def request_headers(
        self, ctx: int, headers: list[tuple[bytes, bytes]], eos: bool = True
    ) -> int:
        self.set_headers(REQUEST_HEADERS, headers)
        for k, v in headers:
            self._note(b"H" + k + b":" + v)
        self._note(b"T" if eos else b"S")
        return int(self.lib.proxy_on_request_headers(ctx, len(headers), int(eos)))

    def request_body(self, ctx: int, chunk: bytes, eos: bool) -> int:
        self._note((b"E" if eos else b"B") + chunk)
        self.lib.host_set_body(chunk, len(chunk))
        if "proxy_on_request_body" not in self.exports:
            return CONTINUE
        return int(self.lib.proxy_on_request_body(ctx, len(chunk), int(eos)))

    def response_headers(
        self, ctx: int, headers: list[tuple[bytes, bytes]], eos: bool = False
    ) -> int:
        self.set_headers(RESPONSE_HEADERS, headers)
        if "proxy_on_response_headers" not in self.exports:
            return CONTINUE
        return int(self.lib.proxy_on_response_headers(ctx, len(headers), int(eos)))

    # ---------------------------------------------------------------- what the filter did

    def state(self, path: bytes) -> bytes | None:
        p, n = _P(), ctypes.c_size_t()
        if not self.lib.host_state(path, len(path), ctypes.byref(p), ctypes.byref(n)):
            return None
        return ctypes.string_at(p, n.value)

    def logs(self) -> list[tuple[int, str]]:
        out = []
        p, n = _P(), ctypes.c_size_t()
        for i in range(self.lib.host_log_count()):
            level = self.lib.host_log_at(i, ctypes.byref(p), ctypes.byref(n))
            out.append((level, ctypes.string_at(p, n.value).decode("utf-8", "replace")))
        return out

    def metric(self, name: str) -> int:
        return int(self.lib.host_metric(name.encode()))

    def local_response(self) -> LocalResponse | None:
        b, h = _P(), _P()
        bn, hn = ctypes.c_size_t(), ctypes.c_size_t()
        status = self.lib.host_local_response(
            ctypes.byref(b), ctypes.byref(bn), ctypes.byref(h), ctypes.byref(hn)
        )
        if not status:
            return None
        return LocalResponse(
            status, ctypes.string_at(b, bn.value), _decode_pairs(ctypes.string_at(h, hn.value))
        )

    def foreign_calls(self) -> int:
        return int(self.lib.host_foreign_calls())

    def fail_set_property(self, on: bool) -> None:
        self._note(b"F")
        self.lib.host_fail_set_property(int(on))

    def live_bytes(self) -> int:
        return int(self.lib.host_live_bytes())

    # ---------------------------------------------------------------- crypto under test

    def sha256(self, data: bytes, step: int | None = None) -> bytes:
        out = ctypes.create_string_buffer(32)
        if step is None:
            self.lib.host_sha256(data, len(data), out)
        else:
            self.lib.host_sha256_chunked(data, len(data), step, out)
        return out.raw

    def hmac_sha256(self, key: bytes, message: bytes) -> bytes:
        out = ctypes.create_string_buffer(32)
        self.lib.host_hmac_sha256(key, len(key), message, len(message), out)
        return out.raw
