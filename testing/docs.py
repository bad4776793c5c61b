"""The documentation as its tests read it (tests/docs/): fenced code blocks with the directives
in the HTML comment before them, and the reference generator (docs/gen/reference.py).

A directive comment stands right before a fenced block (blank lines between are allowed) and
holds one or more `name: value` parts separated by `;` (a part may be a bare name):

    <!-- run -->                       tests/docs/test_tasks.py runs the block (bash)
    <!-- run: exits 1 -->              ... and expects that exit status
    <!-- run: with audit-trail -->     ... after laying out an audit trail in .meshfn/
    <!-- not-run: REASON -->           not run, and why (a reason is required)
    <!-- file: PATH -->                the block is written to PATH in the scratch directory
    <!-- policy: extends DIR -->       the policy block loads together with DIR
    <!-- policy: invalid -->           the policy block must fail to load
    <!-- policy: analyze CODE -->      the policy block loads and `meshfn analyze` reports CODE

docs/development/index.md documents the same for writers.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SHELL_LANGUAGES = ("sh", "bash", "shell", "console")
POLICY_API = "apiVersion: meshfn.io/v1alpha1"
DIRECTIVES = ("run", "not-run", "file", "policy")

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_COMMENT = re.compile(r"^\s*<!--(?P<body>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.lang in SHELL_LANGUAGES

    @property
    def is_policy(self) -> bool:
        return self.lang in ("yaml", "yml") and POLICY_API in self.text


def parse_directives(comment: str) -> dict[str, str]:
    """`run: exits 1; file: x.yaml` -> {"run": "exits 1", "file": "x.yaml"}. A `not-run`
    reason is the rest of the comment (it may hold `;`)."""
    name, sep, reason = comment.strip().partition(":")
    if name.strip() == "not-run" and sep:
        return {"not-run": reason.strip()}
    out: dict[str, str] = {}
    for part in comment.split(";"):
        name, _, value = part.strip().partition(":")
        if name.strip():
            out[name.strip()] = value.strip()
    return out


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a Markdown page, with the directives of the comment before it (a
    comment that is not about blocks, e.g. a page's own note, has none of DIRECTIVES)."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    pending: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        comment = _COMMENT.match(line)
        fence = _FENCE.match(line)
        if comment:
            found = parse_directives(comment.group("body"))
            pending = found if any(name in DIRECTIVES for name in found) else {}
        elif fence:
            marker = fence.group("fence")
            lang = fence.group("info").strip().split(" ")[0].strip("{}.").lower()
            body: list[str] = []
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(marker):
                body.append(lines[j][len(fence.group("indent")) :])
                j += 1
            out.append(Block(page, i + 1, lang, "\n".join(body) + "\n", pending))
            pending = {}
            i = j
        elif line.strip():
            pending = {}
        i += 1
    return out


def pages(under: str = "") -> list[Path]:
    """The hand-written and generated Markdown pages of docs/ (under a subfolder)."""
    root = DOCS / under if under else DOCS
    return sorted(p for p in root.rglob("*.md") if "gen" not in p.relative_to(DOCS).parts)


def all_blocks(under: str = "") -> Iterator[Block]:
    for page in pages(under):
        yield from blocks(page)


@cache
def reference_generator() -> ModuleType:
    """docs/gen/reference.py as a module (it is a script, not part of the meshfn package)."""
    path = DOCS / "gen" / "reference.py"
    spec = importlib.util.spec_from_file_location("meshfn_docs_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module
