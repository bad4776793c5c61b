"""`meshfn up` end to end: real Envoy, real upstreams, hot reload, NACKs, supervision, shutdown."""

from __future__ import annotations

import hmac
import json
import os
import re
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from meshfn_e2e import (
    Processes,
    admin_get,
    children_of,
    envoy_pids,
    http,
    proxies,
    remap_examples,
    served_by,
    wait_for_synced,
)

from meshfn.contracts.plugins import BUILDS
from meshfn.control_plane.runtime.hints import meshfn_command
from meshfn.testing.envoy import active_cluster
from meshfn.testing.envoy import stat as envoy_stat
from meshfn.testing.policies import Policies, documents, service
from meshfn.testing.processes import MESHFN, alive, meshfn, wait_for


def test_route_change_becomes_visible(procs: Processes, policies: Policies) -> None:
    """(a) + (d): an edited policy file reaches Envoy, over SotW and over Delta."""
    up = procs.up(policies)
    (proxy,) = proxies(policies)
    assert proxy["protocol"] == policies.protocol
    assert served_by(policies, "/v1/x") == "default/alpha"
    assert http(policies.gateway + "/v2/x").status == 404
    policies.route("/v2", "beta")  # how fast: bench/xds_push.py's visible_p50_ms
    wait_for("the new route", lambda: served_by(policies, "/v2/x") == "default/beta", timeout=30)
    assert http(policies.gateway + "/v1/x").status == 404
    assert up.popen is not None and up.popen.poll() is None
    # What changed is visible on the admin port too.
    metrics = admin_get(policies, "/metrics").body.decode()
    label = f'protocol="{policies.protocol}",type="routes"'
    assert f"meshfn_xds_pushes_total{{{label}}} 2.0" in metrics
    assert f'meshfn_xds_connected_proxies{{protocol="{policies.protocol}"}} 1.0' in metrics
    assert 'meshfn_xds_push_latency_seconds_count{type="routes"} 2.0' in metrics
    assert 'meshfn_policy_reloads_total{result="ok"}' in metrics
    snapshots = admin_get(policies, "/debug/snapshots").json()
    routes_version = snapshots["edge.default"]["types"]["RouteConfiguration"]["version"]
    wait_for("the ACK", lambda: proxies(policies)[0]["types"]["routes"]["acked"] == routes_version)
    assert admin_get(policies, "/debug/config_dump?node=nobody").status == 404


def test_invalid_policy_is_rejected_and_envoy_keeps_serving(
    procs: Processes, delta_policies: Policies
) -> None:
    """(b): file:line in status and CLI; nothing pushed; the old route keeps working."""
    policies = delta_policies
    procs.up(policies)
    before = proxies(policies)[0]["types"]
    policies.write(
        "route.yaml",
        "apiVersion: meshfn.io/v1alpha1\nkind: Route\nmetadata: {name: main}\nspec:\n  destination: {service: gamma}\n",
    )
    status = wait_for(
        "the policy error",
        lambda: (d := admin_get(policies, "/debug/status").json())["policy_errors"] and d,
    )
    (error,) = status["policy_errors"]
    assert (
        error
        == f"{policies.root}/route.yaml:5: spec.destination.service: unknown Service default/gamma (did you mean default/alpha?)"
    )
    assert served_by(policies, "/v1/x") == "default/alpha"
    assert proxies(policies)[0]["types"] == before  # nothing was pushed
    cli = meshfn("status", "--state-dir", str(policies.state))
    assert cli.returncode == 0, cli.stderr
    assert "route.yaml:5: spec.destination.service: unknown Service default/gamma" in cli.stderr
    assert "SYNCED" in cli.stdout
    # Malformed YAML is rejected the same way; a fix then goes through.
    policies.write("route.yaml", "kind: [unclosed\n")
    wait_for(
        "the YAML error",
        lambda: any(
            "malformed YAML" in e
            for e in admin_get(policies, "/debug/status").json()["policy_errors"]
        ),
    )
    assert served_by(policies, "/v1/x") == "default/alpha"
    policies.route("/v1", "beta")
    wait_for("the fix", lambda: served_by(policies, "/v1/x") == "default/beta")
    assert admin_get(policies, "/debug/status").json()["policy_errors"] == []


