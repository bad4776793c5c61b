"""The meshfn operator: custom resources -> MeshModel -> Istio objects and backends -> the cluster.

The composition root of Kubernetes mode (`meshfn kube run`). Every replica watches the custom
resources and compiles them (so a new leader starts warm and misses nothing), serves the
access-log stream that feeds the drift breaker, and serves the filter modules WasmPlugins
fetch. Only the leader writes: server-side applies, prunes, status conditions, Events, and the
degrade WasmPlugin when the breaker trips or recovers. A new leader first rebuilds its
inventory from the live objects and then reconciles everything once, so an update the old
leader had not applied when it died is applied now.

When the apiserver is unreachable or slow, what was applied stays as it is; the reconcile is
retried with backoff, and the logs, `meshfn_kube_apiserver_reachable`, `meshfn_kube_pending_objects`
and `meshfn status` say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import ssl
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

import grpc
import yaml
from aiohttp import web
from envoy.data.accesslog.v3 import accesslog_pb2
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meshfn import istio
from meshfn import wasm_filters as filters
from meshfn.common import env
from meshfn.common.adminauth import Guard, KubeAuthenticator, guard_middleware
from meshfn.common.kube.api import ApiError, Backoff, KubeClient, Obj, Resource, Unreachable
from meshfn.common.kube.metrics import KubeMetrics
from meshfn.contracts.kube import ANNOTATION_SOURCE, API_VERSION, BY_KIND
from meshfn.contracts.plugins import SubjectSalt
from meshfn.health.drift import DriftBreaker, WatchedRoute, watched_routes
from meshfn.ir import MeshModel, Overlay
from meshfn.istio import RenderOptions
from meshfn.istio.core import Context as IstioContext
from meshfn.istio.traffic import istio_cluster
from meshfn.policy.kube_source import Build, KubePolicySource, ObjectKey, wait_either
from meshfn.policy.source import format_loc
from meshfn.xds.als import AccessLogReceiver
from meshfn.xds.names import LATENCY_LOG

from .apply import Applier, Desired, Report, describe
from .lease import LeaderElector, Timing
from .status import Outcome, StatusWriter
from .workloads import BackendSettings, Rendered, render_backends

log = logging.getLogger("meshfn.kube")

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def plural(kind: str) -> str:
    """The REST name of a kind (what discovery would say for the kinds meshfn renders)."""
    lower = kind.lower()
    if lower.endswith("y") and lower[-2:-1] not in "aeiou":
        return lower[:-1] + "ies"
    return lower + ("es" if lower.endswith("s") else "s")


def _res(api_version: str, kind: str) -> Resource:
    group, _, version = api_version.rpartition("/")
    return Resource(group, version, plural(kind), kind)


# Every kind the operator may create, so it can list (inventory) and prune them: what the Istio
# renderer produces (its registry), and the Functions' backends.
MANAGED: tuple[Resource, ...] = (
    *(_res(k.api_version, k.kind) for k in istio.KINDS),
    _res("v1", "ConfigMap"),
    _res("v1", "Service"),
    _res("v1", "ServiceAccount"),
    _res("apps/v1", "Deployment"),
    _res("autoscaling/v2beta2", "HorizontalPodAutoscaler"),
    _res("keda.sh/v1alpha1", "ScaledObject"),
)
_BY_KIND = {(r.group, r.kind): r for r in MANAGED}
_POD = _res("v1", "Pod")
LEADER_LABEL = "meshfn.io/leader"


# ---------------------------------------------------------------- configuration


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WasmSettings(_Strict):
    """Where Istio's proxies fetch meshfn's filter modules."""

    serve: bool = Field(True, description="serve the built modules at /wasm/sha256/<digest>.wasm")
    baseUrl: str | None = Field(
        None,
        description="URL prefix the WasmPlugins use; default: this control plane's Service",
    )
    oci: str | None = Field(None, description="oci://registry/repository instead of HTTP")


class IstioSettings(_Strict):
    """How meshfn's names map onto the cluster (meshfn.istio.RenderOptions)."""

    labelKey: str = Field("app", description="pod label naming a Service's or Gateway's pods")
    rootNamespace: str = Field("istio-system", description="mesh-wide policies go here")
    clusterDomain: str = "cluster.local"
    journalPath: str = Field(
        "/var/run/meshfn/journal/audit.jsonl", description="where istio-proxy writes the journal"
    )


