"""Rollouts through real Envoy, the real inference backend and real functions (`meshfn up`),
under steady load: a good candidate is promoted through every step without a failed request; a
candidate that fails or is slow is rolled back within one evaluation interval of the first bad
answer, having failed no more requests than its weight allowed; a candidate whose labels
disagree with the stable version's is refused on its shadow step before it answers a real
request; a control plane killed in the middle of a rollout resumes it at the same step; people
act on rollouts with `meshfn rollout`; every step and action is an audit record, and each
request's record names the version that answered.

The candidates are built by meshfn.testing.candidates: the digits example compiled from ONNX by
`meshfn fn build`, the bad ones the same model with a changed graph (a swapped weight, a division
by zero, extra matrix products)."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from meshfn_e2e import http

from meshfn.common.adminauth import admin_headers, local_principal
from meshfn.testing import candidates, envoy
from meshfn.testing.load import DIGITS, Answer, SteadyLoad
from meshfn.testing.policies import API_VERSION, documents, gateway, mesh, service
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import MESHFN, Proc, Processes, meshfn, wait_for

RATE = 40.0  # requests/s of the steady load
FUNCTIONS = ("good", "trap", "slow", "wrong", "resume")
VARIANTS: dict[str, candidates.Variant] = {
    "good": "same",
    "trap": "trap",
    "slow": "slow",
    "wrong": "broken-weight",
    "resume": "same",
}


def _digit_bodies() -> list[bytes]:
    """Real 8x8 digits, threes and eights among them (the broken weight swaps those two)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    bodies = []
    for target in (3, 8, 1, 3, 8, 0, 3, 8):
        index = list(data.target).index(target) + len(bodies)
        pixels = [float(v) for v in data.images[index].reshape(64)]
        request = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64],
                               "data": pixels}]}  # fmt: skip
        bodies.append(json.dumps(request).encode())
    return bodies


@dataclass
class Rig:
    procs: Processes
    up: Proc
    argv: list[str]
    policies: Path
    state: Path
    gateway: str
    admin: str

    def rollout(self, function: str, **spec: Any) -> None:
        """Add the Rollout of `function` (stable 1, candidate 2) and wait until it runs and
        the backend (restarted with the candidate) answers."""
        doc = {
            "apiVersion": API_VERSION,
            "kind": "Rollout",
            "metadata": {"name": function},
            "spec": {"function": function, "stable": "1", "candidate": "2", **spec},
        }
        (self.policies / f"rollout-{function}.yaml").write_text(yaml.safe_dump(doc))
        wait_for(f"rollout {function}", lambda: self.status(function), timeout=60, proc=self.up)
        for version in ("1", "2"):
            path = f"/v2/models/{function}/versions/{version}/ready"
            wait_for(f"{function}@{version}", lambda p=path: self.get(p) == 200, timeout=60)

    def get(self, path: str) -> int:
        return http(self.gateway + path).status

    def admin_get(self, path: str) -> Any:
        """GET on the admin port with the owner's token (the one `meshfn up` wrote)."""
        return http(self.admin + path, headers=admin_headers(self.state))

    def status(self, function: str) -> dict[str, Any] | None:
        docs = self.admin_get("/rollouts").json()["rollouts"]
        return next((d for d in docs if d["rollout"] == f"default/{function}"), None)

    def until(self, function: str, phase: str, timeout: float) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            doc = self.status(function)
            return doc if doc is not None and doc["phase"] == phase else None

        return wait_for(f"{function} {phase}", reached, timeout=timeout, every=0.1, proc=self.up)

    def load(self, function: str, body: bytes | list[bytes] = DIGITS) -> SteadyLoad:
        return SteadyLoad(f"{self.gateway}/v2/models/{function}/infer", body, RATE).start()


