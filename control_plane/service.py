"""The control plane: policies -> MeshModel -> snapshots -> ADS, with hot reload.

Data flows one way. A reload loads and translates off the event loop (in a worker thread), then
publishes the new snapshots on the loop in one step; a reload that fails leaves the last good
MeshModel and snapshots in force and records why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import gc
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2

from meshfn.audit.salt import load_or_create
from meshfn.contracts.journal import journal_dir
from meshfn.contracts.qos import TOKEN_LEDGER_PURPOSE
from meshfn.health.drift import DriftBreaker, Transition, watched_routes
from meshfn.ir import MeshModel, Overlay, TraceCollector
from meshfn.policy import PolicyError, PolicyErrors, PolicyLoader
from meshfn.policy.loader import POLICY_SUFFIXES
from meshfn.policy.rollout import Published
from meshfn.policy.watch import watch_directory
from meshfn.rollout.controller import Event as RolloutEvent
from meshfn.rollout.controller import RolloutController
from meshfn.rollout.shadow import Backend as ShadowBackend
from meshfn.rollout.shadow import ShadowReader
from meshfn.rollout.state import FileStore
from meshfn.wasm_filters import BuildError, artifacts
from meshfn.xds.als import AccessLogReceiver
from meshfn.xds.cache import InconsistentSnapshot, Snapshot, SnapshotCache, prepare
from meshfn.xds.ledger import Budgeted, TokenLedgerService, budgeted_functions
from meshfn.xds.names import LATENCY_LOG, SECRET
from meshfn.xds.rls import GlobalPolicy, RateLimitService, global_policies
from meshfn.xds.server import AdsServer
from meshfn.xds.status import Metrics
from meshfn.xds.translate import OFFLINE_HOST, AppSockets, ProxyHost, translate

from .identity.bootstrap_token import LIMIT_SERVICE_PURPOSE, BootstrapTokens
from .identity.issuer import LocalIssuer
from .identity.manager import IdentityManager

log = logging.getLogger("meshfn.control_plane")

ModelListener = Callable[[MeshModel, MeshModel | None], Awaitable[None]]
AppSocketsOf = Callable[[MeshModel], AppSockets]
RolloutListener = Callable[[list[RolloutEvent]], Awaitable[None]]
SHADOW_READ_SECONDS = 0.5  # how often the backends' shadow comparisons are read


@dataclass
class ReloadResult:
    ok: bool
    changed: list[str] = field(default_factory=list)  # workloads whose snapshot changed
    errors: list[PolicyError] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class ReloadEvent:
    """One reload, kept for the console: when, whether it was taken, and why not."""

    at: float  # wall clock
    ok: bool
    generation: int
    changed: tuple[str, ...] = ()
    errors: tuple[PolicyError, ...] = ()


@dataclass
class PolicyState:
    generation: int = 0  # successful reloads that changed something
    loaded_at: float = 0.0
    errors: list[PolicyError] = field(default_factory=list)
    failed_at: float = 0.0
    history: deque[ReloadEvent] = field(default_factory=lambda: deque(maxlen=20))

    def rejected(self, errors: list[PolicyError]) -> None:
        self.errors = errors
        self.failed_at = time.time()
        self.history.append(ReloadEvent(self.failed_at, False, self.generation, (), tuple(errors)))


def tune_gc() -> None:
    """Make CPython's cyclic GC cheap for a long-running server with many live objects.

    A push to a thousand streams allocates enough to trigger several young-generation
    collections, each walking objects that will live for the whole run (snapshots, streams); at
    the default threshold (700) that doubled the p99 time for a thousand proxies to ACK an
    endpoint change (measured: 330-440 ms -> 190 ms). So: freeze what exists after the first
    load (it is never collected anyway) and collect the young generation less often.
    """
    gc.collect()
    gc.freeze()
    _gc_tuned[0] = True
    scale_gc(0)


# Each open ADS stream keeps ~40 young container objects alive between requests (its pending
# read's coroutines, futures and grpc batch tags, made anew for every message), and a young
# collection walks all of them: at the fixed threshold, 3,000 streams cost ~100 ms per
# collection and one ran per push (measured with bench/xds_push.py, one connection per
# client: p50 1.1 s -> 0.74 s without collections). So the threshold grows with the streams,
# keeping collections as rare per push as with a few streams; what it bounds (cyclic garbage
# not yet collected) stays a few hundred bytes per stream.
GC_YOUNG = 50_000
GC_YOUNG_PER_STREAM = 100
_gc_tuned = [False]


def scale_gc(streams: int) -> None:
    """Called by the ADS server as streams open and close (only once tune_gc has run)."""
    if _gc_tuned[0]:
        gc.set_threshold(GC_YOUNG + GC_YOUNG_PER_STREAM * streams, 50, 50)


async def _every(
    stop: asyncio.Event, seconds: float, step: Callable[[], Awaitable[object]], what: str
) -> None:
    """`step()` every `seconds` until `stop`; a step that fails is logged and tried again."""
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
        try:
            await step()
        except Exception:
            log.exception("%s failed; retrying", what)


class ControlPlane:
    def __init__(
        self,
        policies: Path | str,
        state_dir: Path | str = ".meshfn",
        metrics: Metrics | None = None,
        wasm_dir: Path | None = None,
        wasm_missing: str = "",
        app_sockets: AppSocketsOf | None = None,
        published: Published | None = None,
    ) -> None:
        self.policies = Path(policies)
        self.state_dir = Path(state_dir)
        # Built before serving (filters.prepare); reloads only check it (filters.artifacts).
        self.wasm_dir = wasm_dir
        self.wasm_missing = wasm_missing
        # The applications behind sidecars that the runtime around us serves on unix sockets
        # (`meshfn up`; ProxyHost.app_sockets); None: every application on its endpoint.
        self.app_sockets = app_sockets
        # `published`: the function registry's versions (Rollouts' versions are checked there)
        self.loader = PolicyLoader(self.policies, published)
        self.cache = SnapshotCache()
        self.metrics = metrics or Metrics()
        self.tokens = BootstrapTokens(self.state_dir / "xds-token.key")
        self.issuer = LocalIssuer(self.state_dir / "issuer")
        self.identity: IdentityManager | None = None
        self.ads = AdsServer(
            self.cache, self.metrics, authenticate=self.tokens.verify, on_streams=scale_gc
        )
        self.drift = DriftBreaker()
        # Rollouts: their state survives a restart in STATE/rollouts (rollout/state.py).
        self.rollouts = RolloutController(FileStore(self.state_dir / "rollouts"))
        self.rollout_listeners: list[RolloutListener] = []
        self._unheard: list[RolloutEvent] = []
        # The backends whose shadow comparisons feed the rollouts (the runtime around us sets
        # it: `meshfn up` knows where its backends listen).
        self.shadow_backends: Callable[[], list[ShadowBackend]] = list
        self._shadow_reader = ShadowReader()
        self._shadow_read_at = 0.0
        self.overlay = Overlay()
        self.als = AccessLogReceiver(self.ads.is_connected)
        self.als.subscribe(LATENCY_LOG, self._on_latency)
        self.ads.add_handler(self.als.handler())
        self._global_qos: dict[str, GlobalPolicy] = {}
        self.rls = RateLimitService(
            lambda: self._global_qos,
            lambda node, header: self.tokens.verify(node, header, LIMIT_SERVICE_PURPOSE),
            self.metrics.registry,
            state=self.state_dir / "rls-buckets.db",
        )
        self.ads.add_handler(self.rls.handler())
        # the mesh's token budgets, which the backends reserve and settle in
        self._budgeted: dict[str, Budgeted] = {}
        self.ledger = TokenLedgerService(
            lambda: self._budgeted,
            lambda node, header: self.tokens.verify(node, header, TOKEN_LEDGER_PURPOSE),
            self.metrics.registry,
            state=self.state_dir / "token-ledger.json",
        )
        self.ads.add_handler(self.ledger.handler())
        self.model: MeshModel | None = None
        # The run mode's own trace collector for a model that traces without naming one
        # (`meshfn up`: its embedded collector); the translator points the proxies at it.
        self.trace_collector: Callable[[MeshModel], TraceCollector | None] = lambda _: None
        # Extra sections of /debug/status from the runtime around the control plane (e.g. eBPF).
        self.status_providers: dict[str, Callable[[], Any]] = {
            "global_rates": self.rls.summary,
            "token_budgets": self.ledger.usage,
        }
        self.state = PolicyState()
        self.xds_port = 0
        self._lock = asyncio.Lock()
        self._listeners: list[ModelListener] = []
        self.watching = asyncio.Event()  # set once policy changes are being watched

    def certificate_expiry(self, group: str) -> dt.datetime | None:
        """When the certificate of a workload (node cluster) expires, if it has one."""
        model, identity = self.model, self.identity
        workload = model.workload(group) if model is not None else None
        if workload is None or identity is None:
            return None
        cert = identity.certificate(workload.identity)
        return cert.not_after if cert is not None else None

    def on_model(self, listener: ModelListener) -> None:
        """Call `listener(new, old)` after every reload that produced a new MeshModel."""
        self._listeners.append(listener)

    def _build(self) -> tuple[MeshModel, Overlay, list[Snapshot]]:
        """Load + translate + encode. Runs in a worker thread under the reload lock (the
        rollouts' states only change under it); touches no loop state."""
        model = self.loader.load()
        overlay = dataclasses.replace(self.overlay, splits=self.rollouts.positions(model))
        return model, overlay, self._snapshots(model, overlay)

    def _identities(self, model: MeshModel) -> IdentityManager:
        identity = self.identity
        if identity is None or (identity.trust_domain, identity.ttl) != (
            model.trust_domain,
            model.certificate_ttl,
        ):
            identity = IdentityManager(self.state_dir, model.trust_domain, model.certificate_ttl)
            self.identity = identity
        return identity

    def _filters(self) -> Path:
        if self.wasm_dir is None:
            reason = f" ({self.wasm_missing})" if self.wasm_missing else ""
            raise BuildError(
                "the policies need meshfn's proxy-wasm filters (audit or a drift breaker), which"
                f" are not built{reason}: run `meshfn filters build` (needs clang and lld) or"
                " set MESHFN_WASM_DIR to prebuilt filters"
            )
        artifacts(self.wasm_dir)
        return self.wasm_dir

    def proxy_host(self, model: MeshModel) -> ProxyHost:
        """Checks the built wasm filters and creates the subject salt only when the policies use
        them, so a mesh without audit or drift breakers needs no filters."""
        drift = any(s.drift is not None and s.fallback for s in model.services)
        # a gateway that routes OpenAI's API by the body's model runs the model router (wasm)
        routes_models = any(
            r.model for w in model.workloads for lst in w.listeners for r in lst.routes
        )
        if model.audit is not None:  # Envoy opens its journal at listener creation
            journals = journal_dir(self.state_dir)
            journals.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            journals.mkdir(exist_ok=True, mode=0o700)
        return ProxyHost(
            wasm_dir=(
                self._filters()
                if drift or routes_models or model.audit is not None
                else OFFLINE_HOST.wasm_dir
            ),
            state_dir=self.state_dir,
            salt=load_or_create(self.state_dir) if model.audit is not None else OFFLINE_HOST.salt,
            collector=self.trace_collector(model),
            app_sockets=self.app_sockets(model) if self.app_sockets is not None else (),
        )

    def _snapshots(self, model: MeshModel, overlay: Overlay | None = None) -> list[Snapshot]:
        """Certificates first (issued or renewed as due), then translate every workload."""
        identity = self._identities(model)
        identity.reload_roots_if_changed()
        issued = identity.ensure(w.identity for w in model.workloads)
        self.metrics.certificates.inc(len(issued))
        snapshots = []
        overlay = self.overlay if overlay is None else overlay
        host = self.proxy_host(model)
        for workload in model.workloads:
            resources = translate(
                model,
                workload.node_cluster,
                identity.credentials(workload.identity),
                overlay,
                host,
                self.tokens.header(workload.node_cluster, LIMIT_SERVICE_PURPOSE),
            )
            assert resources is not None
            snapshot = prepare(
                workload.node_cluster, resources, self.cache.get(workload.node_cluster)
            )
            identity.sent(workload.node_cluster, snapshot.type(SECRET).version, workload.identity)
            snapshots.append(snapshot)
        return snapshots

    def _credentials_due(self) -> bool:
        identity, model = self.identity, self.model
        if identity is None or model is None:
            return False
        if identity.reload_roots_if_changed():
            return True
        if identity.rolling_out():
            workloads = [w.node_cluster for w in model.workloads]
            if identity.advance(workloads, self.ads.acked(SECRET), time.monotonic()):
                return True
        due = identity.next_renewal()
        return due is not None and dt.datetime.now(dt.UTC) >= due

    async def refresh_credentials(self) -> list[str]:
        """Renew certificates that are due (or follow a CA rotation) and push the new secrets;
        returns the workloads whose snapshot changed."""
        async with self._lock:
            model = self.model
            if model is None or not self._credentials_due():
                return []
            snapshots = await asyncio.to_thread(self._snapshots, model)
            changed = [s.group for s in snapshots if self.cache.publish(s)]
        if changed:
            log.info("pushed renewed certificates to %s", ", ".join(changed))
        return changed

    def _on_latency(self, _node: str, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        now = time.monotonic()
        self.drift.observe_access_log(entry, now)
        self.rollouts.observe_access_log(entry, now)

    async def apply_drift(self) -> list[Transition]:
        """Evaluate the drift breaker; when a route trips or recovers, re-translate with the
        new overlay and push (only the degrade filter's configuration changes, over ECDS)."""
        transitions = self.drift.evaluate(time.monotonic())
        for transition in transitions:
            self.metrics.drift_transitions.labels(transition.route, transition.to).inc()
            self.metrics.route_degraded.labels(transition.route).set(transition.to == "degraded")
        degraded = self.drift.degraded()
        if degraded == self.overlay.degraded_routes:
            return transitions
        async with self._lock:
            self.overlay = dataclasses.replace(self.overlay, degraded_routes=degraded)
            model = self.model
            if model is None:
                return transitions
            started = time.perf_counter()
            snapshots = await asyncio.to_thread(self._snapshots, model)
            changed = [s.group for s in snapshots if self.cache.publish(s)]
        log.info(
            "pushed %d degraded route(s) to %s (%.1f ms)",
            len(degraded),
            ", ".join(changed) or "no proxy",
            (time.perf_counter() - started) * 1000,
        )
        return transitions

    async def drift_forever(self, stop: asyncio.Event, interval: float = 0.2) -> None:
        await _every(stop, interval, self.apply_drift, "evaluating the drift breaker")

    async def _push_splits(self) -> list[str]:
        """Re-translate and push when the rollouts' splits moved (call under the lock)."""
        splits = self.rollouts.splits()
        model = self.model
        if splits == self.overlay.splits or model is None:
            return []
        self.overlay = dataclasses.replace(self.overlay, splits=splits)
        snapshots = await asyncio.to_thread(self._snapshots, model)
        return [s.group for s in snapshots if self.cache.publish(s)]

    async def _rollout_events(self, events: list[RolloutEvent]) -> None:
        """Count the events and hand them to the listeners (the audit trail); events from
        before the first listener (the first reload's) wait for it."""
        for event in events:
            self.metrics.rollout_steps.labels(event.rollout, event.event).inc()
        self._unheard += events
        if not self.rollout_listeners:
            return
        events, self._unheard = self._unheard, []
        for listener in self.rollout_listeners:
            try:
                await listener(events)
            except Exception:
                log.exception("recording rollout events failed")

    async def _read_shadows(self) -> None:
        wanted = set(self.rollouts.shadowing())
        now = time.monotonic()
        if not wanted or now - self._shadow_read_at < SHADOW_READ_SECONDS:
            return
        self._shadow_read_at = now
        found = await self._shadow_reader.read(self.shadow_backends(), wanted)
        for (function, candidate), pairs in found.items():
            self.rollouts.observe_shadow(function, candidate, pairs)

    async def apply_rollouts(self) -> list[RolloutEvent]:
        """Judge the rollouts whose interval has come; push the splits that moved (the new
        state is saved before the push: a restart in between pushes it again)."""
        await self._read_shadows()
        async with self._lock:
            events = self.rollouts.evaluate()
            changed = await self._push_splits()
        if changed:
            log.info("pushed rollout splits to %s", ", ".join(changed))
        if events:
            await self._rollout_events(events)
        return events

    async def rollout_action(self, name: str, action: str, by: str) -> RolloutEvent:
        """A person's promote, abort, pause or resume (rollout.ActionError if it cannot be),
        pushed at once."""
        async with self._lock:
            event = self.rollouts.act(name, action, by)
            await self._push_splits()
        await self._rollout_events([event])
        return event

    async def rollouts_forever(self, stop: asyncio.Event, tick: float = 0.1) -> None:
        """Evaluate each rollout every `interval` (its own), checking often enough that a
        breach acts within a tick of its evaluation."""
        await _every(stop, tick, self.apply_rollouts, "evaluating the rollouts")

    async def rotate_credentials_forever(self, stop: asyncio.Event) -> None:
        """Check a few times per certificate half-life (at least every 5 s)."""
        while not stop.is_set():
            model = self.model
            interval = 5.0
            if model is not None:
                interval = min(interval, model.certificate_ttl.total_seconds() / 20)
            if self.identity is not None and self.identity.rolling_out():
                interval = min(interval, 0.2)  # a CA rollout step waits for the proxies' ACKs
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            try:
                await self.refresh_credentials()
            except Exception:
                log.exception("renewing certificates failed; retrying")

    async def reload(self) -> ReloadResult:
        async with self._lock:
            started = time.perf_counter()
            try:
                model, overlay, snapshots = await asyncio.to_thread(self._build)
            except PolicyErrors as exc:
                self.state.rejected(exc.errors)
                self.metrics.reloads.labels("invalid").inc()
                log.error(
                    "policy rejected, keeping the last good configuration:\n%s",
                    "\n".join(f"  {e}" for e in exc.errors),
                )
                return ReloadResult(ok=False, errors=exc.errors)
            # Filters, salt, or a translation that names resources it lacks (which would leave
            # the proxies warming, silently): say why, keep going.
            except (BuildError, InconsistentSnapshot, ValueError, OSError) as exc:
                errors = [
                    PolicyError(str(self.policies), 0, "", f"cannot prepare the proxies: {exc}")
                ]
                self.state.rejected(errors)
                self.metrics.reloads.labels("error").inc()
                log.error("%s; keeping the last good configuration", exc)
                return ReloadResult(ok=False, errors=errors)
            except Exception:
                self.metrics.reloads.labels("error").inc()
                log.exception("reload failed, keeping the last good configuration")
                raise
            changed = [s.group for s in snapshots if self.cache.publish(s)]
            removed = self.cache.retain(s.group for s in snapshots)
            for group in removed:
                log.info("workload %s removed from the policies", group)
            for snapshot in snapshots:
                for type_url, ts in snapshot.types.items():
                    self.metrics.snapshots.labels(snapshot.group, type_url.rsplit(".", 1)[-1]).set(
                        len(ts)
                    )
            seconds = time.perf_counter() - started
            self.metrics.translate_seconds.observe(seconds)
            self.metrics.reloads.labels("ok").inc()
            previous, self.model, self.overlay = self.model, model, overlay
            self._global_qos = global_policies(model)
            self._budgeted = budgeted_functions(model)
            self.drift.configure(watched_routes(model))
            begun = self.rollouts.configure(model)
            self.state.errors = []
            self.state.loaded_at = time.time()
            if changed or removed or previous is None:
                self.state.generation += 1
                self.state.history.append(
                    ReloadEvent(self.state.loaded_at, True, self.state.generation, tuple(changed))
                )
                log.info(
                    "configuration %d published (%.1f ms): %s",
                    self.state.generation,
                    seconds * 1000,
                    ", ".join(changed) or "no proxy changes",
                )
        await self._after_reload(model, previous, begun)
        return ReloadResult(ok=True, changed=changed, seconds=seconds)

    async def _after_reload(
        self, model: MeshModel, previous: MeshModel | None, begun: list[RolloutEvent]
    ) -> None:
        """What follows a taken reload: the rollouts it started, the model's listeners."""
        if begun:
            await self._rollout_events(begun)
        if previous is not None and (previous.xds_port, previous.admin_port) != (
            model.xds_port,
            model.admin_port,
        ):
            log.warning("Mesh ports changed: restart meshfn to move its listening ports")
        if previous != model:
            for listener in self._listeners:
                try:
                    await listener(model, previous)
                except Exception as exc:
                    log.error("applying configuration %d failed: %s", self.state.generation, exc)
        # The listeners have made the backends serve the new candidates (`meshfn up` restarts a
        # backend whose functions changed, and waits for it): their first step starts now.
        for event in begun:
            self.rollouts.restart_step(event.rollout)

    async def start(self, host: str = "127.0.0.1", xds_port: int | None = None) -> int:
        """Start ADS on the Mesh's xds port (or `xds_port`, 0 for any free port)."""
        if self.model is None:
            raise RuntimeError("load the policies (reload) before starting the server")
        port = self.model.xds_port if xds_port is None else xds_port
        self.xds_port = await self.ads.start(host, port)
        return self.xds_port

    async def watch(self, stop: asyncio.Event) -> None:
        """Reload on every finished policy change until `stop` is set (see policy/watch.py)."""
        if self.policies.is_dir():
            root = self.policies

            def relevant(name: str) -> bool:
                return name.endswith(POLICY_SUFFIXES) and not name.startswith(".")
        else:
            root = self.policies.parent
            only = self.policies.name

            def relevant(name: str) -> bool:
                return name == only

        async def changed() -> None:
            with contextlib.suppress(Exception):  # reload() logged it; keep watching
                await self.reload()

        await watch_directory(root, relevant, changed, stop, self.watching)

    async def stop(self) -> None:
        await self.ads.stop()
        await self.rls.flush()
        self.ledger.flush()
