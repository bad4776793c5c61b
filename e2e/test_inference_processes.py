"""`processes: 2`: two serving processes behind one port (SO_REUSEPORT sockets the supervisor
keeps open). A process killed under load is restarted while the other serves, and no request
through the gateway (a real Envoy that retries a reset, as a Route's retryOn does) fails."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from meshfn_e2e import http, remap_examples

from meshfn.common.unix import unix_request
from meshfn.inference.devtools import RawHttp, write_envoy_config
from meshfn.inference.examples import publish_examples
from meshfn.testing.envoy import admin_json
from meshfn.testing.envoy import argv as envoy_argv
from meshfn.testing.envoy import start as start_envoy
from meshfn.testing.ports import free_port, free_ports, retry_on_port_clash
from meshfn.testing.processes import Processes, alive, issue_token, up_with_functions, wait_for

PY = sys.executable
DIGITS = json.dumps(
    {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [4] * 64}]}
).encode()


def pids(port: int, connections: int = 8) -> Counter[int]:
    """Which process answers each of `connections` new connections."""
    seen: Counter[int] = Counter()
    for _ in range(connections):
        client = RawHttp("127.0.0.1", port)
        try:
            status, body = client.request("GET", "/meshfn/functions")
            if status == 200:
                seen[json.loads(body)["pid"]] += 1
        finally:
            client.close()
    return seen


def envoy_retry_stats(admin: int) -> dict[str, int]:
    """The front Envoy's retry counters: a failure says whether a retry was refused."""
    stats = admin_json(admin, "/stats?format=json&filter=cluster.inference.upstream_rq_retry")
    return {s["name"]: s["value"] for s in stats["stats"] if "value" in s}