def _mesh(ports: dict[str, int]) -> str:
    """The mesh: a gateway, the backend `models` serving every test function, audited."""
    functions = [
        yaml.safe_dump(
            {
                "apiVersion": API_VERSION,
                "kind": "Function",
                "metadata": {"name": f},
                "spec": {"backend": "models", "limits": {"timeout": "2s", "maxConcurrency": 64}},
            }
        )
        for f in FUNCTIONS
    ]
    return documents(
        mesh(
            "rollout", "rollout.local", ports["xds"], ports["admin"], audit={"proxies": "gateways"}
        ),
        gateway(None, ports["edge"]),
        service("models", ports["models"]),
        *functions,
    )


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("rollout")
    registry, state, policies = tmp / "functions", tmp / "state", tmp / "policies"
    published = [(f, "1", "same") for f in FUNCTIONS]
    published += [(f, "2", VARIANTS[f]) for f in FUNCTIONS]
    key = candidates.publish(tmp / "build", registry, published)  # type: ignore[arg-type]
    ports = named_ports("xds", "admin", "edge", "models")
    policies.mkdir()
    (policies / "mesh.yaml").write_text(_mesh(ports))
    argv = [
        MESHFN, "up", "--policies", str(policies), "--state-dir", str(state),
        "--functions-registry", str(registry), "--trusted-key", str(key),
        "--envoy-concurrency", "1",
    ]  # fmt: skip
    procs = Processes(tmp)
    try:
        up = procs.start("up", argv)
        wait_for("meshfn up", lambda: "Ctrl-C stops everything" in up.output(), 240, proc=up)
        yield Rig(
            procs,
            up,
            argv,
            policies,
            state,
            f"http://127.0.0.1:{ports['edge']}",
            f"http://127.0.0.1:{ports['admin']}",
        )
    finally:
        procs.stop_all()


def _events(doc: dict[str, Any]) -> list[str]:
    return [h["event"] for h in doc["history"]]


def _event_at(doc: dict[str, Any], event: str) -> float:
    return next(h["at"] for h in doc["history"] if h["event"] == event)


def test_a_candidate_not_published_is_refused_at_its_line(rig: Rig) -> None:
    """The registry is asked: the reload is refused (file:line), the configuration in force
    stays, and no rollout starts."""
    doc = {
        "apiVersion": API_VERSION,
        "kind": "Rollout",
        "metadata": {"name": "good"},
        "spec": {"function": "good", "stable": "1", "candidate": "9",
                 "canary": {"steps": [{"weight": 10}]}},
    }  # fmt: skip
    path = rig.policies / "rollout-good.yaml"
    path.write_text(yaml.safe_dump(doc))

    def refused() -> list[str]:
        return list(rig.admin_get("/debug/status").json()["policy_errors"])

    (error,) = wait_for("the reload refused", refused, timeout=30)
    assert error.startswith(f"{path}:9: spec.candidate: version '9' of good is not published")
    assert rig.status("good") is None
    path.unlink()
    wait_for("the errors gone", lambda: not refused(), timeout=30)


def test_a_good_candidate_is_promoted_through_every_step_without_a_failed_request(
    rig: Rig,
) -> None:
    rig.rollout(
        "good",
        interval="500ms",
        shadow={"percent": 50, "minRequests": 20, "minTime": "2s"},
        canary={"minRequests": 20, "minTime": "2s",
                "steps": [{"weight": 10}, {"weight": 50}, {"weight": 100}]},
        slo={"minSamples": 20, "agreement": {"minRatio": 1.0},
             "latency": [{"percentile": 99, "maxRatio": 3, "minIncrease": "50ms"}]},
    )  # fmt: skip
    load = rig.load("good", _digit_bodies())
    try:
        doc = rig.until("good", "Promoted", timeout=90)
        time.sleep(1.0)  # the promotion's push, then answers of the candidate alone
    finally:
        answers = load.stop()
    assert _events(doc) == ["started", "step", "step", "step", "promoted"], doc["history"]
    statuses = Counter(a.status for a in answers)
    assert statuses == {200: len(answers)}, statuses  # not one failed request
    promoted = _event_at(doc, "promoted")
    shadow_passed = doc["history"][1]["at"]
    assert {a.version for a in answers if a.sent < shadow_passed - 0.5} == {"1"}
    assert {a.version for a in answers if a.sent > promoted + 0.5} == {"2"}
    assert Counter(a.version for a in answers)["2"] > 0
    # the console shows it: the step, the weights, each check against its limit, the history
    page = rig.admin_get("/ui").body.decode()
    panel = page.split('id="panel-rollouts"', 1)[1].split("</section>", 1)[0]
    for shown in ("default/good", "Promoted", "stable 0%, candidate 100%", "error ratio",
                  "p99 vs stable", "promoted</strong>", "step 1 passed"):  # fmt: skip
        assert shown in panel, shown