# RE2 accepts this, but its program is far above Envoy's default size limit (100).
HUGE_REGEX = "^/(" + "|".join(f"model-{i}-[a-z]+" for i in range(40)) + ")$"


def test_config_envoy_nacks_shows_in_status(procs: Processes, policies: Policies) -> None:
    """(c): Envoy refuses a route; `meshfn status` shows the NACK; the previous routes stay."""
    procs.up(policies)
    policies.write(
        "route.yaml",
        "apiVersion: meshfn.io/v1alpha1\nkind: Route\nmetadata: {name: main}\nspec:\n"
        f"  matches: [{{path: {{prefix: /v1}}}}, {{path: {{regex: '{HUGE_REGEX}'}}}}]\n"
        "  destination: {service: beta}\n",
    )

    def nacked() -> dict[str, object] | None:
        routes = proxies(policies)[0]["types"]["routes"]
        return routes if routes["last_nack"] else None

    routes = wait_for("the NACK", nacked)
    assert "program size" in routes["last_nack"]["error"].lower()
    assert (
        'meshfn_xds_nacks_total{type="routes"} 1.0' in admin_get(policies, "/metrics").body.decode()
    )
    assert routes["acked"] != routes["sent"]
    assert served_by(policies, "/v1/x") == "default/alpha"  # old version still in force
    cli = meshfn("status", "--state-dir", str(policies.state))
    assert "NACKED" in cli.stdout and "NACK edge.default~0 routes" in cli.stdout
    dump = meshfn(
        "config-dump", "edge.default~0", "--state-dir", str(policies.state), "--type", "routes"
    )
    assert dump.returncode == 0 and "model-39" in dump.stdout  # what we send, NACKed or not
    policies.route("/v1", "beta")
    wait_for("recovery", lambda: served_by(policies, "/v1/x") == "default/beta")
    assert proxies(policies)[0]["types"]["routes"]["in_sync"]


def test_envoy_is_restarted_when_it_dies(procs: Processes, delta_policies: Policies) -> None:
    up = procs.up(delta_policies)
    (first,) = envoy_pids(up)
    signal_pid = first
    import os

    os.kill(signal_pid, signal.SIGKILL)
    second = wait_for("a new Envoy", lambda: [p for p in envoy_pids(up) if p != first])
    assert second
    wait_for("traffic again", lambda: served_by(delta_policies, "/v1/x") == "default/alpha")
    wait_for_synced(delta_policies, up)


