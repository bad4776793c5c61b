"""README.md is the project's front door: at most 12 KB, with what meshfn is, the console
screenshot, the two commands (CI runs `./dev.sh test`), what to read next, a map of the
repository and the licence, whose file matches what pyproject.toml declares."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

from meshfn.testing.docs import ROOT

README = ROOT / "README.md"
BUDGET = 12 * 1024


def test_the_readme_fits_its_budget() -> None:
    size = len(README.read_bytes())
    assert size <= BUDGET, f"README.md is {size} bytes (budget {BUDGET}): move detail into docs/"


def test_the_readme_has_its_sections() -> None:
    text = README.read_text()
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    for wanted in ("Two commands", "Read next", "Map of the repository", "Licence"):
        assert wanted in headings, f"README.md lacks '## {wanted}'"
    assert "](docs/console.png)" in text and (ROOT / "docs" / "console.png").is_file()
    block = text.split("## Two commands", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["./dev.sh up", "./dev.sh test"]


def test_the_readme_links_resolve() -> None:
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        assert (ROOT / target).exists(), f"README.md links to a missing {target}"


def test_the_licence_file_matches_pyproject() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == "Apache-2.0"
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence  # the full text, not a pointer to it
    assert "Apache" in README.read_text().split("## Licence", 1)[1]


def test_no_architecture_md_is_cited() -> None:
    """The architecture page replaced the ARCHITECTURE.md that code comments once cited."""
    skip = {".venv", "build", ".git", "node_modules", "site"}
    cited = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            path = Path(folder) / name
            if (
                path.suffix in (".py", ".toml", ".md", ".sh")
                and path != Path(__file__)
                and "ARCHITECTURE.md" in path.read_text(errors="replace")
            ):
                cited.append(str(path.relative_to(ROOT)))
    assert not cited, cited