def _rolled_back(rig: Rig, function: str, **spec: Any) -> tuple[dict[str, Any], list[Answer]]:
    rig.rollout(function, **spec)
    load = rig.load(function)
    try:
        doc = rig.until(function, "RolledBack", timeout=60)
        time.sleep(2.0)  # answers after the rollback: the stable version's alone
    finally:
        answers = load.stop()
    return doc, answers


def _within_one_interval(doc: dict[str, Any], first_bad: float, interval: float) -> None:
    """The rollback came within one evaluation interval of the first bad answer (plus the
    access-log stream's flush, 0.1 s, and scheduling on a shared machine)."""
    rolled_back = _event_at(doc, "rolled-back")
    assert rolled_back - first_bad <= interval + 0.6, (rolled_back - first_bad, doc["history"])


def test_a_failing_candidate_is_rolled_back_within_one_interval(rig: Rig) -> None:
    interval, weight = 1.0, 10
    doc, answers = _rolled_back(
        rig, "trap", interval=f"{interval}s",
        canary={"minRequests": 50, "minTime": "10s",
                "steps": [{"weight": weight}, {"weight": 50}, {"weight": 100}]},
    )  # fmt: skip
    assert "error ratio" in doc["reason"], doc["reason"]
    failed = [a for a in answers if a.status != 200]
    assert failed and {a.version for a in failed} == {"2"}, Counter(a.status for a in failed)
    first_bad = min(a.sent for a in failed)
    _within_one_interval(doc, first_bad, interval)
    # what its weight allowed: its share of the requests sent until the rollback took effect
    rolled_back = _event_at(doc, "rolled-back")
    allowed = weight / 100 * RATE * (rolled_back - first_bad + 0.5) + 3
    assert len(failed) <= allowed, (len(failed), allowed)
    after = [a for a in answers if a.sent > rolled_back + 0.5]
    assert after and {(a.status, a.version) for a in after} == {(200, "1")}


