"""(e): while the control plane is down Envoy keeps serving; after a restart it resyncs."""

from __future__ import annotations

import json
import signal
import stat
import time

from meshfn_e2e import Processes, proxies, served_by, wait_for_synced

from meshfn.testing import envoy
from meshfn.testing.policies import Policies
from meshfn.testing.processes import MESHFN, meshfn, wait_for


def test_envoy_survives_a_control_plane_restart(procs: Processes, policies: Policies) -> None:
    for name in ("alpha", "beta"):
        procs.upstream(name, f"default/{name}", policies.ports[name])
    # the test's own state directory (CA, token keys), never the checkout's .meshfn/
    state = ["--state-dir", str(policies.root.parent / "state")]
    serve_argv = [MESHFN, "serve", "--policies", str(policies.root), *state]
    serve = procs.start("serve-1", serve_argv)
    wait_for("the control plane", lambda: proxies(policies) == [], timeout=20)
    bootstrap = meshfn("bootstrap", "edge.default", "--policies", str(policies.root), *state).stdout
    config = policies.root.parent / "envoy.json"
    config.write_text(json.dumps(json.loads(bootstrap)))
    procs.start("envoy", envoy.argv(config))
    wait_for_synced(policies, serve)
    assert served_by(policies, "/v1/x") == "default/alpha"
    # `meshfn bootstrap` puts Envoy's admin on a private socket (and, as the rig's Gateway sets
    # adminPort, on that port too)
    admin = envoy.admin_socket(policies.root.parent / "state", "edge.default")
    assert stat.S_IMODE(admin.stat().st_mode) == 0o600 and envoy.live(admin)

    serve.stop(signal.SIGKILL)  # a crash, not a clean shutdown
    failures = 0
    for _ in range(50):
        if served_by(policies, "/v1/x") != "default/alpha":
            failures += 1
        time.sleep(0.01)
    assert failures == 0, "Envoy stopped serving while the control plane was down"

    policies.route("/v2", "beta")  # changed while the control plane is down
    restarted = procs.start("serve-2", serve_argv)
    wait_for("the resync", lambda: served_by(policies, "/v2/x") == "default/beta", timeout=20)
    (proxy,) = wait_for_synced(policies, restarted)
    assert proxy["node"] == "edge.default~0"
