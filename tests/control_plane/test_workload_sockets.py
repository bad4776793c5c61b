"""What `meshfn up` runs behind a sidecar listens on unix sockets in the state directory (no
port a local user could call past the sidecar); the sidecar reaches them over `pipe` addresses,
which a real Envoy accepts (`--mode validate`). What has no sidecar keeps its port."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from google.protobuf import json_format

from meshfn.common.unix import MAX_SOCKET_PATH, SocketPathTooLong
from meshfn.control_plane.runtime.upstreams import (
    FunctionsSetup,
    app_socket,
    app_sockets,
    backend_state_dir,
    local_upstreams,
    upstreams_for,
)
from meshfn.policy import load_policies
from meshfn.testing import policies as p
from meshfn.testing.envoy import validate
from meshfn.xds.names import CLUSTER
from meshfn.xds.translate import OFFLINE_HOST, ProxyHost, translate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "policies" / "examples"


def test_behind_a_sidecar_on_sockets_one_per_backend_process(tmp_path: Path) -> None:
    model = load_policies(EXAMPLES)
    setup = FunctionsSetup(tmp_path / "registry", (), processes=2)
    specs = local_upstreams(model, tmp_path, setup)
    assert set(specs) == {("127.0.0.1", port) for port in (9101, 9102, 9103, 9201)}
    sockets = tmp_path.resolve() / "workloads"
    models = specs[("127.0.0.1", 9101)]
    assert models.functions and models.grpc_port == 9111
    # a backend's sockets are in its own directory, the one place its Landlock rules let it
    # write (in the shared one it could remove the other workloads' sockets)
    own = tmp_path.resolve() / "inference" / "127.0.0.1-9101"
    assert own == backend_state_dir(tmp_path.resolve(), "127.0.0.1", 9101)
    assert models.sockets == (own / "http.0.sock", own / "http.1.sock")
    assert models.grpc_sockets == (own / "grpc.0.sock", own / "grpc.1.sock")
    assert models.where == models.sockets[0]
    echo = specs[("127.0.0.1", 9201)]  # a placeholder: one process, one socket, no gRPC
    assert echo.sockets == (sockets / "127.0.0.1-9201.sock",) and echo.grpc_sockets == ()
    assert echo.sockets[0] == app_socket(tmp_path, "127.0.0.1", 9201)
    mapped = dict(app_sockets(specs.values()))
    assert mapped[("127.0.0.1", 9111)] == tuple(map(str, models.grpc_sockets))
    assert len(mapped) == 7  # three backends' HTTP and gRPC, and echo
    # one process per backend (the default): one socket each
    single = local_upstreams(model, tmp_path, None)[("127.0.0.1", 9103)]
    assert single.sockets == (tmp_path.resolve() / "inference" / "127.0.0.1-9103" / "http.sock",)
    # without a state directory (meshfn serve's rig, bench/chaos.py): the ports, as written
    assert all(not s.sockets and not s.grpc_sockets for s in upstreams_for(model).values())


def test_without_a_sidecar_an_endpoint_keeps_its_port(tmp_path: Path) -> None:
    """The gateways call such an endpoint directly, so its application must listen there."""
    (tmp_path / "mesh.yaml").write_text(
        p.documents(
            p.mesh("m", "m.local"),
            p.gateway(None, 10000),
            p.service("direct", 8081),
            p.service("behind", 8082, [p.endpoint(sidecar=15082)]),
        )
    )
    specs = upstreams_for(load_policies(tmp_path), tmp_path, 1)
    assert specs[("127.0.0.1", 8081)].sockets == ()
    assert specs[("127.0.0.1", 8081)].where == "127.0.0.1:8081"
    assert specs[("127.0.0.1", 8082)].sockets == (
        tmp_path.resolve() / "workloads" / "127.0.0.1-8082.sock",
    )


def test_a_state_directory_too_deep_for_the_sockets_fails_clearly(tmp_path: Path) -> None:
    model = load_policies(EXAMPLES)
    longest = len("/inference/127.0.0.1-9101/http.sock")
    deep = tmp_path / ("d" * (MAX_SOCKET_PATH - len(str(tmp_path)) - longest - 1))
    for spec in local_upstreams(model, deep, None).values():  # just fits
        assert all(len(os.fsencode(s)) <= MAX_SOCKET_PATH for s in spec.sockets)
    with pytest.raises(SocketPathTooLong, match=r"the workloads' sockets .* --state-dir"):
        local_upstreams(model, Path(f"{deep}d"), None)


def test_envoy_accepts_the_sidecars_pipe_clusters(tmp_path: Path) -> None:
    model = load_policies(EXAMPLES)
    setup = FunctionsSetup(tmp_path / "registry", (), processes=2)
    host = ProxyHost(
        OFFLINE_HOST.wasm_dir,
        tmp_path,
        OFFLINE_HOST.salt,
        app_sockets(local_upstreams(model, tmp_path, setup).values()),
    )
    clusters = []
    for workload in model.workloads:
        if workload.kind != "sidecar":
            continue
        resources = translate(model, workload.node_cluster, host=host)
        assert resources is not None
        clusters += [
            json_format.MessageToDict(c)
            for name, c in resources[CLUSTER].items()
            if name.startswith("inbound|")
        ]
    pipes = [
        e["endpoint"]["address"]["pipe"]["path"]
        for c in clusters
        for e in c["loadAssignment"]["endpoints"][0]["lbEndpoints"]
    ]
    assert len(pipes) == 3 * 2 * 2 + 1  # 3 backends x HTTP and gRPC x 2 processes, and echo
    config = {"static_resources": {"clusters": clusters}}
    result = validate(config)
    assert result.returncode == 0, result.stdout + result.stderr