def test_a_slow_candidate_is_rolled_back_within_one_interval(rig: Rig) -> None:
    interval = 1.0
    doc, answers = _rolled_back(
        rig, "slow", interval=f"{interval}s",
        canary={"minRequests": 50, "minTime": "10s", "steps": [{"weight": 20}, {"weight": 100}]},
        slo={"minSamples": 10,
             "latency": [{"percentile": 95, "maxRatio": 2, "minIncrease": "20ms"}]},
    )  # fmt: skip
    assert "p95 vs stable" in doc["reason"], doc["reason"]
    assert Counter(a.status for a in answers) == {200: len(answers)}
    fast = sorted(a.ms for a in answers if a.version == "1")
    slow = [a for a in answers if a.version == "2"]
    assert slow and min(a.ms for a in slow) > fast[len(fast) // 2] + 20
    _within_one_interval(doc, min(a.sent for a in slow), interval)
    rolled_back = _event_at(doc, "rolled-back")
    assert {a.version for a in answers if a.sent > rolled_back + 0.5} == {"1"}


def test_a_shadow_candidate_whose_labels_disagree_never_takes_a_real_request(rig: Rig) -> None:
    doc, answers = _shadow_refused(rig)
    assert _events(doc) == ["started", "rolled-back"], doc["history"]
    assert "agreement" in doc["reason"], doc["reason"]
    agreement = next(c for c in doc["checks"] if c["name"] == "agreement")
    assert agreement["verdict"] == "breach" and agreement["samples"] > 0
    assert {(a.status, a.version) for a in answers} == {(200, "1")}  # no real request to 2


def _shadow_refused(rig: Rig) -> tuple[dict[str, Any], list[Answer]]:
    rig.rollout(
        "wrong",
        interval="500ms",
        shadow={"percent": 50, "minRequests": 40, "minTime": "5s"},
        canary={"minRequests": 20, "minTime": "2s", "steps": [{"weight": 50}, {"weight": 100}]},
        slo={"minSamples": 20, "agreement": {"minRatio": 0.99}},
    )
    load = rig.load("wrong", _digit_bodies())
    try:
        doc = rig.until("wrong", "RolledBack", timeout=60)
        time.sleep(1.0)
    finally:
        answers = load.stop()
    return doc, answers


def test_a_killed_control_plane_resumes_the_rollout_at_the_same_step(rig: Rig) -> None:
    rig.rollout(
        "resume",
        interval="500ms",
        canary={"minRequests": 10, "minTime": "2s",
                "steps": [{"weight": 10}, {"weight": 50, "minTime": "10m"}, {"weight": 100}]},
    )  # fmt: skip
    load = rig.load("resume")
    try:
        wait_for("step 2", lambda: (rig.status("resume") or {}).get("step") == 2, timeout=60)
    finally:
        load.stop()
    before = rig.status("resume")
    assert before is not None and before["weight"] == 50
    rig.up.stop(signal.SIGKILL)  # a crash: no clean shutdown, nothing saved on the way out
    rig.up = rig.procs.start("up-again", rig.argv)
    wait_for("meshfn up again", lambda: "Ctrl-C stops everything" in rig.up.output(), 240)
    after = rig.status("resume")
    assert after is not None
    assert (after["phase"], after["step"], after["weight"]) == ("Progressing", 2, 50)
    assert after["step_elapsed_s"] >= before["step_elapsed_s"]  # the same step, going on
    assert _events(after) == ["started", "step"]  # not started over
    assert _envoy_weights(rig, "default/function-resume/0") == [5000, 5000]  # Envoy's own
    # the other rollouts kept their outcome across the crash
    assert (rig.status("good") or {})["phase"] == "Promoted"
    assert (rig.status("trap") or {})["phase"] == "RolledBack"


def _envoy_weights(rig: Rig, route: str) -> list[int]:
    """The weights of a route's clusters in the gateway Envoy's own configuration."""
    admin = envoy.admin_socket(rig.state, "edge.default")

    def dumped() -> list[int] | None:
        dump = envoy.admin_json(admin, "/config_dump?resource=dynamic_route_configs")
        found = [
            c["weight"]
            for config in dump["configs"]
            for host in config["route_config"]["virtual_hosts"]
            for entry in host["routes"]
            if entry["name"] == route
            for c in entry["route"]["weighted_clusters"]["clusters"]
        ]
        return found or None

    return wait_for(f"{route} in Envoy", dumped, timeout=30)


def test_people_act_with_meshfn_rollout(rig: Rig) -> None:
    def rollout(*args: str) -> str:
        out = meshfn("rollout", *args, "--admin", rig.admin, "--state-dir", str(rig.state))
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "paused" in rollout("pause", "resume")
    assert (rig.status("resume") or {})["phase"] == "Paused"
    state = ["--admin", rig.admin, "--state-dir", str(rig.state)]
    refused = meshfn("rollout", "pause", "resume", *state)
    assert refused.returncode == 1 and "cannot be paused now" in refused.stderr
    assert "resumed" in rollout("resume", "default/resume")
    assert "promoted" in rollout("promote", "resume")
    doc = rig.status("resume")
    assert doc is not None and (doc["phase"], doc["weight"]) == ("Promoted", 100)
    assert doc["history"][-1]["by"] == local_principal()  # the owner's token: its principal
    shown = rollout("status", "resume")
    assert "Promoted" in shown and "history" in shown and "promoted" in shown
    unknown = meshfn("rollout", "abort", "nope", *state)
    assert unknown.returncode == 1 and "no rollout 'nope'" in unknown.stderr


def test_every_step_and_action_is_audited_and_requests_name_their_version(rig: Rig) -> None:
    assert rig.up.stop() == 0  # the collector stores the last lines, the signer signs
    store = str(rig.state / "audit" / "audit.db")

    def query(*args: str) -> list[dict[str, Any]]:
        out = meshfn("audit", "query", "--store", store, "--json", "--limit", "100000", *args)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    control = query("--chain", "@control")
    actions = [(r["rollout"], r["action"], r["by"] != "controller") for r in control]
    assert [a for a in actions if a[0] == "default/good"] == [
        ("default/good", "started", False),
        ("default/good", "step", False),
        ("default/good", "step", False),
        ("default/good", "step", False),
        ("default/good", "promoted", False),
    ]
    assert ("default/trap", "rolled-back", False) in actions
    assert ("default/wrong", "rolled-back", False) in actions
    assert [a[1] for a in actions if a[0] == "default/resume" and a[2]] == [
        "paused", "resumed", "promoted",
    ]  # fmt: skip
    requests = query("--route", "default/function-good")
    versions = Counter(r["model_version"] for r in requests if r["status"] == 200)
    assert versions["1"] > 0 and versions["2"] > 0, versions
    assert all(
        r["upstream_cluster"] == f"version|good@{r['model_version']}|models.default"
        for r in requests
        if r["path"] == "/v2/models/good/infer"
    )
    out = meshfn("audit", "verify", "--store", store)
    assert out.returncode == 0, out.stdout + out.stderr