@pytest.mark.parametrize(
    ("stop_signal", "placed"), [(signal.SIGINT, False), (signal.SIGTERM, True)], ids=["int", "term"]
)
def test_up_on_the_examples_and_clean_shutdown(
    procs: Processes, tmp_path: Path, stop_signal: int, placed: bool
) -> None:
    """The README's `./dev.sh up`: every example works end to end, then a clean stop. `placed`:
    with the proxies and the backends on CPUs apart (--proxy-cpus, --backend-cpus)."""
    mapping = remap_examples(tmp_path / "examples")
    listener, admin = mapping[10000], mapping[18001]
    state = tmp_path / "state"
    allowed = sorted(os.sched_getaffinity(0))
    proxy_cpu, backend_cpu = allowed[0], allowed[-1]  # the same one where only one is allowed
    placement = ["--proxy-cpus", str(proxy_cpu), "--backend-cpus", str(backend_cpu)]
    up = procs.start(
        "up",
        [MESHFN, "up", "--policies", str(tmp_path / "examples"), "--state-dir", str(state),
         "--functions-registry", str(tmp_path / "functions"), "--publish-examples",
         *(placement if placed else [])],
    )  # fmt: skip
    # The first build of the example functions takes a minute; later runs use the cache.
    wait_for("the example mesh", lambda: "Ctrl-C stops everything" in up.output(), timeout=240)
    base = f"http://127.0.0.1:{listener}"
    token = meshfn(
        "token", "issue", "--state-dir", str(state), "--sub", "alice", "--aud", "meshfn",
        "--claim", "tenant=acme",
    ).stdout.strip()  # fmt: skip
    auth = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    flower = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4],
                          "data": [5.1, 3.5, 1.4, 0.2]}]}  # fmt: skip
    infer = base + "/v2/models/iris/infer"
    body = json.dumps(flower).encode()
    # Model calls want a known tenant: without a token 403, with a bad one 401.
    assert http(infer, "POST", {"content-type": "application/json"}, body=body).status == 403
    bad = {"authorization": "Bearer x.y.z", "content-type": "application/json"}
    assert http(infer, "POST", bad, body=body).status == 401
    answer = http(infer, "POST", auth, body=body)
    assert answer.status == 200, answer.body
    outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
    assert outputs["label"] == [0]  # a setosa, the iris model trained at build time says so
    metadata = http(base + "/v2/models/digits", headers=auth).json()
    assert metadata["name"] == "digits" and metadata["inputs"][0]["shape"] == [-1, 64]
    assert metadata["platform"] == "meshfn-wasm-onnx"  # compiled from ONNX at setup
    # the gradient-boosted trees and the CNN, compiled at setup too, answer through the mesh
    cells = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 30],
                         "data": [[14.0] + [0.1] * 29, [20.0] + [1.0] * 29]}]}  # fmt: skip
    trees = http(base + "/v2/models/cancer/infer", "POST", auth, json.dumps(cells).encode())
    assert trees.status == 200, trees.body
    assert {o["name"]: o["shape"] for o in trees.json()["outputs"]} == {
        "label": [2], "probabilities": [2, 2],
    }  # fmt: skip
    blank = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 1, 8, 8],
                         "data": [0.0] * 64}]}  # fmt: skip
    cnn = http(base + "/v2/models/digits-cnn/infer", "POST", auth, json.dumps(blank).encode())
    assert cnn.status == 200, cnn.body
    probabilities = next(o for o in cnn.json()["outputs"] if o["name"] == "probabilities")
    assert abs(sum(probabilities["data"]) - 1) < 1e-5
    text = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    embedded = http(base + "/v2/models/embedder/infer", "POST", auth, json.dumps(text).encode())
    assert embedded.status == 200, embedded.body
    assert http(base + "/v2/models/unknown", headers=auth).status == 404  # no route
    # The plain route: prefix, and a regex that needs GET and a header.
    assert http(base + "/echo/hi", headers=auth).json()["service"] == "default/echo"
    assert http(base + "/debug/stats", headers=auth).status == 404  # no x-debug header
    debug = http(base + "/debug/stats", headers={**auth, "x-debug": "1"})
    assert debug.json()["service"] == "default/echo"
    status = admin_get(f"http://127.0.0.1:{admin}", "/debug/status", state).json()
    # acceleration: auto attaches here (root, a kernel with sockmap): the hops are redirected.
    assert status["acceleration"]["attached"], status["acceleration"]
    assert status["acceleration"]["counters"]["messages_redirected"] > 0
    metrics = admin_get(f"http://127.0.0.1:{admin}", "/metrics", state).body.decode()
    assert "meshfn_ebpf_messages_redirected" in metrics
    assert len(status["proxies"]) == 5 and all(
        t["in_sync"] for p in status["proxies"] for t in p["types"].values()
    )
    named = json.loads((state / "state.json").read_text())["children"]
    children = list(named.values())
    # 5 Envoys (the gateway, 4 sidecars), 3 inference backends, 1 placeholder upstream.
    assert len(children) == 9 and all(alive(pid) for pid in children)
    if placed:  # every thread of each child on its CPU; unplaced, on any the test may use
        for name, pid in named.items():
            want = {proxy_cpu} if name.startswith("envoy ") else {backend_cpu}
            assert _thread_cpus(pid) == [want], name
    else:
        assert all(_thread_cpus(pid) == [set(allowed)] for pid in children)
    output = up.output()
    # pastes as it is: this meshfn by its path (relative to the caller's directory), plain
    # `meshfn` only if PATH finds this one
    command = meshfn_command(MESHFN)
    assert f"TOKEN=$({command} token issue --state-dir {state} " in output
    assert (
        f'curl -s -H "authorization: Bearer $TOKEN" http://127.0.0.1:{listener}/v2/models/iris'
        in output
    )

    assert status["audit"]["enabled"] and status["audit"]["error"] is None, status["audit"]
    cli = meshfn("status", "--state-dir", str(state)).stdout
    assert "audit trail" in cli and "4 journal(s)" in cli, cli

    assert up.stop(stop_signal) == 0
    assert not any(alive(pid) for pid in children), "a child outlived meshfn up"
    assert children_of(up.pid) == []
    assert not (state / "state.json").exists()
    assert not list((state / "workloads").iterdir())  # the applications removed their sockets
    assert not list((state / "inference").glob("*/*.sock"))  # the backends' own directories
    _check_audit_trail(state)
    from meshfn.ebpf import Accelerator

    assert Accelerator(state).stats()["attached"] == 0, "eBPF stayed attached after meshfn up"


