"""The exported JSON Schema stays in sync with the models and accepts the examples; the CLI's
offline commands behave (exit codes, file:line output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from meshfn.policy.schema import rendered

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = ROOT / "policies" / "schema"
EXAMPLES = ROOT / "policies" / "examples"
MESHFN = str(Path(sys.executable).parent / "meshfn")


def test_committed_schema_is_current() -> None:
    expected = rendered()
    on_disk = {p.name: p.read_text() for p in SCHEMA_DIR.glob("*.json")}
    assert on_disk == expected, "run `meshfn schema` and commit policies/schema/"


def _validator(kind: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMA_DIR / f"{kind.lower()}.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)  # type: ignore[no-any-return]


def test_examples_validate_against_the_schema() -> None:
    count = 0
    for path in EXAMPLES.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            _validator(doc["kind"]).validate(doc)
            count += 1
    assert count >= 6


def test_schema_rejects_what_the_loader_rejects() -> None:
    validator = _validator("Service")
    bad = {
        "apiVersion": "meshfn.io/v1alpha1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"port": 80, "protocl": "http"},
    }
    assert not validator.is_valid(bad)
    bad["spec"] = {"port": "80"}
    assert not validator.is_valid(bad)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MESHFN, *args], capture_output=True, text=True, timeout=60, check=False)


def test_validate_ok_and_errors(tmp_path: Path) -> None:
    ok = run("validate", str(EXAMPLES))
    assert ok.returncode == 0
    assert "ok: mesh demo: 1 gateway(s), 3 service(s), 4 sidecar(s)" in ok.stdout
    (tmp_path / "bad.yaml").write_text(
        "apiVersion: meshfn.io/v1alpha1\nkind: Service\nmetadata: {name: x}\nspec:\n  port: 1\n  colour: red\n"
    )
    bad = run("validate", str(tmp_path))
    assert bad.returncode == 1
    assert f"{tmp_path}/bad.yaml:6: spec.colour: unknown field 'colour'" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = run("validate", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "no such file or directory" in missing.stderr


def test_translate_and_bootstrap(tmp_path: Path) -> None:
    out = run("translate", str(EXAMPLES))
    assert out.returncode == 0
    doc = yaml.safe_load(out.stdout)
    assert set(doc["edge.ingress"]) == {
        "listeners",
        "routes",
        "clusters",
        "endpoints",
        "extension_configs",  # the degrade filter of the drift-guarded routes (ECDS)
    }
    assert set(doc["models.default:15101"]) == {"listeners", "clusters"}
    unknown = run("translate", str(EXAMPLES), "--workload", "ghost.default")
    assert unknown.returncode == 1 and "no workload 'ghost.default'" in unknown.stderr
    boot = run(
        "bootstrap", "edge.ingress", "--policies", str(EXAMPLES), "--state-dir", str(tmp_path)
    )
    assert boot.returncode == 0
    assert json.loads(boot.stdout)["node"]["cluster"] == "edge.ingress"
    # the connection limit it writes: MESHFN_PROXY_MAX_CONNECTIONS, checked
    argv = [MESHFN, "bootstrap", "edge.ingress", "-p", str(EXAMPLES), "--state-dir", str(tmp_path)]
    done = {}
    for value in ("500", "0"):
        env = {**os.environ, "MESHFN_PROXY_MAX_CONNECTIONS": value}
        done[value] = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, env=env, check=False
        )
    (monitor,) = json.loads(done["500"].stdout)["overload_manager"]["resource_monitors"]
    assert monitor["typed_config"]["max_active_downstream_connections"] == "500"
    assert done["0"].returncode == 1 and "Traceback" not in done["0"].stderr
    assert "must be an integer from 1 to 2147483647, not '0'" in done["0"].stderr


@pytest.mark.parametrize("command", [["status"], ["config-dump", "edge.default"]])
def test_commands_that_need_a_control_plane_say_so(command: list[str]) -> None:
    result = run(*command, "--admin", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert "cannot reach the control plane at http://127.0.0.1:9" in result.stderr
    assert "Traceback" not in result.stderr
