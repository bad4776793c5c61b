"""The documentation site builds with `mkdocs build --strict` (an unknown page, link or anchor is
an error: mkdocs.yml's `validation`) and its pages fetch nothing from the network: no web fonts,
no scripts or styles from a CDN, no analytics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from meshfn.testing.docs import ROOT

MKDOCS = Path(sys.executable).parent / "mkdocs"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


class _Fetches(HTMLParser):
    """What a browser loads by itself when it opens the page (not the links a reader follows)."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag in ("script", "img", "iframe", "audio", "video", "source", "embed"):
            self.urls.append(values.get("src") or "")
        if tag == "link" and "alternate" not in (values.get("rel") or ""):
            self.urls.append(values.get("href") or "")
        if tag == "object":
            self.urls.append(values.get("data") or "")


def test_the_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "reference" / "policies" / "mesh" / "index.html").is_file()
    assert (site / "reference" / "analyze" / "MF0101" / "index.html").is_file()
    assert (site / "search" / "search_index.json").is_file()  # search works offline


def test_pages_fetch_nothing_from_the_network(site: Path) -> None:
    remote = re.compile(r"^(https?:)?//", re.IGNORECASE)
    found: list[str] = []
    for page in site.rglob("*.html"):
        parser = _Fetches()
        parser.feed(page.read_text())
        found += [f"{page.relative_to(site)}: {url}" for url in parser.urls if remote.match(url)]
        # mkdocs-material loads mermaid from a CDN when a page has a diagram
        if 'class="mermaid"' in page.read_text():
            found.append(f"{page.relative_to(site)}: a mermaid diagram (fetched from a CDN)")
    for css in site.rglob("*.css"):
        found += [
            f"{css.relative_to(site)}: {u}"
            for u in re.findall(r"url\(\s*['\"]?(https?:[^)'\"]+)", css.read_text())
        ]
    assert not found, "\n".join(found)


def test_no_web_fonts_or_analytics_configured() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["theme"]["font"] is False  # material would load Roboto from Google Fonts
    assert "analytics" not in config.get("extra", {})
    assert "repo_url" not in config  # the repository widget fetches its star count
