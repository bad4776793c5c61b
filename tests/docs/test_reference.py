"""The reference pages are generated from the code and committed: each must be exactly what
docs/gen/reference.py writes now, and what the pages name must exist in the code."""

from __future__ import annotations

import re

from meshfn.control_plane.analyze import CATALOGUE
from meshfn.testing.docs import DOCS, pages, reference_generator


def test_every_generated_page_is_current() -> None:
    stale = reference_generator().stale()
    assert not stale, (
        f"stale reference pages: {', '.join(stale)}; run ./dev.sh docs (or python -P "
        "docs/gen/reference.py) and commit docs/reference/"
    )


def test_one_page_per_analyze_code_in_the_site() -> None:
    nav = (DOCS.parent / "mkdocs.yml").read_text()
    for code in CATALOGUE:
        assert (DOCS / "reference" / "analyze" / f"{code}.md").is_file(), code
        assert f"reference/analyze/{code}.md" in nav, f"{code} is not in mkdocs.yml's nav"


def test_every_generated_page_is_in_the_nav() -> None:
    nav = (DOCS.parent / "mkdocs.yml").read_text()
    for path in reference_generator().pages():
        assert path in nav, f"{path} is not in mkdocs.yml's nav"


def test_metrics_named_in_the_docs_exist() -> None:
    """A metric a page names (meshfn_..., with a family wildcard `meshfn_ebpf_*`) is one the
    registries expose, so a renamed metric cannot leave a stale page behind."""
    generator = reference_generator()
    exposed = {m.name for _, _, docs in generator.metric_registries() for m in docs}
    histograms = {
        m.name
        for _, _, docs in generator.metric_registries()
        for m in docs
        if m.kind == "histogram"
    }
    known = exposed | {f"{h}{s}" for h in histograms for s in ("_bucket", "_sum", "_count")}
    unknown: list[str] = []
    for page in pages():
        text = page.read_text()
        for name in sorted(set(re.findall(r"(?<![#\w])meshfn_[a-z0-9_]+\*?", text))):
            if name.endswith("*"):
                if not any(e.startswith(name[:-1]) for e in exposed):
                    unknown.append(f"{page.relative_to(DOCS)}: {name}")
            elif (
                name.startswith(
                    (
                        "meshfn_fn_",
                        "meshfn_kube_",
                        "meshfn_xds_",
                        "meshfn_audit_",
                        "meshfn_qos_",
                        "meshfn_ebpf_",
                        "meshfn_egress_",
                        "meshfn_route_",
                        "meshfn_drift_",
                        "meshfn_policy_",
                        "meshfn_code_",
                        "meshfn_certificates_",
                        "meshfn_translate_",
                    )
                )
                and name not in known
            ):
                unknown.append(f"{page.relative_to(DOCS)}: {name}")
    assert not unknown, "\n".join(unknown)
