"""`meshfn filters build`: meshfn's proxy-wasm filters (audit, degrade), built from C."""

from __future__ import annotations

from typing import Annotated

import typer

from meshfn.common.cli import err, fail, out

filters_app = typer.Typer(help="meshfn's proxy-wasm filters (audit, degrade), built from C.")


@filters_app.command("build")
def filters_build(
    native: Annotated[
        bool, typer.Option("--native", help="also the native test-harness builds")
    ] = False,
) -> None:
    """Build the filter modules (clang + lld) into the content-addressed cache; print where."""
    from meshfn.common.progress import RichReporter
    from meshfn.wasm_filters import BuildError, artifacts, build

    try:
        with RichReporter(err, "filters") as progress:
            directory = build(native, progress)
        digests = artifacts(directory)
    except BuildError as exc:
        fail(exc)
    out.print(str(directory), markup=False, highlight=False)
    for name, digest in sorted(digests.items()):
        err.print(f"  {name}.wasm  sha256:{digest}", markup=False, highlight=False)
