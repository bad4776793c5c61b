"""CLI: `meshfn fn build|sign|publish|keygen|examples` (typer sub-app `fn_app`) and the
backend process `python -P -m meshfn.inference serve` (`main`)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from meshfn.common.cli import command_app, console, fail, run_cli

from .errors import InferenceError

if TYPE_CHECKING:
    from .config import BackendConfig

__all__ = ["InferenceError", "fn_app", "main", "publish_examples"]

fn_app = command_app("fn", "Build, sign and publish WASM model functions.")
# What functions are named and where they are is printed as it is: no markup on stdout.
out = console(highlight=False, markup=False)
err = console(stderr=True, highlight=False)


@fn_app.command("keygen")
def keygen(
    out_dir: Annotated[Path, typer.Option("--out", help="directory for NAME.key and NAME.pub")],
    name: Annotated[str, typer.Option(help="file name stem")] = "meshfn-signing",
) -> None:
    """Create an ed25519 signing key pair (the private key is written with mode 0600)."""
    from .signing import generate_key

    try:
        private, public = generate_key(out_dir, name)
    except InferenceError as exc:
        fail(exc)
    out.print(f"private key: {private}\npublic key:  {public}")


@fn_app.command("init")
def init_cmd(
    directory: Annotated[Path, typer.Argument(help="function directory to create")],
    from_onnx: Annotated[
        Path, typer.Option("--from-onnx", help="ONNX model (external data beside it is copied too)")
    ],
    name: Annotated[
        str | None, typer.Option(help="function name (default: the file's stem)")
    ] = None,
    version: Annotated[str, typer.Option(help="function version")] = "1",
    max_batch: Annotated[
        int, typer.Option("--max-batch", help="largest batch the build checks the memory at")
    ] = 64,
) -> None:
    """Start a function from a model: copy it in and write function.toml (kind onnx) with the
    graph's inputs and outputs (-1: the batch). Refuses what the build would refuse."""
    from .onnxfn import init

    try:
        done = init(from_onnx, directory, name, version, max_batch)
    except InferenceError as exc:
        fail(exc)
    info = done.info
    shapes = ", ".join(f"{t['name']} {t['datatype']} {t['shape']}" for t in info["inputs"])
    outs = ", ".join(f"{t['name']} {t['datatype']} {t['shape']}" for t in info["outputs"])
    out.print(f"wrote {done.manifest} ({', '.join(done.files)} copied beside it)")
    out.print(f"inputs: {shapes}\noutputs: {outs}")
    out.print(f"operators: {', '.join(info['operators']) or 'none'}")
    out.print(f"next: meshfn fn build {directory} --out dist/")


def _held_out(report: dict[str, Any]) -> str:
    """What a build report says of the held-out data: a classifier's accuracy, a language
    model's loss (nats per token)."""
    if "heldout_accuracy" in report:
        return f"held-out accuracy {report['heldout_accuracy']}"
    if "heldout_loss_nats" in report:
        return f"held-out loss {report['heldout_loss_nats']} nats/token"
    return ""


def _report_lines(info: dict[str, Any]) -> list[str]:
    """What `fn build` shows of the build report (all of it is in NAME-VERSION.json)."""
    report = info["build"]["report"]
    held_out = _held_out(report)
    lines = [held_out] if held_out else []
    if info["kind"] == "onnx":
        memory = report["memory"]
        opset = ", ".join(f"{d} {v}" for d, v in report["opset"].items())
        ops = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in report["operators"].items())
        lines += [
            f"opset {opset}; {report['parameters']} parameters",
            f"operators: {ops}",
            f"module {report['module_bytes']} bytes; peak linear memory "
            f"{memory['peak_bytes']} bytes at batch {memory['max_batch']} "
            f"({memory['arena_bytes_per_row']} bytes per row)",
            f"model sha256 {info['model']['sha256']}",
        ]
    return lines


@fn_app.command("build")
def build_cmd(
    directory: Annotated[Path, typer.Argument(help="function directory with function.toml")],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="copy the results here (default: the cache)")
    ] = None,
    force: Annotated[bool, typer.Option(help="rebuild even if the cache is current")] = False,
) -> None:
    """Build a function: componentize-py (Python), clang (core wasm) or the model compiler
    (ONNX) -> NAME-VERSION.wasm, with its report in NAME-VERSION.json."""
    from meshfn.common.progress import RichReporter

    from .build import build

    try:
        with RichReporter(err, "build") as progress:
            progress.begin(directory.name, 2)
            result = build(directory, out_dir, force=force, progress=progress)
            progress.finish(directory.name, cached=result.cached)
    except InferenceError as exc:
        fail(exc)
    info = result.info()
    state = "cached" if result.cached else "built"
    out.print(f"{state} {result.wasm} ({info['module_size']} bytes)")
    for line in _report_lines(info):
        out.print(f"  {line}")