def test_a_killed_process_is_restarted_under_load_with_no_failed_request(
    tmp_path: Path,
) -> None:
    procs = Processes(tmp_path)
    try:
        _, key = publish_examples(tmp_path / "registry")
        config = tmp_path / "backend.json"
        config.write_text(
            json.dumps(
                {
                    "registry": str(tmp_path / "registry"),
                    "trustedKeys": [str(key)],
                    "processes": 2,
                    "functions": [{"name": "digits", "limits": {"maxConcurrency": 64}}],
                }
            )
        )
        port = free_port()
        backend = procs.start(
            "backend",
            [PY, "-P", "-m", "meshfn.inference", "serve", "--config", str(config),
             "--port", str(port), "--log-level", "warning"],
        )  # fmt: skip
        wait_for("two processes", lambda: len(pids(port)) == 2, timeout=90, proc=backend)
        first = set(pids(port, 16))
        assert backend.pid not in first  # the supervisor serves nothing itself

        def envoy_in_front() -> tuple[int, int]:
            listener, admin = free_ports(2)
            cfg = write_envoy_config(tmp_path / "envoy.json", listener, admin, port, retries=3)
            start_envoy(procs, "envoy", envoy_argv(cfg), admin)
            return listener, admin

        listener, admin = retry_on_port_clash(envoy_in_front)
        statuses: Counter[int] = Counter()
        errors: list[str] = []
        stop = threading.Event()

        def load() -> None:
            client = RawHttp("127.0.0.1", listener)
            raw = client.encode("POST", "/v2/models/digits/infer", DIGITS)
            try:
                while not stop.is_set():
                    status, body = client.send(raw)
                    statuses[status] += 1
                    if status != 200:
                        errors.append(body.decode(errors="replace"))
            except OSError as exc:
                errors.append(f"client connection failed: {exc}")
            finally:
                client.close()

        threads = [threading.Thread(target=load) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        wait_for(
            "the killed process replaced",
            lambda: len(current := set(pids(port))) == 2 and victim not in current,
            timeout=60,
            proc=backend,
        )
        time.sleep(1.0)  # the replacement serves its share too
        stop.set()
        for t in threads:
            t.join(timeout=30)
        retry_stats = envoy_retry_stats(admin)
        assert not errors, (errors[:5], retry_stats)
        assert statuses[200] > 100 and set(statuses) == {200}
        assert backend.stop() == 0  # SIGTERM: every child drains, the supervisor exits 0
        for pid in first - {victim}:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        procs.stop_all()


def test_grpc_on_every_process_and_a_sigkilled_supervisor_leaves_none(tmp_path: Path) -> None:
    """Every child serves KServe gRPC on the one port (it used to bind it alone: the second
    child died at start, again and again). The chaos soak SIGKILLs backends: the children must
    not keep serving with no parent."""
    import tritonclient.grpc as tgrpc

    procs = Processes(tmp_path)
    try:
        _, key = publish_examples(tmp_path / "registry")
        config = tmp_path / "backend.json"
        config.write_text(
            json.dumps({"registry": str(tmp_path / "registry"), "trustedKeys": [str(key)],
                        "processes": 2, "functions": [{"name": "digits"}]})
        )  # fmt: skip
        port, grpc_port = free_ports(2)
        backend = procs.start(
            "backend",
            [PY, "-P", "-m", "meshfn.inference", "serve", "--config", str(config),
             "--port", str(port), "--grpc-port", str(grpc_port), "--log-level", "warning",
             "--drain-timeout", "2"],
        )  # fmt: skip
        wait_for("two processes", lambda: len(pids(port)) == 2, timeout=90, proc=backend)
        children = set(pids(port, 16))
        for _ in range(8):  # new connections: the kernel spreads them over both children
            client = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            pixels = tgrpc.InferInput("pixels", [1, 64], "FP32")
            pixels.set_data_from_numpy(np.full((1, 64), 4, dtype=np.float32))
            assert client.infer("digits", [pixels]).as_numpy("label") is not None
            client.close()
        time.sleep(1.0)
        assert "restarting" not in backend.output(), backend.output()[-2000:]
        assert set(pids(port, 16)) == children
        os.kill(backend.pid, signal.SIGKILL)
        wait_for("the children exited", lambda: not any(map(alive, children)), timeout=30)
    finally:
        procs.stop_all()


def tracings(port: int, connections: int = 16) -> dict[int, Any]:
    """Each answering process's tracing, as its /meshfn/functions shows it."""
    seen: dict[int, Any] = {}
    for _ in range(connections):
        client = RawHttp("127.0.0.1", port)
        try:
            status, body = client.request("GET", "/meshfn/functions")
            if status == 200:
                document = json.loads(body)
                seen[document["pid"]] = document["tracing"]
        finally:
            client.close()
    return seen


def test_sighup_reloads_tracing_in_every_process_without_restarting_one(tmp_path: Path) -> None:
    """What `meshfn up` does when only the Mesh's tracing changed: rewrite the config, SIGHUP.
    The supervisor gives each child the new tracing (their config is its copy) and signals
    them; every process, confined by Landlock and seccomp, rereads it and nothing restarts.
    Off again the same way."""
    procs = Processes(tmp_path)
    try:
        _, key = publish_examples(tmp_path / "registry")
        config = tmp_path / "backend.json"
        base = {"registry": str(tmp_path / "registry"), "trustedKeys": [str(key)],
                "processes": 2, "functions": [{"name": "digits"}]}  # fmt: skip
        config.write_text(json.dumps(base))
        port = free_port()
        backend = procs.start(
            "backend",
            [PY, "-P", "-m", "meshfn.inference", "serve", "--config", str(config),
             "--port", str(port), "--log-level", "info", "--drain-timeout", "2"],
        )  # fmt: skip
        assert backend.pid is not None
        wait_for("two processes", lambda: len(pids(port)) == 2, timeout=90, proc=backend)
        children = set(tracings(port))
        assert len(children) == 2 and set(tracings(port).values()) == {None}
        assert "landlock" in backend.output().lower()
        traced = {**base, "tracing": {"pullToken": "ab" * 16, "sampling": 7}}
        config.write_text(json.dumps(traced))
        os.kill(backend.pid, signal.SIGHUP)

        def shown(sampling: float | None) -> bool:
            seen = tracings(port)
            return set(seen) == children and all(
                (t or {}).get("sampling") == sampling for t in seen.values()
            )

        wait_for("both processes tracing at 7%", lambda: shown(7), timeout=30, proc=backend)
        config.write_text(json.dumps(base))
        os.kill(backend.pid, signal.SIGHUP)
        wait_for("both processes not tracing", lambda: shown(None), timeout=30, proc=backend)
        assert "restarting" not in backend.output(), backend.output()[-2000:]
        assert set(pids(port, 16)) == children
    finally:
        procs.stop_all()


def _volume(directory: Path, text: str, version: int) -> None:
    """`directory` as the kubelet writes a ConfigMap volume with `text` in its one key: the key
    is a symlink through `..data`, itself a symlink to a timestamped directory, swapped in by
    one rename."""
    directory.mkdir(exist_ok=True)
    fresh = directory / f"..2026_12_06_{version:02d}"
    fresh.mkdir()
    (fresh / "backend.json").write_text(text)
    (directory / "..data_tmp").symlink_to(fresh.name)
    (directory / "..data_tmp").rename(directory / "..data")
    if not (directory / "backend.json").is_symlink():
        (directory / "backend.json").symlink_to("..data/backend.json")
    for old in directory.glob("..2026_12_06_*"):
        if old != fresh:
            (old / "backend.json").unlink()
            old.rmdir()


@pytest.mark.parametrize("processes", [1, 2])
def test_a_watched_configmap_volume_reloads_tracing_in_place(
    tmp_path: Path, processes: int
) -> None:
    """On Kubernetes no `meshfn up` sends SIGHUP: the backend looks at its config file every
    `--watch-config` seconds and reloads the tracing of a new one, swapped in as the kubelet
    swaps a ConfigMap volume, confined by Landlock (which may read the volume's directory,
    not only the file it started with) and seccomp. A file that does not parse changes
    nothing; the next good one applies; no process restarts."""
    procs = Processes(tmp_path)
    try:
        _, key = publish_examples(tmp_path / "registry")
        volume = tmp_path / "volume"
        base = {"registry": str(tmp_path / "registry"), "trustedKeys": [str(key)],
                "processes": processes, "functions": [{"name": "digits"}]}  # fmt: skip
        traced = {**base, "tracing": {"pullToken": "ab" * 16, "sampling": 7}}
        _volume(volume, json.dumps(traced), 1)
        port = free_port()
        backend = procs.start(
            "backend",
            [PY, "-P", "-m", "meshfn.inference", "serve", "--config", str(volume / "backend.json"),
             "--port", str(port), "--log-level", "info", "--drain-timeout", "2",
             "--watch-config", "0.2"],
        )  # fmt: skip
        wait_for("the backend", lambda: len(pids(port)) == processes, timeout=90, proc=backend)
        serving = set(tracings(port))
        assert "landlock" in backend.output().lower()

        def shown(sampling: float) -> bool:
            seen = tracings(port)
            return set(seen) == serving and all(
                (t or {}).get("sampling") == sampling for t in seen.values()
            )

        assert shown(7)
        at42 = {**traced, "tracing": {"pullToken": "ab" * 16, "sampling": 42}}
        _volume(volume, json.dumps(at42), 2)
        wait_for("tracing at 42%", lambda: shown(42), timeout=30, proc=backend)
        _volume(volume, "{not a config", 3)
        wait_for(
            "the broken file refused",
            lambda: "config reload: tracing unchanged" in backend.output(),
            timeout=30,
            proc=backend,
        )
        assert shown(42)
        at3 = {**traced, "tracing": {"pullToken": "ab" * 16, "sampling": 3}}
        _volume(volume, json.dumps(at3), 4)
        wait_for("tracing at 3%", lambda: shown(3), timeout=30, proc=backend)
        assert "restarting" not in backend.output(), backend.output()[-2000:]
        assert set(pids(port, 16)) == serving
    finally:
        procs.stop_all()


def test_watch_config_needs_a_file_and_a_sane_period(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps({"registry": str(tmp_path)}))
    for argv, message in (
        (["--registry", str(tmp_path), "--watch-config", "5"], "a --config file to watch"),
        (["--config", str(tmp_path / "c.json"), "--watch-config", "0.01"], "0.1 to 3600"),
    ):
        done = subprocess.run(
            [PY, "-P", "-m", "meshfn.inference", "serve", *argv],
            check=False, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode != 0 and message in done.stderr + done.stdout, done


def test_meshfn_up_runs_each_backend_process_behind_its_own_socket(tmp_path: Path) -> None:
    """`meshfn up --backend-processes 2`: behind a sidecar a backend serves on unix sockets, and
    a unix socket has no SO_REUSEPORT, so each serving process has its own (HTTP and gRPC) and
    the sidecar balances over them: both processes answer requests through the gateway."""
    import tritonclient.grpc as tgrpc

    procs = Processes(tmp_path)
    mapping = remap_examples(tmp_path / "examples")
    state = tmp_path / "state"
    try:
        argv = up_with_functions(tmp_path / "examples", state, tmp_path / "functions")
        up = procs.start("up", [*argv, "--backend-processes", "2"])
        wait_for("the example mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=240)
        # every proxy starts with a limit on its connections (Envoy warns where it has none)
        logs = sorted((state / "logs").glob("envoy-*.log"))
        assert len(logs) >= 4, logs
        for log in logs:
            assert "no configured limit" not in log.read_text(), log
        # each backend's sockets are in its own directory (its sandbox's only writable one)
        own = {p: state / "inference" / f"127.0.0.1-{mapping[p]}" for p in (9101, 9102, 9103)}
        http_sockets = {(p, k): own[p] / f"http.{k}.sock" for p in own for k in (0, 1)}
        found = sorted(str(path) for d in own.values() for path in d.glob("*.sock"))
        assert len(found) == 3 * 2 * 2, found  # HTTP and gRPC per process
        assert [p.name for p in (state / "workloads").iterdir()] == [
            f"127.0.0.1-{mapping[9201]}.sock"
        ]  # echo
        backend_pids = set()
        for path in found:
            assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600, path
        for path in http_sockets.values():
            status, body = unix_request(path, "/meshfn/functions")
            assert status == 200, body
            backend_pids.add(json.loads(body)["pid"])
        assert len(backend_pids) == 6  # every socket its own process

        token = issue_token(state, "alice", "acme")
        gateway = f"127.0.0.1:{mapping[10000]}"
        headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
        for _ in range(40):
            answer = http(f"http://{gateway}/v2/models/digits/infer", "POST", headers, DIGITS)
            assert answer.status == 200, answer

        def served(path: Path) -> int:
            status, body = unix_request(path, "/v2/models/digits/stats")
            assert status == 200, body
            return int(json.loads(body)["model_stats"][0]["inference_count"])

        counts = {str(path): served(path) for path in http_sockets.values()}
        assert sum(counts.values()) == 40, counts
        local = [counts[str(http_sockets[9101, k])] for k in (0, 1)]
        assert min(local) > 0, counts  # the local endpoint's two processes both served

        grpc = tgrpc.InferenceServerClient(gateway)
        pixels = tgrpc.InferInput("pixels", [1, 64], "FP32")
        pixels.set_data_from_numpy(np.full((1, 64), 4, dtype=np.float32))
        for _ in range(4):
            answer = grpc.infer("digits", [pixels], headers={"authorization": f"Bearer {token}"})
            assert answer.as_numpy("label") is not None
        grpc.close()
    finally:
        procs.stop_all()
    assert not list((state / "workloads").iterdir())  # every process removed its sockets
    assert not list((state / "inference").glob("*/*.sock"))