def _thread_cpus(pid: int) -> list[set[int]]:
    """The distinct CPU sets of a process's threads."""
    found: set[frozenset[int]] = set()
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add(frozenset(os.sched_getaffinity(int(thread))))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    return [set(cpus) for cpus in found]


def _check_audit_trail(state: Path) -> None:
    """Mesh.spec.audit of the examples: every model call the sidecars answered is in the store
    (stored at shutdown at the latest), with the caller's SPIFFE ID, the salted subject, the
    tenant and the verdict, and the chain verifies."""
    store = str(state / "audit" / "audit.db")
    verified = meshfn("audit", "verify", "--store", store, "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    report = json.loads(verified.stdout)
    assert report["ok"] and report["records"] >= 6 and report["checkpoints"] >= 1, report

    def query(*args: str) -> list[dict[str, Any]]:
        out = meshfn("audit", "query", "--store", store, "--json", "--limit", "10000", *args)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    infer = "/v2/models/iris/infer"
    by_status = {r["status"]: r for r in query() if r.get("path") == infer}
    assert set(by_status) == {200, 401, 403}, by_status
    ok, denied = by_status[200], by_status[403]
    assert ok["principal"] == "spiffe://meshfn.local/ns/ingress/sa/edge"
    assert ok["tenant"] == "acme" and ok["method"] == "POST" and ok["audited"]
    assert ok["source"].startswith("models.default:"), ok
    # the mesh route the gateway matched, vouched for by its mTLS identity
    assert ok["route"] == "default/function-iris" and ok["route_source"] == "gateway", ok
    assert ok in query("--route", "default/function-iris")
    assert denied["subject"] is None  # no token, no subject; still recorded
    salt = (state / "audit" / "subject.salt").read_text().strip()
    subject = hmac.new(bytes.fromhex(salt), b"alice", "sha256").hexdigest()
    assert ok in query("--subject-raw", "alice")  # the salt is found next to the store
    assert ok in query("--subject", subject)
    # what the trail never holds: the token, the salt
    for path in (state / "audit").glob("audit.db*"):
        raw = path.read_bytes()
        assert b"Bearer" not in raw and salt.encode() not in raw, path
    # GDPR erasure: alice's records stay and verify, but nothing links them to her any more
    erased = meshfn("audit", "erase", "--store", store, "--subject-raw", "alice")
    assert erased.returncode == 0 and "can no longer be linked" in erased.stdout, erased.stdout
    assert query("--subject-raw", "alice") == []
    assert meshfn("audit", "verify", "--store", store).returncode == 0
    for path in (state / "audit").glob("audit.db*"):
        assert subject.encode() not in path.read_bytes(), path


def test_up_refuses_invalid_policies(procs: Processes, tmp_path: Path) -> None:
    policies = Policies(tmp_path / "p")
    policies.write(
        "route.yaml",
        "apiVersion: meshfn.io/v1alpha1\nkind: Route\nmetadata: {name: main}\nspec:\n  destination: {service: nope}\n",
    )
    up = procs.start(
        "up", [MESHFN, "up", "--policies", str(policies.root), "--state-dir", str(tmp_path / "s")]
    )
    assert up.wait() == 1
    assert "route.yaml:5: spec.destination.service: unknown Service default/nope" in up.output()
    assert "nothing started" in up.output()


def test_up_refuses_a_setting_that_is_not_an_integer(
    procs: Processes, policies: Policies, tmp_path: Path
) -> None:
    """An integer variable set to something else stops `meshfn up` before anything runs, with
    one line naming it and its range (the trace store read it later, with a traceback)."""
    settings = (("MESHFN_TRACE_STORE_TRACES", "lots"), ("MESHFN_PROXY_MAX_CONNECTIONS", "0"))
    for i, (name, value) in enumerate(settings):
        state = tmp_path / f"s{i}"  # short: the admin sockets' paths must fit
        up = procs.start(
            f"up-{name}",
            [MESHFN, "up", "--policies", str(policies.root), "--state-dir", str(state)],
            env={**os.environ, name: value},
        )
        assert up.wait() == 1
        assert f"{name} must be an integer from 1 to" in up.output(), up.output()
        assert "Traceback" not in up.output() and "Ctrl-C" not in up.output()
        assert not list(state.glob("logs/envoy-*.log"))  # no proxy started


def _with_audit(policies: Policies, spec: str) -> None:
    mesh = (policies.root / "mesh.yaml").read_text()
    policies.write("mesh.yaml", mesh.replace("spec: {trustDomain: e2e.local,", f"spec: {{{spec},"))


def test_audit_switched_on_by_hot_reload(procs: Processes, policies: Policies) -> None:
    """Mesh.spec.audit added while running: the gateway gets the audit filter and its journal,
    the collector starts, and every request after that is stored once, in a verifiable chain."""
    up = procs.up(policies)
    _with_audit(policies, "audit: {proxies: gateways}, trustDomain: e2e.local")
    admin = policies.admin

    def audited() -> bool:
        """A request reaches the journal (the new listener took over from the draining one)."""
        served_by(policies, "/v1/probe")
        journals = admin_get(admin, "/debug/status", policies.state).json()["audit"]
        journals = journals.get("journals", [])
        return bool(journals) and Path(journals[0]["path"]).stat().st_size > 0

    wait_for("the audited listener", audited, timeout=20, every=0.3)
    for i in range(50):
        assert http(f"{policies.gateway}/v1/req-{i}").status == 200
    assert up.stop() == 0  # the collector stores the rest after the proxies stopped
    store = str(procs.tmp / "state" / "audit" / "audit.db")
    assert meshfn("audit", "verify", "--store", store).returncode == 0
    rows = meshfn("audit", "query", "--store", store, "--json", "--limit", "1000").stdout
    paths = [json.loads(line)["path"] for line in rows.splitlines()]
    assert sorted(p for p in paths if p.startswith("/v1/req-")) == sorted(
        f"/v1/req-{i}" for i in range(50)
    )


def test_a_broken_filter_is_nacked_and_nothing_runs_unaudited(
    procs: Processes, policies: Policies
) -> None:
    """Filters Envoy cannot load (a corrupt .wasm): Envoy refuses the listener (fail closed),
    `meshfn status` shows the NACK, and the port serves nothing rather than serve unaudited."""
    broken = procs.tmp / "broken-wasm"
    broken.mkdir()
    for name in BUILDS:
        (broken / f"{name}.wasm").write_bytes(b"\0asm\x01\0\0\0 not a module")
    _with_audit(policies, "audit: {proxies: gateways}, trustDomain: e2e.local")
    procs.start(
        "up",
        [MESHFN, "up", "--policies", str(policies.root), "--state-dir", str(procs.tmp / "state")],
        env={**os.environ, "MESHFN_WASM_DIR": str(broken)},
    )

    def nacked() -> dict[str, Any] | None:
        found = proxies(policies)
        listeners = found[0]["types"].get("listeners") if found else None
        return listeners if listeners and listeners["last_nack"] else None

    listeners = wait_for("the NACK", nacked, timeout=30)
    assert "wasm" in listeners["last_nack"]["error"].lower(), listeners
    # the mesh never finished starting: no state.json yet, so the admin URL is given
    cli = meshfn("status", "--admin", policies.admin, "--state-dir", str(policies.state))
    assert "NACK edge.default~0 listeners" in cli.stdout, cli.stdout
    with pytest.raises(OSError):
        http(policies.gateway + "/v1/x", timeout=2)


def test_a_changed_cluster_serves_at_once(procs: Processes, policies: Policies) -> None:
    """A hot reload that changes a cluster (here its load balancer) takes effect at once. Envoy
    replaces the cluster, and the new one warms until it gets its endpoints, which Envoy does
    not ask for again: unless the control plane sends them, it waits for the initial-fetch
    timeout (15 s), and meanwhile the old cluster serves."""
    procs.up(policies)
    wait_for_synced(policies)
    admin = policies.ports["envoy_admin"]
    p = policies.ports

    def alpha() -> dict[str, Any]:
        return active_cluster(admin, "alpha.default")

    assert alpha().get("lb_policy") != "LEAST_REQUEST"
    policies.write(
        "services.yaml",
        documents(
            service("alpha", p["alpha"], loadBalancer="least-request"), service("beta", p["beta"])
        ),
    )
    wait_for("the new cluster", lambda: alpha().get("lb_policy") == "LEAST_REQUEST", timeout=30)
    # It took over because its endpoints came, not because it gave up waiting for them.
    assert envoy_stat(admin, "cluster.alpha.default.init_fetch_timeout") == 0
    assert envoy_stat(admin, "cluster_manager.warming_clusters") == 0
    assert served_by(policies, "/v1/x") == "default/alpha"


def test_a_proxy_at_its_connection_limit_refuses_new_ones_and_says_so(
    procs: Processes, policies: Policies
) -> None:
    """MESHFN_PROXY_MAX_CONNECTIONS=4: the gateway serves four kept-alive clients, closes a
    fifth as it accepts it while the four keep working, and /metrics and `meshfn status` count
    what it refused."""
    procs.up(policies, env={"MESHFN_PROXY_MAX_CONNECTIONS": "4"})
    host, port = policies.gateway.removeprefix("http://").rsplit(":", 1)
    request = b"GET /v1/x HTTP/1.1\r\nHost: x\r\n\r\n"

    def answer(conn: socket.socket) -> bytes:
        try:
            conn.sendall(request)
            return conn.recv(65536)
        except ConnectionError:
            return b""

    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(4)]
    try:
        assert all(answer(c).startswith(b"HTTP/1.1 200") for c in held)
        with socket.create_connection((host, int(port)), timeout=5) as fifth:
            assert answer(fifth) == b""
        assert all(answer(c).startswith(b"HTTP/1.1 200") for c in held)
    finally:
        for conn in held:
            conn.close()

    def refused() -> float | None:
        metrics = admin_get(policies, "/metrics").body.decode()  # a scrape reads the proxies
        found = re.search(
            r'^meshfn_proxy_connections_refused_total\{proxy="edge.default"\} (\S+)$', metrics, re.M
        )
        return float(found.group(1)) if found and float(found.group(1)) else None

    assert wait_for("the refusal in /metrics", refused, timeout=20, every=0.5) >= 1
    shown = meshfn("status", "--state-dir", str(policies.state)).stdout
    assert "proxy edge.default: 1 connection(s) refused at its connection limit" in shown, shown
