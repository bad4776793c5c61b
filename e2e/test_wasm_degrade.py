"""The degrade filter in real Envoy: reroute through an internal routing header and
clear_route_cache, reject with 503 JSON, spoofed headers stripped (and the route recomputed),
the trigger header honoured only for named mTLS callers, counters in Envoy's stats, new plugin
config pushed live (as the drift breaker does), and malformed config refused (fail closed)."""

from __future__ import annotations

import http.client as httpclient
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from meshfn_e2e import http

from meshfn.contracts.plugins import AuditSettings, DegradeRule, DegradeSettings, Trigger
from meshfn.testing.envoy import argv as envoy_argv
from meshfn.testing.envoy import start as start_envoy
from meshfn.testing.envoy import stat as envoy_stat
from meshfn.testing.filters import audit_filter, degrade_filter, harness, meshfn_filter, wasm_path
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import Proc, Processes, wait_for
from meshfn.xds.translate.wasm import early_header_mutation, wasm_http_filter

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
OPS = "spiffe://e2e.local/ns/ops/sa/drill"
ALICE = "spiffe://e2e.local/ns/default/sa/alice"
HDR = "x-meshfn-degrade-route"


es = harness("envoy_static")

ROUTES = [
    es.route("classifier-cpu", "cpu", "/v2/models/classifier", (HDR, "classifier-cpu")),
    es.route("classifier-cache", "cache", "/v2/models/classifier", (HDR, "classifier-cache")),
    es.route("classifier", "gpu", "/v2/models/classifier"),
    es.route("embedder", "gpu", "/v2/models/embedder"),
]


def settings(
    classifier: int = 0, embedder: int = 0, classifier_mode: str = "reroute"
) -> DegradeSettings:
    fallbacks = ["classifier-cpu", "classifier-cache"] if classifier_mode == "reroute" else []
    return DegradeSettings(
        trigger=Trigger(principals=[OPS]),
        rules=[
            DegradeRule(
                name="classifier",
                routes=["classifier"],
                mode=classifier_mode,  # type: ignore[arg-type]
                fallbacks=fallbacks,
                depth=classifier,
            ),
            DegradeRule(
                name="embedder",
                clusters=["gpu"],
                routes=["embedder"],
                mode="reject",
                depth=embedder,
            ),
        ],
    )


