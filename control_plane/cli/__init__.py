"""`meshfn`: run the mesh, validate policies, and see inside the control plane.

The command tree is assembled here, in the order `meshfn --help` lists it; each command group
lives in a module of its own (policies, run, status, access, render, identity, filters) over `shared`
(options, policy loading, the admin port). `meshfn audit`, `meshfn kube` and `meshfn fn` are the
audit trail's, the operator's and the inference backend's own sub-apps, mounted as they are.
"""

from __future__ import annotations

import os

# Must precede the first gRPC import: our children exec right after fork, so grpc-core's fork
# handlers only print warnings.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from meshfn.audit.cli import audit_app
from meshfn.common.cli import command_app, run_cli
from meshfn.common.clihelp import reflow_help
from meshfn.inference.cli import fn_app
from meshfn.kube.cli import kube_app

from . import access, policies, run, status
from .access import admin_app
from .filters import filters_app
from .identity import ca_app, certs_app, token_app
from .render import render_app

__all__ = ["app", "main"]

app = command_app(
    "meshfn", "meshfn: a zero-trust service mesh for serverless AI inference (xDS control plane)."
)

for command in (
    policies.analyze,
    policies.validate,
    policies.translate,
    policies.schema,
    run.bootstrap,
    run.up,
    run.serve,
    status.status,
    status.config_dump,
    access.console,
):
    app.command()(command)  # named after the function: config_dump -> config-dump

app.add_typer(render_app, name="render")
app.add_typer(token_app, name="token")
app.add_typer(audit_app, name="audit")
app.add_typer(certs_app, name="certs")
app.add_typer(ca_app, name="ca")
app.add_typer(admin_app, name="admin")
app.add_typer(filters_app, name="filters")
app.add_typer(kube_app, name="kube")
app.add_typer(fn_app, name="fn", help="Model functions: build, sign, publish (WASM).")
reflow_help(app)  # last: every command and sub-app is registered by now


def main() -> None:
    run_cli(app)