class TlsSettings(_Strict):
    certFile: str = Field(description="PEM certificate of the admin/wasm server")
    keyFile: str = Field(description="its private key")


class OperatorConfig(_Strict):
    """`meshfn kube run --config FILE` (the Helm chart writes it into a ConfigMap)."""

    namespace: str = Field("meshfn-system", description="where the control plane runs")
    instance: str = Field("meshfn", description="labels what this installation manages")
    service: str = Field("meshfn", description="the control plane's Service name")
    watchNamespace: str | None = Field(None, description="only this namespace; default all")
    leaseName: str = "meshfn-leader"
    leaseDuration: Annotated[float, Field(gt=0)] = 15.0
    renewDeadline: Annotated[float, Field(gt=0)] = 10.0
    retryPeriod: Annotated[float, Field(gt=0)] = 2.0
    forceConflicts: bool = Field(
        False, description="take over fields another field manager owns (never by default)"
    )
    resyncSeconds: Annotated[float, Field(gt=0)] = Field(
        600, description="compare live objects with the intent this often"
    )
    debounceSeconds: Annotated[float, Field(ge=0)] = 0.1
    listen: str = "0.0.0.0"
    adminPort: Annotated[int, Field(ge=0, le=65535)] = 9090
    alsPort: Annotated[int, Field(ge=0, le=65535)] = Field(
        18000,
        description="Envoy's access-log stream; the Telemetry providers use the Mesh's "
        "spec.ports.xds as the port of the access-log Service",
    )
    tls: TlsSettings | None = Field(None, description="serve admin and /wasm over HTTPS")
    metricsOpen: bool = Field(
        True,
        description="serve /metrics without a token (who may connect is the NetworkPolicy's"
        " adminFrom); off: a Kubernetes token with the viewer role, as /debug/status",
    )
    saltFile: str | None = Field(
        None, description="the audit subject salt (hex), from a Secret shared by every replica"
    )
    istio: IstioSettings = Field(default_factory=IstioSettings)
    wasm: WasmSettings = Field(default_factory=WasmSettings)
    backends: BackendSettings = Field(default_factory=BackendSettings)

    @classmethod
    def load(cls, path: Path | None, **overrides: Any) -> OperatorConfig:
        data: dict[str, Any] = {}
        if path is not None:
            try:
                loaded = yaml.safe_load(path.read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise ValueError(f"cannot read {path}: {exc}") from None
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: the operator configuration is a mapping")
            data = loaded
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            config = cls.model_validate(data)
            Timing(config.leaseDuration, config.renewDeadline, config.retryPeriod)
        except ValidationError as exc:
            lines = [
                f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
            ]
            raise ValueError(f"{path or 'flags'}: " + "; ".join(lines)) from None
        return config

    def wasm_base(self) -> str:
        if self.wasm.oci:
            return self.wasm.oci
        if self.wasm.baseUrl:
            return self.wasm.baseUrl
        scheme = "https" if self.tls else "http"
        host = f"{self.service}.{self.namespace}.svc.{self.istio.clusterDomain}"
        return f"{scheme}://{host}:{self.adminPort}/wasm/"

    def render_options(self, salt: SubjectSalt | None) -> RenderOptions:
        options = RenderOptions(
            label_key=self.istio.labelKey,
            root_namespace=self.istio.rootNamespace,
            cluster_domain=self.istio.clusterDomain,
            wasm_base_url=self.wasm_base(),
            control_plane_host=f"{self.service}-als.{self.namespace}.svc.{self.istio.clusterDomain}",
            journal_path=self.istio.journalPath,
        )
        return options if salt is None else replace(options, salt=salt)

    def salt(self) -> SubjectSalt | None:
        if self.saltFile is None:
            return None
        try:
            text = Path(self.saltFile).read_text().strip().lower()
        except OSError as exc:
            raise ValueError(f"cannot read the audit salt {self.saltFile}: {exc}") from None
        if not re.fullmatch(r"[0-9a-f]{32,128}", text) or len(text) % 2:
            raise ValueError(f"{self.saltFile}: expected 32-128 hex digits (the audit salt)")
        return SubjectSalt(text)


# ---------------------------------------------------------------- rendering

Renderer = Callable[[MeshModel, Overlay], list[Rendered]]


def owner_reference(obj: Obj, controller: bool) -> Obj:
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": API_VERSION,
        "kind": obj["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": controller,
        "blockOwnerDeletion": False,
    }


def with_owners(rendered: Rendered, objects: dict[ObjectKey, Obj]) -> tuple[Obj, str]:
    """The object with owner references to the policies it comes from, so deleting them
    garbage-collects it (once all of them are gone). An owner must be cluster-scoped or in the
    dependent's namespace (the garbage collector deletes a dependent whose owner it cannot
    find there), so sources in other namespaces are left out, and an object with none left is
    owned by the Mesh."""
    obj = rendered.obj
    meta = dict(obj["metadata"])
    namespace = meta.get("namespace", "")
    keys = [ObjectKey(*source) for source in rendered.sources]
    owners = [
        objects[k]
        for k in keys
        if k in objects
        and (not k.namespace or k.namespace == namespace)
        and (objects[k].get("metadata") or {}).get("uid")
    ]
    if not owners:
        owners = [o for k, o in sorted(objects.items()) if k.kind == "Mesh"][:1]
    primary = next((k for k in keys if k.kind != "Mesh"), keys[0] if keys else None)
    source = primary.ref if primary else ""
    meta["annotations"] = {**(meta.get("annotations") or {}), ANNOTATION_SOURCE: source}
    if owners:
        meta["ownerReferences"] = [owner_reference(o, i == 0) for i, o in enumerate(owners)]
    return {**obj, "metadata": meta}, source


def desired(build: Build, overlay: Overlay, render: Renderer) -> list[Desired]:
    assert build.model is not None
    out = []
    for rendered in render(build.model, overlay):
        obj, source = with_owners(rendered, build.objects)
        group, _, version = obj["apiVersion"].rpartition("/")
        resource = _BY_KIND.get((group, obj["kind"]))
        if resource is None:
            raise ValueError(
                f"the renderer produced a {obj['apiVersion']} {obj['kind']}, which meshfn does"
                " not manage"
            )
        out.append(Desired(replace(resource, version=version), obj, source))
    return out


def _route_service(model: MeshModel, route_key: str) -> str:
    for workload in model.workloads:
        for listener in workload.listeners:
            for route in listener.routes:
                if route.key == route_key:
                    return route.service
    raise KeyError(route_key)


def istio_renderer(
    options: Callable[[], RenderOptions], digests: Callable[[], dict[str, str]]
) -> Callable[[MeshModel, Overlay], tuple[list[Rendered], list[str]]]:
    """meshfn.istio's objects, each with the policies it came from; and its warnings (what
    Istio cannot express), as `Kind ns/name: field: message [code]` lines."""

    def render(model: MeshModel, overlay: Overlay) -> tuple[list[Rendered], list[str]]:
        rendering = istio.render(model, digests(), options(), overlay)
        out = []
        for objs in rendering.objects.values():
            for obj in objs:
                meta = obj["metadata"]
                origin = rendering.origins.get(
                    (obj["kind"], meta.get("namespace", ""), meta["name"])
                )
                sources = tuple(sorted((s.kind, s.namespace, s.name) for s in origin or ()))
                out.append(Rendered(sources, obj))
        warnings = [
            f"{w.source}: {format_loc(w.path)}: {w.message} [{w.code}]" for w in rendering.warnings
        ]
        return out, warnings

    return render


# ---------------------------------------------------------------- the operator


@dataclass
class ApplyState:
    """What `meshfn status` shows about delivery to the cluster."""

    reachable: bool = True
    last_error: str = ""
    failing_since: float = 0.0
    retry_in: float = 0.0
    applied_at: float = 0.0
    last_report: dict[str, Any] = field(default_factory=dict)


class Operator:
    def __init__(
        self,
        kube: KubeClient,
        config: OperatorConfig,
        identity: str | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.kube = kube
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.metrics = KubeMetrics(self.registry)
        self.identity = (
            identity or env.POD_NAME.get() or (f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
        )
        self.keda = False
        self.hpa_version = "v2beta2"
        self.salt = config.salt()
        self._istio = istio_renderer(
            lambda: config.render_options(self.salt), lambda: self.wasm_digests
        )
        self.warnings: dict[str, list[str]] = {}  # policy -> what Istio cannot express
        self.source = KubePolicySource(
            kube, config.watchNamespace, self.metrics, debounce=config.debounceSeconds
        )
        self.elector = LeaderElector(
            kube,
            config.namespace,
            config.leaseName,
            self.identity,
            Timing(config.leaseDuration, config.renewDeadline, config.retryPeriod),
            self.metrics,
        )
        self.applier = Applier(
            kube, config.instance, MANAGED, self.metrics, force=config.forceConflicts
        )
        self.status_writer = StatusWriter(kube, self.metrics)
        self.drift = DriftBreaker()
        self.overlay = Overlay()
        self.als = AccessLogReceiver(lambda _node: True)
        self.als.subscribe(LATENCY_LOG, self._on_latency)
        self.state = ApplyState()
        self.wasm_dir: Path | None = None
        self.wasm_digests: dict[str, str] = {}
        self.admin_port = 0
        self.als_port = 0
        self.reconciles = 0
        self._wake = asyncio.Event()
        self._resync_due = 0.0
        self.source.on_build(self._on_build)
        self.elector.on_started_leading(self._on_leading)
        self.elector.on_stopped_leading(self._on_following)

    # ------------------------------------------------------------ events

    async def _on_build(self, build: Build) -> None:
        if build.model is not None:
            self.drift.configure(self.watched_routes(build.model))
        self._wake.set()

    def watched_routes(self, model: MeshModel) -> list[WatchedRoute]:
        """The drift breaker's routes with istiod's cluster names: in Istio's access logs the
        primary is `outbound|port||host`, not meshfn's own cluster name."""
        ctx = IstioContext(model, self.config.render_options(self.salt), {}, Overlay())
        return [
            replace(w, primary_clusters=frozenset({istio_cluster(ctx, model.service(key))}))
            for w in watched_routes(model)
            for key in [_route_service(model, w.route)]
        ]

    async def _on_leading(self) -> None:
        self.applier.synced = False
        self.status_writer.written.clear()
        await self._label_self(True)
        self._wake.set()

    async def _on_following(self) -> None:
        await self._label_self(False)

    async def _label_self(self, leader: bool) -> None:
        """Point the access-log Service at the leader (its selector has meshfn.io/leader)."""
        pod = env.POD_NAME.get()
        if not pod:
            return
        body = {"metadata": {"labels": {LEADER_LABEL: "true" if leader else None}}}
        try:
            if leader:
                others, _ = await self.kube.list(
                    _POD, self.config.namespace, f"{LEADER_LABEL}=true"
                )
                for other in others:
                    name = other["metadata"]["name"]
                    if name != pod:
                        unlabel = {"metadata": {"labels": {LEADER_LABEL: None}}}
                        await self.kube.patch(_POD, name, unlabel, self.config.namespace)
            await self.kube.patch(_POD, pod, body, self.config.namespace)
        except (ApiError, Unreachable) as exc:
            log.warning(
                "cannot label pod %s as %s: %s", pod, "leader" if leader else "follower", exc
            )

    def _on_latency(self, _node: str, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        self.drift.observe_access_log(entry, time.monotonic())

    async def _drift_loop(self, stop: asyncio.Event, interval: float = 0.2) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            for transition in self.drift.evaluate(time.monotonic()):
                log.warning(
                    "drift breaker: route %s -> %s (p95 %.1f ms, baseline %.1f ms)",
                    transition.route,
                    transition.to,
                    transition.p95_ms,
                    transition.baseline_ms,
                )
            degraded = self.drift.degraded()
            if degraded != self.overlay.degraded_routes:
                self.overlay = Overlay(degraded_routes=degraded)
                self._wake.set()

    # ------------------------------------------------------------ reconcile

    def render(self, model: MeshModel, overlay: Overlay) -> list[Rendered]:
        """Istio objects (meshfn.istio) and the Functions' backends (workloads)."""
        if model.audit is not None and self.salt is None:
            raise ValueError(
                "the Mesh enables audit, which needs the subject salt every replica shares:"
                " set saltFile (the Helm chart mounts it from a Secret)"
            )
        if model.xds_port != self.config.alsPort:
            log.warning(
                "the Mesh's spec.ports.xds (%d) is where Istio's proxies stream access logs,"
                " but this control plane listens on %d: set ports.accessLog to match",
                model.xds_port,
                self.config.alsPort,
            )
        objects, warnings = self._istio(model, overlay)
        self.warnings = {}
        for line in warnings:
            self.warnings.setdefault(line.split(": ", 1)[0], []).append(line.split(": ", 1)[1])
        return objects + render_backends(
            model, self.config.backends, self.keda, self.hpa_version, self.config.istio.labelKey
        )

    async def _reconcile_loop(self, stop: asyncio.Event) -> None:
        backoff = Backoff()
        retry_at = 0.0
        while not stop.is_set():
            now = time.monotonic()
            waits = [self._resync_due - now] if self._resync_due else []
            if retry_at:
                waits.append(retry_at - now)
            timeout = max(0.0, min(waits)) if waits else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wait_either(self._wake, stop), timeout)
            if stop.is_set():
                return
            self._wake.clear()
            if not self.elector.leading.is_set() or self.source.last is None:
                continue
            try:
                await self.reconcile(self.source.last)
            except Unreachable as exc:
                delay = backoff.next()
                retry_at = time.monotonic() + delay
                if self.state.reachable:
                    self.state.failing_since = time.time()
                self.state.reachable, self.state.last_error = False, str(exc)
                self.state.retry_in = delay
                self.metrics.apiserver_up.set(0)
                log.warning(
                    "apiserver unreachable while applying (%s): keeping what was applied,"
                    " retrying in %.1fs",
                    exc,
                    delay,
                )
                continue
            except ApiError as exc:
                delay = backoff.next()
                retry_at = time.monotonic() + delay
                self.state.last_error, self.state.retry_in = str(exc), delay
                log.error("reconcile failed (%s); retrying in %.1fs", exc, delay)
                continue
            backoff.reset()
            retry_at = 0.0
            self.state.reachable, self.state.last_error, self.state.retry_in = True, "", 0.0
            self.metrics.apiserver_up.set(1)

    async def reconcile(self, build: Build) -> Report:
        """One pass: (inventory,) apply, prune, write the status of every object."""
        self.reconciles += 1
        report = Report()
        now = time.monotonic()
        if not self.applier.synced or now >= self._resync_due:
            # Optional APIs decide what is rendered: KEDA (ScaledObject) and autoscaling/v2
            # (1.23+; 1.20 serves v2beta2).
            self.keda = await self.kube.has_api("keda.sh/v1alpha1")
            self.hpa_version = "v2" if await self.kube.has_api("autoscaling/v2") else "v2beta2"
            self.applier.kinds = [
                replace(r, version=self.hpa_version) if r.kind == "HorizontalPodAutoscaler" else r
                for r in MANAGED
            ]
        wanted: list[Desired] = []
        render_error = ""
        if build.model is not None:
            try:
                # Pure but not free (the first render loads Istio's schemas: ~1.6 s): off the
                # loop, which serves the Lease, watches and probes meanwhile.
                wanted = await asyncio.to_thread(desired, build, self.overlay, self.render)
            except (istio.SchemaError, istio.MissingModule, ValueError) as exc:
                # Nothing is applied from a rendering that failed: what is there stays.
                render_error = f"cannot render: {exc}"
                log.error("%s; keeping what was applied", render_error)
        if not self.applier.synced or now >= self._resync_due:
            await self.applier.sync(wanted)
            self._resync_due = now + self.config.resyncSeconds
        if wanted and self.elector.leading.is_set():
            report = await self.applier.reconcile(wanted, leading=self.elector.leading.is_set)
            self.state.applied_at = time.time()
            self.state.last_report = {
                "applied": [describe(k) for k in report.applied],
                "pruned": [describe(k) for k in report.pruned],
                "unchanged": report.unchanged,
                "conflicts": {describe(k): v for k, v in report.conflicts.items()},
                "failed": {describe(k): v for k, v in report.failed.items()},
            }
        if self.elector.leading.is_set():
            outcomes = self._outcomes(build, wanted, report, render_error)
            await self.status_writer.write(build, outcomes)
        if report.unreachable:
            raise Unreachable(report.unreachable)
        return report

    def _outcomes(
        self, build: Build, wanted: list[Desired], report: Report, render_error: str
    ) -> dict[ObjectKey, Outcome]:
        problems: dict[str, list[str]] = {}
        resources: dict[str, list[dict[str, str]]] = {}
        for item in wanted:
            key = item.key
            for owner in item.obj["metadata"].get("ownerReferences") or []:
                ref = ObjectKey(
                    owner["kind"],
                    key[2] if BY_KIND[owner["kind"]].scope == "Namespaced" else "",
                    owner["name"],
                ).ref
                resources.setdefault(ref, []).append(
                    {"apiVersion": key[0], "kind": key[1], "namespace": key[2], "name": key[3]}
                )
            text = report.conflicts.get(key) or report.failed.get(key)
            if text:
                label = "conflict" if key in report.conflicts else "rejected"
                problems.setdefault(item.source, []).append(f"{describe(key)}: {label}: {text}")
        return {
            key: Outcome(
                verdict,
                (render_error,) if render_error else tuple(problems.get(key.ref, ())),
                tuple(sorted(resources.get(key.ref, ()), key=lambda r: tuple(r.values()))),
                tuple(self.warnings.get(key.ref, ())),
            )
            for key, verdict in build.verdicts.items()
        }

    # ------------------------------------------------------------ serving

    def status_document(self) -> dict[str, Any]:
        """/debug/status, in the shape `meshfn status` reads, plus the `kube` section."""
        last = self.source.last
        source = self.source.status()
        kinds = source["kinds"]
        assert isinstance(kinds, dict)
        watch_errors = [k["error"] for k in kinds.values() if k["error"]]
        reachable = self.state.reachable and all(k["watching"] for k in kinds.values())
        return {
            "policies": "kubernetes",
            "generation": self.source.builds,
            "policy_errors": [str(e) for e in last.errors] if last else [],
            "proxies": [],
            "routes": self.drift.snapshot(time.monotonic()),
            "kube": {
                "identity": self.identity,
                "election": self.elector.status(),
                "source": source,
                "apply": {
                    "apiserver_reachable": reachable,
                    "error": self.state.last_error or (watch_errors[0] if watch_errors else ""),
                    "failing_since": self.state.failing_since if not self.state.reachable else None,
                    "retry_in_s": round(self.state.retry_in, 1),
                    "applied_at": self.state.applied_at,
                    "inventory": len(self.applier.inventory),
                    "last": self.state.last_report,
                },
                "wasm": {"base": self.config.wasm_base(), "modules": self.wasm_digests},
            },
            "now": time.time(),
        }

    def _is_open(self, request: web.Request) -> bool:
        """What the admin port answers without a credential: probes, the filter modules
        (content-addressed public code that istio-agent fetches without one), and /metrics while
        `metricsOpen` (the NetworkPolicy's adminFrom scopes it)."""
        path = request.path
        if path in ("/healthz", "/readyz") or path.startswith("/wasm/"):
            return True
        return path == "/metrics" and self.config.metricsOpen

    def _guard(self) -> Guard:
        """Everything else: the caller's Kubernetes token, TokenReview and SubjectAccessReview
        (meshfn.common.adminauth.KubeAuthenticator); /debug/status needs the viewer role."""

        async def review(path: str, body: Obj) -> Obj:
            return await self.kube.request("POST", path, body=body)

        return Guard(KubeAuthenticator(review, self.config.namespace), self._is_open)

    def _app(self) -> web.Application:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
            )

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok\n")

        async def readyz(_: web.Request) -> web.Response:
            if not self.source.synced.is_set():
                return web.Response(status=503, text="not synced with the apiserver yet\n")
            return web.Response(text="ok\n")

        async def status(_: web.Request) -> web.Response:
            return web.json_response(self.status_document())

        async def wasm(request: web.Request) -> web.StreamResponse:
            digest = request.match_info["digest"]
            if not _SHA256.match(digest) or self.wasm_dir is None:
                return web.Response(status=404, text="unknown module\n")
            for name, known in self.wasm_digests.items():
                if known == digest:
                    return web.FileResponse(
                        self.wasm_dir / f"{name}.wasm",
                        headers={
                            "Content-Type": "application/wasm",
                            "Cache-Control": "public, max-age=31536000, immutable",
                        },
                    )
            return web.Response(status=404, text="unknown module\n")

        app = web.Application(middlewares=[guard_middleware(self._guard())])
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/debug/status", status)
        if self.config.wasm.serve:
            app.router.add_get("/wasm/{digest}.wasm", wasm)
        return app

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        if self.config.wasm.serve:
            wasm_dir, missing = await asyncio.to_thread(filters.prepare)
            if wasm_dir is None:
                log.warning("not serving filter modules: %s", missing)
            else:
                self.wasm_dir, self.wasm_digests = wasm_dir, filters.artifacts(wasm_dir)
        runner = web.AppRunner(self._app(), access_log=None)
        await runner.setup()
        tls = None
        if self.config.tls is not None:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(self.config.tls.certFile, self.config.tls.keyFile)
        site = web.TCPSite(runner, self.config.listen, self.config.adminPort, ssl_context=tls)
        await site.start()
        self.admin_port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((self.als.handler(),))
        self.als_port = server.add_insecure_port(f"{self.config.listen}:{self.config.alsPort}")
        await server.start()
        log.info(
            "meshfn operator %s: admin :%d, access logs :%d, lease %s/%s",
            self.identity,
            self.admin_port,
            self.als_port,
            self.config.namespace,
            self.config.leaseName,
        )
        if ready is not None:
            ready.set()
        tasks = [
            asyncio.create_task(self.source.run(stop)),
            asyncio.create_task(self.elector.run(stop)),
            asyncio.create_task(self._reconcile_loop(stop)),
            asyncio.create_task(self._drift_loop(stop)),
        ]
        try:
            await stop.wait()
        finally:
            # The elector releases the Lease on stop, so a follower takes over at once.
            for task in tasks:
                if task is not tasks[1]:
                    task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await server.stop(grace=1)
            await runner.cleanup()