@dataclass
class Rig:
    port: int
    admin: int
    certs: Any
    lds: Path
    envoy: Proc
    version: int = 0
    early: bool = True

    def push(self, http_filters: list[dict[str, Any]]) -> None:
        """A listener update, as the control plane's drift breaker would push it."""
        self.version += 1
        early = [es.to_dict(early_header_mutation(settings()))] if self.early else None
        listener = es.listener(self.port, http_filters, ROUTES, tls=self.certs, early=early)
        es.write_lds(self.lds, listener, str(self.version))

    def push_degrade(self, degrade: DegradeSettings) -> None:
        before = self.stat("listener_manager.lds.update_success")
        self.push([es.to_dict(degrade_filter(degrade))])
        wait_for(
            "LDS update applied", lambda: self.stat("listener_manager.lds.update_success") > before
        )
        wait_for(
            "listener warm", lambda: self.stat("listener_manager.total_listeners_warming") == 0
        )

    def stat(self, name: str) -> int:
        return envoy_stat(self.admin, name)

    def get(
        self, path: str, client: str = "alice", headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        conn = httpclient.HTTPSConnection(
            "127.0.0.1", self.port, context=self.certs.client_context(client), timeout=5
        )
        try:
            conn.request("GET", path, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def served_by(
        self, path: str, client: str = "alice", headers: dict[str, str] | None = None
    ) -> str:
        status, _, body = self.get(path, client, headers)
        assert status == 200, (status, body)
        service: str = json.loads(body)["service"]
        return service


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    procs = Processes(tmp_path)
    port, admin, gpu, cpu, cache = free_ports(5)
    certs = es.make_certs(tmp_path / "certs", {"alice": ALICE, "ops": OPS})
    lds = tmp_path / "lds" / "listeners.json"
    lds.parent.mkdir()
    config = tmp_path / "envoy.json"
    config.write_text(
        json.dumps(es.bootstrap(admin, {"gpu": gpu, "cpu": cpu, "cache": cache}, lds_file=lds))
    )
    try:
        for name, p in (("gpu", gpu), ("cpu", cpu), ("cache", cache)):
            procs.upstream(name, name, p)
        r = Rig(port, admin, certs, lds, envoy=None)  # type: ignore[arg-type]
        r.push([es.to_dict(degrade_filter(settings()))])
        r.envoy = start_envoy(procs, "envoy", envoy_argv(config, wasm=True), admin)
        for p in (gpu, cpu, cache):
            wait_for("upstream", lambda p=p: http(f"http://127.0.0.1:{p}/").status == 200)  # type: ignore[misc]
        yield r
    finally:
        procs.stop_all()


def test_reroute_reject_trigger_and_spoofing(rig: Rig) -> None:
    path = "/v2/models/classifier/infer"
    # healthy: a spoofed routing header picks nothing
    assert rig.served_by(path) == "gpu"
    assert rig.served_by(path, headers={HDR: "classifier-cpu"}) == "gpu"
    assert (
        rig.served_by(path, headers={HDR: "classifier-cache", "X-Meshfn-Degrade-Route": "x"})
        == "gpu"
    )
    # the trigger header: honoured for the named caller only, depth from its value
    assert rig.served_by(path, client="ops", headers={"x-meshfn-degrade": "1"}) == "cpu"
    assert rig.served_by(path, client="ops", headers={"x-meshfn-degrade": "2"}) == "cache"
    assert rig.served_by(path, client="alice", headers={"x-meshfn-degrade": "1"}) == "gpu"
    assert rig.served_by(path, client="ops", headers={"x-meshfn-degrade": "yes"}) == "gpu"

    # the drift breaker degrades the classifier one level and the embedder entirely
    rig.push_degrade(settings(classifier=1, embedder=1))
    assert rig.served_by(path) == "cpu"
    assert rig.served_by(path, client="ops", headers={"x-meshfn-degrade": "2"}) == "cache"
    status, headers, body = rig.get("/v2/models/embedder/infer")
    assert status == 503
    assert headers["content-type"] == "application/json"
    assert headers["x-meshfn-degraded"] == "reject"
    assert json.loads(body) == {"error": "service degraded", "rule": "embedder", "status": 503}

    # reject mode on the classifier: the spoofed header never reaches route matching (the
    # early header mutation), so the rule for "classifier" applies to it as to everyone
    rig.push_degrade(settings(classifier=1, classifier_mode="reject"))
    assert rig.get(path, headers={HDR: "classifier-cpu"})[0] == 503
    assert rig.get(path)[0] == 503
    rig.push_degrade(settings())  # recovered
    assert rig.served_by(path) == "gpu"

    counters = {
        name: rig.stat(f"wasmcustom.meshfn_degrade.{name}")
        for name in (
            "rerouted",
            "rejected",
            "routing_header_stripped",
            "trigger_honoured",
            "trigger_denied",
            "trigger_invalid",
        )
    }
    assert counters == {
        "rerouted": 4,
        "rejected": 3,
        "routing_header_stripped": 0,  # the early mutation got there first
        "trigger_honoured": 3,
        "trigger_denied": 1,
        "trigger_invalid": 1,
    }


def test_filter_strips_spoofed_header_even_without_early_mutation(rig: Rig) -> None:
    """Defence in depth: Envoy routed on the spoofed header, the filter strips it and clears the
    route cache, so the request still goes where a clean request goes."""
    rig.early = False
    rig.push_degrade(settings())
    path = "/v2/models/classifier/infer"
    assert rig.served_by(path, headers={HDR: "classifier-cpu"}) == "gpu"
    assert rig.served_by(path, headers={HDR: "classifier-cache"}) == "gpu"
    assert rig.stat("wasmcustom.meshfn_degrade.routing_header_stripped") == 2
    assert rig.served_by(path, client="ops", headers={"x-meshfn-degrade": "1", HDR: "x"}) == "cpu"


BAD_PLUGIN_JSON = [
    (
        "meshfn_degrade",
        "degrade",
        '{"rules": [{"name": "x", "routes": ["r"], "mode": "reroute"}]}',
        "reroute needs 1-8 fallbacks",
    ),
    ("meshfn_degrade", "degrade", "{not json", "offset 1"),
    ("meshfn_audit", "audit", '{"subject_salt": "short"}', "subject_salt"),
    ("meshfn_audit", "audit", "", "missing"),
]


def test_malformed_plugin_config_is_refused_and_the_old_one_stays(rig: Rig) -> None:
    path = "/v2/models/classifier/infer"
    rig.push_degrade(settings(classifier=1))
    assert rig.served_by(path) == "cpu"
    for name, kind, raw, reason in BAD_PLUGIN_JSON:
        rejected = rig.stat("listener_manager.lds.update_rejected")
        rig.push([es.to_dict(wasm_http_filter(name, wasm_path(kind), raw))])  # type: ignore[arg-type]
        wait_for(
            "update rejected",
            lambda r=rejected: rig.stat("listener_manager.lds.update_rejected") > r,
        )
        log = rig.envoy.output()
        assert (
            f"meshfn {kind}: invalid plugin configuration, rejected: " in log and reason in log
        ), log[-2000:]
        assert rig.served_by(path) == "cpu"  # last good config still in force
    # a good push still goes through afterwards
    rig.push_degrade(settings())
    assert rig.served_by(path) == "gpu"


def test_envoy_refuses_to_start_with_malformed_plugin_config(tmp_path: Path) -> None:
    port, admin, upstream = free_ports(3)
    bad = wasm_http_filter("meshfn_audit", wasm_path("audit"), '{"subject_salt": "00", "x": 1}')
    listener = es.listener(port, [es.to_dict(bad)], [es.route("r", "backend")])
    config = tmp_path / "envoy.json"
    config.write_text(json.dumps(es.bootstrap(admin, {"backend": upstream}, listener)))
    procs = Processes(tmp_path)
    try:
        envoy = procs.start("envoy", envoy_argv(config, wasm=True))
        code = envoy.wait(timeout=20)
    finally:
        procs.stop_all()
    assert code != 0
    assert (
        "meshfn audit: invalid plugin configuration, rejected: x: unknown field" in envoy.output()
    )


def test_combined_filter(rig: Rig) -> None:
    """meshfn.wasm (audit + degrade in one plugin) behaves like the two filters."""
    path = "/v2/models/classifier/infer"
    audit = AuditSettings(subject_salt="cd" * 16)
    rejected = rig.stat("listener_manager.lds.update_rejected")
    bad = wasm_http_filter("meshfn", wasm_path("meshfn"), '{"degrade": {"rules": []}, "x": 1}')
    rig.push([es.to_dict(bad)])
    wait_for("update rejected", lambda: rig.stat("listener_manager.lds.update_rejected") > rejected)
    assert "meshfn: invalid plugin configuration, rejected: x: unknown field" in rig.envoy.output()

    before = rig.stat("listener_manager.lds.update_success")
    rig.push([es.to_dict(meshfn_filter(audit, settings(classifier=1, embedder=1)))])
    wait_for("LDS update applied", lambda: rig.stat("listener_manager.lds.update_success") > before)
    wait_for("listener warm", lambda: rig.stat("listener_manager.total_listeners_warming") == 0)
    assert rig.served_by(path) == "cpu"
    assert rig.served_by(path, client="ops", headers={"x-meshfn-degrade": "2"}) == "cache"
    assert rig.served_by(path, client="alice", headers={"x-meshfn-degrade": "2"}) == "cpu"
    status, headers, body = rig.get("/v2/models/embedder/infer")
    assert status == 503 and json.loads(body)["rule"] == "embedder"
    assert headers["x-meshfn-degraded"] == "reject"
    assert rig.stat("wasmcustom.meshfn_degrade.rerouted") == 3
    assert rig.stat("wasmcustom.meshfn_degrade.trigger_denied") == 1


def test_both_filters_together(rig: Rig) -> None:
    """Audit first, degrade second: the reroute is what the audit record sees."""
    both = [
        es.to_dict(audit_filter(AuditSettings(subject_salt="ab" * 16))),
        es.to_dict(degrade_filter(settings(classifier=2))),
    ]
    before = rig.stat("listener_manager.lds.update_success")
    rig.push(both)
    wait_for("LDS update applied", lambda: rig.stat("listener_manager.lds.update_success") > before)
    wait_for("listener warm", lambda: rig.stat("listener_manager.total_listeners_warming") == 0)
    assert rig.served_by("/v2/models/classifier/x") == "cache"
    assert rig.stat("wasmcustom.meshfn_degrade.rerouted") == 1
    assert rig.stat("wasm.envoy.wasm.runtime.v8.active") >= 2  # both VMs loaded


@pytest.mark.parametrize("shared_vm_id", [False, True])
def test_lean_plugins_sharing_a_vm_id_fail_closed(tmp_path: Path, shared_vm_id: bool) -> None:
    """Two lean plugins with different configurations: with the vm_ids meshfn gives them (one
    per configuration) both serve; forced into one VM (one vm_id, as a hand-written config
    might), Envoy keeps the listener up and still runs both plugins' streams in that VM, so the
    filter refuses every request with 503 and says why in the proxy log."""
    entries = [es.to_dict(degrade_filter(d)) for d in (settings(), settings(embedder=1))]
    for i, entry in enumerate(entries):
        plugin = entry["typed_config"]["config"]
        plugin["name"] = plugin["root_id"] = f"p{i}"
        entry["name"] = f"meshfn.p{i}"
        if shared_vm_id:
            plugin["vm_config"]["vm_id"] = "shared"
    port, admin = free_ports(2)
    ok = {"inline_string": "ok"}
    routes = [
        {"name": "r", "match": {"prefix": "/"}, "direct_response": {"status": 200, "body": ok}}
    ]
    config = tmp_path / "envoy.json"
    config.write_text(json.dumps(es.bootstrap(admin, {}, es.listener(port, entries, routes))))
    procs = Processes(tmp_path)
    try:
        envoy = procs.start("envoy", envoy_argv(config, wasm=True))
        wait_for("envoy ready", lambda: http(f"http://127.0.0.1:{admin}/ready").status == 200)
        reply = http(f"http://127.0.0.1:{port}/x")
        if shared_vm_id:
            assert reply.status == 503
            assert (
                json.loads(reply.body)["error"] == "meshfn filter not configured: see the proxy log"
            )
            assert "give each configuration its own vm_id" in envoy.output()
        else:
            assert (reply.status, reply.body) == (200, b"ok")
    finally:
        procs.stop_all()
