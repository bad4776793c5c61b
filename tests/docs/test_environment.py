"""Environment variables are read through one registry, meshfn.common.env: every MESHFN_*
variable the code, the scripts or the Helm chart name is listed there with its description and
what applies when unset (the reference page is generated from it), and no code outside it reads
one of the registry's variables from os.environ itself."""

from __future__ import annotations

import re
from pathlib import Path

from meshfn.common import env
from meshfn.testing.docs import ROOT

# Names that look like MESHFN_* variables but are not environment variables meshfn reads: C
# identifiers (the eBPF programs' counters, a core function's metadata, header guards), and the
# variable meshfn puts into a WasmPlugin's VM environment (istio/wasm.py) to name the build.
NOT_VARIABLES = re.compile(r"^MESHFN_(C_\w+|NCOUNTERS|METADATA|FILTER_BUILD|\w+_H)$")
SOURCES = ("common", "contracts", "ir", "istio", "control_plane", "xds", "inference", "ebpf",
           "testing", "tests", "e2e", "bench", "functions", "wasm_filters", "policy", "audit",
           "kube", "compiler", "docs/gen")  # fmt: skip
SKIP = {".venv", "build", "__pycache__", "corpus", "regressions"}
READ = re.compile(
    r"""(?:os\.environ\.get|os\.getenv|os\.environ\.__getitem__)\(\s*["'](?P<a>\w+)["']"""
    r"""|os\.environ\[\s*["'](?P<b>\w+)["']\s*\](?!\s*=)"""
)


def _files(*suffixes: str) -> list[Path]:
    out = [ROOT / "dev.sh"] if ".sh" in suffixes else []
    for top in SOURCES:
        for path in (ROOT / top).rglob("*") if (ROOT / top).is_dir() else []:
            if path.suffix in suffixes and not SKIP & set(path.relative_to(ROOT).parts):
                out.append(path)
    if ".yaml" in suffixes:
        out += sorted((ROOT / "manifests").rglob("*.yaml"))
    return out


def test_every_meshfn_variable_is_in_the_registry() -> None:
    unknown: dict[str, str] = {}
    for path in _files(".py", ".sh", ".yaml", ".c", ".h"):
        for name in re.findall(r"\bMESHFN_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")):
            if name not in env.BY_NAME and not NOT_VARIABLES.match(name):
                unknown.setdefault(name, str(path.relative_to(ROOT)))
    assert not unknown, f"add these to meshfn.common.env: {unknown}"


def test_no_code_reads_a_registered_variable_itself() -> None:
    direct: list[str] = []
    registry = Path(env.__file__).resolve()
    for path in _files(".py"):
        if path.resolve() == registry:
            continue
        for match in READ.finditer(path.read_text(errors="replace")):
            name = match.group("a") or match.group("b")
            if name.startswith("MESHFN_") or name in env.BY_NAME:
                line = path.read_text()[: match.start()].count("\n") + 1
                direct.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not direct, "read these through meshfn.common.env:\n" + "\n".join(direct)


def test_every_entry_is_documented() -> None:
    for var in env.VARIABLES:
        assert var.description.endswith(".") and len(var.description) > 20, var.name
        assert var.default, var.name
        assert var.scope in env.SCOPES, var.name
    assert len(env.BY_NAME) == len(env.VARIABLES), "a variable is listed twice"


def test_a_variable_is_read_when_it_is_needed(monkeypatch: object) -> None:
    """Not at import: setting a variable after meshfn is imported takes effect."""
    import pytest

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    monkeypatch.setenv("MESHFN_INLINE_CORE", "0")
    assert env.INLINE_CORE.enabled() is False
    monkeypatch.setenv("MESHFN_INLINE_CORE", "1")
    assert env.INLINE_CORE.enabled() is True
    monkeypatch.setenv("MESHFN_ADMIN", "")
    assert env.ADMIN.get() is None  # empty counts as unset