@fn_app.command("sign")
def sign_cmd(
    wasm: Annotated[Path, typer.Argument(help="NAME-VERSION.wasm from fn build")],
    key: Annotated[Path, typer.Option("--key", help="ed25519 private key (PEM)")],
) -> None:
    """Sign a built module: ed25519 over its digest and metadata -> NAME-VERSION.sig.json."""
    from .registry import sign_module
    from .signing import load_private_key

    try:
        path = sign_module(wasm, load_private_key(key))
    except InferenceError as exc:
        fail(exc)
    out.print(f"signed {wasm} -> {path}")


@fn_app.command("publish")
def publish_cmd(
    wasm: Annotated[Path, typer.Argument(help="signed NAME-VERSION.wasm")],
    registry: Annotated[Path, typer.Option("--registry", help="registry directory")],
    key: Annotated[Path, typer.Option("--key", help="key that signs the compile record")],
    trusted_key: Annotated[
        list[Path] | None,
        typer.Option(
            "--trusted-key", help="accept module signatures by these keys (default: --key)"
        ),
    ] = None,
) -> None:
    """Verify, precompile (.cwasm for this wasmtime and engine settings) and install."""
    from .build import cache_root
    from .registry import Registry
    from .signing import TrustedKeys, load_private_key

    try:
        private = load_private_key(key)
        trusted = TrustedKeys.from_paths(trusted_key) if trusted_key else None
        entry = Registry(registry).publish(
            wasm, private, trusted, compile_cache=cache_root() / "functions" / "compiled"
        )
    except InferenceError as exc:
        fail(exc)
    out.print(f"published {entry}")


