"""Every YAML policy in the documentation loads with the policy loader: alone, or as the
directive before it says (together with a directory, as an invalid example, or as an example of
a `meshfn analyze` finding). See meshfn.testing.docs for the directives."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshfn.control_plane.analyze import analyze
from meshfn.policy import PolicyErrors, PolicyLoader
from meshfn.testing.docs import ROOT, Block, all_blocks, blocks

BLOCKS = [b for b in all_blocks() if b.is_policy]


def _set_for(block: Block, target: Path) -> Path:
    """The directory the block is loaded from: the block alone, or DIR with the page's earlier
    `file:` blocks of the same folder and this one (as the reader's copy holds them)."""
    directive = block.directives.get("policy", "")
    name = block.directives.get("file")
    if directive.startswith("extends "):
        shutil.copytree(ROOT / directive.split(" ", 1)[1].strip(), target)
        folder = Path(name).parent if name else None
        for earlier in blocks(block.page):
            if earlier.line >= block.line:
                break
            path = earlier.directives.get("file")
            if path and folder is not None and Path(path).parent == folder and earlier.is_policy:
                (target / Path(path).name).write_text(earlier.text)
    else:
        target.mkdir()
    (target / (Path(name).name if name else "policies.yaml")).write_text(block.text)
    return target


def test_the_docs_hold_policies() -> None:
    assert len(BLOCKS) >= 10, len(BLOCKS)
    for block in BLOCKS:
        directive = block.directives.get("policy", "")
        known = directive in {"", "invalid"} or directive.startswith(("extends ", "analyze "))
        assert known, f"{block.where}: unknown policy directive {directive!r}"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_policy_block_loads(block: Block, tmp_path: Path) -> None:
    directory = _set_for(block, tmp_path / "policies")
    directive = block.directives.get("policy", "")
    if directive == "invalid":
        with pytest.raises(PolicyErrors):
            PolicyLoader(directory).load()
        return
    try:
        model, items = PolicyLoader(directory).load_with_sources()
    except PolicyErrors as exc:
        pytest.fail(f"{block.where}: the policy does not load:\n{exc}")
    if directive.startswith("analyze "):
        code = directive.split(" ", 1)[1].strip()
        found = {f.code for f in analyze(items, model)}
        assert code in found, f"{block.where}: analyze reports {sorted(found)}, not {code}"
