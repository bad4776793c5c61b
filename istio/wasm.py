"""WasmPlugin: meshfn's audit and degrade filters on Istio's proxies.

- `pluginConfig` is the translator's plugin JSON, from the same builders
  (meshfn.xds.fragments.plugins).
- Placement as in the translator: audit (and the combined plugin) in phase AUTHZ, i.e. after
  Istio's jwt_authn and before its RBAC; the degrade filter alone in STATS (after RBAC).
  Within a phase a higher priority runs first: ours run before other plugins of the phase, so a
  request another plugin rejects is still audited.
- Always the full build: istiod gives every WasmPlugin an empty vm_id, so Envoy shares one VM
  between all plugins of the same module, and a -lean VM refuses a second configuration
  (wasm_filters/README.md). The full build serves any number of configurations in one VM.
- FAIL_CLOSE: a dead VM answers 503 instead of passing requests unaudited.
"""

from __future__ import annotations

import json

from meshfn.contracts.plugins import build_name, plugin_json

from .core import Context, Obj, Source, gateways, resource, selector, sidecar_services
from .plugins import Plugin, plugins_of

EXTENSIONS = "extensions.istio.io/v1alpha1"
PLUGIN_PRIORITY = 1000
PHASE = {"audit": "AUTHZ", "meshfn": "AUTHZ", "degrade": "STATS"}
ROOT_ID = {"audit": "meshfn_audit", "degrade": "meshfn_degrade", "meshfn": "meshfn"}


class MissingModule(LookupError):
    """The digests given to the renderer lack a build (the filters were not built)."""


def module_source(ctx: Context, plugin: Plugin) -> tuple[str, str, str | None]:
    """(build, url, sha256) of the module that runs `plugin` (always the full build). Istio
    checks an OCI image's manifest digest against sha256, not the module's: an OCI URL is
    pinned by its tag (the module's sha256) instead, and has no sha256."""
    build = build_name(plugin.kind, lean=False)
    digest = ctx.digests.get(build)
    if digest is None:
        raise MissingModule(f"no sha256 for the {build} filter module: run `meshfn filters build`")
    url = ctx.options.wasm_url(build, digest)
    return build, url, None if url.startswith("oci://") else digest


def _spec(ctx: Context, plugin: Plugin, workload: str) -> Obj:
    build, url, digest = module_source(ctx, plugin)
    config = plugin_json(plugin.settings)
    spec: Obj = {"selector": selector(ctx.options, workload), "url": url}
    if digest is not None:
        spec["sha256"] = digest
    spec |= {
        "imagePullPolicy": "IfNotPresent",  # content-addressed: never changes under one URL
        "pluginName": ROOT_ID[plugin.kind],
        "phase": PHASE[plugin.kind],
        "priority": PLUGIN_PRIORITY,
        "failStrategy": "FAIL_CLOSE",
        "pluginConfig": json.loads(config),
        # Names the build in the VM's environment (config dumps); constant per plugin, so a
        # drift-breaker trip changes nothing but pluginConfig.
        "vmConfig": {"env": [{"name": "MESHFN_FILTER_BUILD", "value": build}]},
    }
    if plugin.listener is not None:
        spec["match"] = [{"mode": "CLIENT", "ports": [{"number": plugin.listener.port}]}]
    else:
        # A sidecar audits the requests its workload serves. Without a match Istio puts the
        # plugin on the outbound listeners too (CLIENT_AND_SERVER): the workload's own calls
        # would be recorded as answered by it, with claim headers it could set itself.
        spec["match"] = [{"mode": "SERVER"}]
    return spec


def wasm_plugins(ctx: Context) -> None:
    for service in sidecar_services(ctx.model):
        sidecar = next(
            w for w in ctx.model.workloads if w.inbound and w.inbound.service == service.key
        )
        for plugin in plugins_of(ctx, sidecar):
            name = f"meshfn-{plugin.kind}-{service.name}"
            ctx.emit(
                resource(
                    EXTENSIONS,
                    "WasmPlugin",
                    name,
                    service.namespace,
                    _spec(ctx, plugin, service.name),
                ),
                Source("Mesh", "", ctx.model.name),
                Source("Service", service.namespace, service.name),
            )
    for gw in gateways(ctx.model):
        for plugin in plugins_of(ctx, gw):
            assert plugin.listener is not None
            name = f"meshfn-{plugin.kind}-{gw.name}-{plugin.listener.name}"
            sources = [Source("Gateway", gw.namespace, gw.name)]
            if plugin.audit is not None:
                sources.append(Source("Mesh", "", ctx.model.name))
            ctx.emit(
                resource(EXTENSIONS, "WasmPlugin", name, gw.namespace, _spec(ctx, plugin, gw.name)),
                *sources,
            )