@fn_app.command("examples")
def examples_cmd(
    registry: Annotated[Path, typer.Option("--registry", help="registry directory")],
    testing: Annotated[bool, typer.Option(help="also the misbehaving test functions")] = False,
    force: Annotated[bool, typer.Option(help="rebuild and republish everything")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Build, sign (development key) and publish the example functions; cached."""
    from meshfn.common.progress import NULL, RichReporter

    from .examples import publish_examples

    try:
        with RichReporter(err, "functions") as progress:
            published, public = publish_examples(
                registry,
                include_testing=testing,
                force=force,
                progress=NULL if as_json else progress,
            )
    except InferenceError as exc:
        fail(exc)
    if as_json:
        rows = [
            {"name": p.name, "version": p.version, "kind": p.kind, "skipped": p.skipped}
            for p in published
        ]
        sys.stdout.write(json.dumps({"trusted_key": str(public), "functions": rows}) + "\n")
        return
    for p in published:
        summary = _held_out(p.report)
        extra = f" {summary}" if summary else ""
        out.print(
            f"{'unchanged' if p.skipped else 'published'} {p.name}@{p.version} ({p.kind}){extra}"
        )
    out.print(f"trusted key: {public}")


main_app = command_app("meshfn.inference", "meshfn inference backend (KServe v2 over wasmtime).")
main_app.add_typer(fn_app)


@main_app.command("serve")
def serve_cmd(
    registry: Annotated[Path | None, typer.Option("--registry", help="registry directory")] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="YAML/JSON BackendConfig (functions, limits)")
    ] = None,
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="listen port")] = 8080,
    grpc_port: Annotated[
        int | None,
        typer.Option("--grpc-port", help="also serve KServe v2 gRPC (GRPCInferenceService) here"),
    ] = None,
    workers: Annotated[int | None, typer.Option(help="threads running wasm per process")] = None,
    processes: Annotated[
        int | None,
        typer.Option(help="serving processes sharing the port (a dead one is restarted)"),
    ] = None,
    loop: Annotated[
        str, typer.Option(help="event loop: uvloop | asyncio (bench/coldstart.py measures both)")
    ] = "uvloop",
    unix_socket: Annotated[
        list[Path] | None,
        typer.Option(
            "--unix-socket",
            help="serve HTTP on this unix socket (mode 0600; put it in a directory only you can "
            "enter) instead of --host/--port; one per serving process",
        ),
    ] = None,
    grpc_unix_socket: Annotated[
        list[Path] | None,
        typer.Option(
            "--grpc-unix-socket",
            help="serve gRPC on this unix socket instead of --grpc-port; one per serving process",
        ),
    ] = None,
    listen_fd: Annotated[int | None, typer.Option(hidden=True)] = None,
    trusted_key: Annotated[
        list[Path] | None, typer.Option("--trusted-key", help="ed25519 public key file or dir")
    ] = None,
    drain_timeout: Annotated[
        float, typer.Option(help="seconds to finish requests on SIGTERM")
    ] = 10.0,
    log_format: Annotated[str, typer.Option(help="json | human")] = "json",
    log_level: Annotated[str, typer.Option(help="debug | info | warning | error")] = "info",
    watch_config: Annotated[
        float,
        typer.Option(
            "--watch-config",
            help="seconds between two looks at --config's file: a new file there reloads its "
            "tracing as SIGHUP does (a Kubernetes ConfigMap volume); 0: SIGHUP only",
        ),
    ] = 0.0,
) -> None:
    """Serve the registry's functions (or those in --config) until SIGTERM; then drain, exit 0."""
    from meshfn.common.logs import setup_logging

    from .config import load_config, parse_config

    setup_logging(log_format, log_level)
    # SIGHUP reloads tracing once serving (server.reload_tracing); until then it must not end
    # a backend that is still starting
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        if config is not None:
            cfg = load_config(config)
            cfg = cfg.with_overrides(
                registry=registry,
                workers=workers,
                processes=processes,
                trustedKeys=trusted_key or None,
            )
        elif registry is not None:
            cfg = parse_config(
                {"registry": str(registry), "trustedKeys": [str(k) for k in trusted_key or []]}
                | ({"workers": workers} if workers else {})
                | ({"processes": processes} if processes else {}),
                "flags",
            )
        else:
            fail("pass --registry DIR or --config FILE")
        if loop not in ("asyncio", "uvloop"):
            fail(f"--loop must be asyncio or uvloop, not {loop!r}")
        if watch_config and (config is None or not 0.1 <= watch_config <= 3600):
            fail("--watch-config takes 0.1 to 3600 seconds, and a --config file to watch")
        sockets, grpc_sockets = _unix_sockets(cfg, unix_socket, grpc_unix_socket, grpc_port)
        if cfg.processes > 1 and listen_fd is None:
            from .supervisor import Supervisor

            extra = ["--log-format", log_format, "--log-level", log_level, "--loop", loop]
            supervisor = Supervisor(
                cfg, host, port, drain_timeout, grpc_port, extra, sockets, grpc_sockets, config,
                watch_config,
            )  # fmt: skip
            asyncio.run(supervisor.run())
            return
        # watched, the file is replaced, not rewritten: its directory may be read (a ConfigMap
        # volume holds its keys and nothing else)
        readable = config.parent if config is not None and watch_config else config
        sandbox = _confine(cfg, readable, host, port, grpc_port, listen_fd, sockets, grpc_sockets)
        # Only now: the server imports numpy, whose BLAS starts a thread, and Landlock confines
        # only the threads created after it.
        from .server import serve

        main = serve(
            cfg,
            host,
            port,
            drain_timeout,
            grpc_port,
            listen_fd,
            sockets[0] if sockets else None,
            grpc_sockets[0] if grpc_sockets else None,
            sandbox,
            config,
            watch_config,
        )
        if loop == "uvloop":
            import uvloop

            uvloop.run(main)
        else:
            asyncio.run(main)
    except InferenceError as exc:
        fail(exc)
    except OSError as exc:
        fail(f"cannot serve on {', '.join(map(str, unix_socket or [])) or f'{host}:{port}'}: {exc}")


def _unix_sockets(
    cfg: BackendConfig,
    unix_socket: list[Path] | None,
    grpc_unix_socket: list[Path] | None,
    grpc_port: int | None,
) -> tuple[list[Path], list[Path]]:
    """--unix-socket and --grpc-unix-socket: one per serving process; gRPC one way only."""
    sockets, grpc_sockets = unix_socket or [], grpc_unix_socket or []
    for option, given in (("--unix-socket", sockets), ("--grpc-unix-socket", grpc_sockets)):
        if given and len(given) != cfg.processes:
            fail(
                f"{option} given {len(given)} time(s) for {cfg.processes} serving process(es):"
                " give one socket per process"
            )
    if grpc_sockets and grpc_port is not None:
        fail("give --grpc-port or --grpc-unix-socket, not both")
    return sockets, grpc_sockets


def _confine(
    cfg: BackendConfig,
    config: Path | None,
    host: str,
    port: int,
    grpc_port: int | None,
    fd: int | None,
    sockets: list[Path],
    grpc_sockets: list[Path],
) -> Any:
    """Landlock before anything else runs (sandbox.py: one thread, nothing read yet); the
    returned Sandbox adds seccomp once the server has started. What this process binds itself
    (a supervisor's child adopts its HTTP socket) is granted: its TCP ports, its unix sockets."""
    from .sandbox import Sandbox, SandboxError

    own_ports = [] if fd is not None or sockets else [port]
    own_ports += [grpc_port] if grpc_port else []
    own_sockets = ([] if fd is not None else sockets[:1]) + grpc_sockets[:1]
    sandbox = Sandbox(
        cfg, config.resolve() if config else None, tuple(own_ports), tuple(own_sockets)
    )
    try:
        sandbox.at_start()
    except SandboxError as exc:
        fail(exc)
    return sandbox


def published_versions(registry: Path) -> Callable[[str], list[str]]:
    """What the registry at `registry` holds of a function (name -> its published versions):
    the policy loader checks Rollouts' versions against it (the control plane's CLI reaches
    the registry only through this module)."""
    from .registry import Registry

    return Registry(registry).versions


def publish_examples(registry: Path, console: Console | None = None) -> tuple[list[Any], Path]:
    """Build, sign and publish the example functions (for `meshfn up --publish-examples`: the
    control plane's CLI reaches the backend only through this module), with progress on
    `console` and a last line saying what was cached."""
    from meshfn.common.progress import RichReporter

    from .examples import publish_examples as publish

    with RichReporter(console or err, "example functions") as progress:
        return publish(registry, progress=progress)


def main() -> None:
    run_cli(main_app)
