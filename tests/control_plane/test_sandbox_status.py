"""What `meshfn up` reports of the backends' sandbox: a layer the kernel does not show is never
reported on, and egress denials are logged at most once per backend and reason per interval."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from meshfn import ir
from meshfn.contracts.function import FunctionSettings
from meshfn.control_plane.runtime import sandbox
from meshfn.control_plane.runtime.upstreams import UpstreamSpec, backend_state_dir
from meshfn.ebpf import Denial
from meshfn.ebpf.egress import _address, _text

SPEC = UpstreamSpec(
    "default/models", "127.0.0.1", 9101, "",
    (ir.Function("iris", "default", "default/models", FunctionSettings()),),
)  # fmt: skip


def write_report(state: Path, report: dict[str, object]) -> None:
    own = backend_state_dir(state, SPEC.address, SPEC.port)
    own.mkdir(parents=True)
    (own / "sandbox.json").write_text(json.dumps(report))


def test_no_report_is_unknown_and_a_seccomp_claim_the_kernel_denies_is_failed(
    tmp_path: Path,
) -> None:
    box = sandbox.BackendSandbox(tmp_path, "off")
    box.backends = lambda: [SPEC]
    (backend,) = box.document()["backends"]
    assert backend["landlock"]["state"] == backend["seccomp"]["state"] == "unknown"
    assert backend["egress"] == {"state": "off", "detail": "not set up"}
    on = {"state": "on", "detail": "x"}
    write_report(tmp_path, {"pid": os.getpid(), "landlock": on, "seccomp": on})  # this pytest
    (backend,) = box.document()["backends"]
    assert backend["landlock"] == on
    assert backend["seccomp"] == {
        "state": "failed", "detail": "reported on, but the kernel says mode 0"
    }  # fmt: skip


def test_denials_are_logged_once_per_backend_and_reason_per_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    box = sandbox.BackendSandbox(tmp_path, "auto")
    name = SPEC.name

    def denial(count: int) -> dict[str, dict[str, Denial]]:
        return {name: {"tcp_loopback": Denial(count, "127.0.0.1", 9201, 42, 0)}}

    caplog.set_level(logging.WARNING, logger="meshfn.sandbox")
    box.log_denials(denial(3), now=100.0)
    box.log_denials(denial(500), now=105.0)  # within the interval: no line
    box.log_denials(denial(500), now=111.0)
    box.log_denials(denial(500), now=130.0)  # nothing new: no line
    assert [r.getMessage() for r in caplog.records] == [
        f"egress denied: {name}: 3 tcp_loopback attempt(s) since the last line, the last to "
        "127.0.0.1:9201 by pid 42",
        f"egress denied: {name}: 497 tcp_loopback attempt(s) since the last line, the last to "
        "127.0.0.1:9201 by pid 42",
    ]


@pytest.mark.parametrize("address", ["127.0.0.1", "198.18.3.2", "::1", "fd00::7"])
def test_egress_keys_addresses_as_the_programs_do(address: str) -> None:
    assert _text(_address(address)) == address
    if "." in address:  # IPv4 as ::ffff:a.b.c.d, so a dual-stack socket matches too
        assert _address(address) == _address(f"::ffff:{address}")
