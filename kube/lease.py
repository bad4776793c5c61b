"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it.

Every replica watches and compiles; only the holder of the Lease writes (applies, status,
Events, drift trips). A replica takes the Lease when its holder has not renewed it for
`lease_duration`, judged by when *this* replica last saw the record change (its own monotonic
clock), never by comparing the holder's renewTime with the local wall clock, so clock skew
between nodes cannot produce two leaders. Writes go through PUT with the resourceVersion read,
so two candidates racing for an expired Lease cannot both win. A leader that cannot renew
within `renew_deadline` steps down on its own, before anyone else may take over
(renew_deadline < lease_duration).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from meshfn.common.kube.api import LEASES, ApiError, KubeClient, Obj, Unreachable
from meshfn.common.kube.metrics import KubeMetrics

log = logging.getLogger("meshfn.kube.lease")

Callback = Callable[[], Awaitable[None]]


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Timing:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("need 0 < retry period < renew deadline < lease duration")


class LeaderElector:
    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        timing: Timing = Timing(),
        metrics: KubeMetrics | None = None,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timing = timing
        self.metrics = metrics or KubeMetrics()
        self.leading = asyncio.Event()
        self.holder = ""  # who holds the Lease, as last seen
        self.transitions = 0
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._on_start: list[Callback] = []
        self._on_stop: list[Callback] = []

    def on_started_leading(self, callback: Callback) -> None:
        self._on_start.append(callback)

    def on_stopped_leading(self, callback: Callback) -> None:
        self._on_stop.append(callback)

    def status(self) -> dict[str, object]:
        return {
            "lease": f"{self.namespace}/{self.name}",
            "identity": self.identity,
            "leader": self.leading.is_set(),
            "holder": self.holder,
            "lease_duration_s": self.timing.lease_duration,
        }

    def _record(self, lease: Obj | None, transitions: int) -> Obj:
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.timing.lease_duration)),
            "renewTime": _now(),
            "leaseTransitions": transitions,
        }
        if lease is None:
            return {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {**spec, "acquireTime": _now()},
            }
        previous = lease.get("spec") or {}
        if previous.get("holderIdentity") == self.identity:
            spec["acquireTime"] = previous.get("acquireTime") or _now()
        else:
            spec["acquireTime"] = _now()
        return {**lease, "spec": spec}

    async def _try(self) -> bool:
        """One acquire-or-renew attempt; True while we hold the Lease."""
        lease = await self.kube.get_or_none(LEASES, self.name, self.namespace)
        now = time.monotonic()
        if lease is None:
            try:
                await self.kube.create(LEASES, self._record(None, 0), self.namespace)
            except ApiError as exc:
                if exc.status == 409:  # another replica created it first
                    return False
                raise
            self.holder = self.identity
            return True
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        observed = (holder, str(spec.get("renewTime") or ""))
        if observed != self._observed:
            self._observed, self._observed_at = observed, now
        self.holder = holder
        duration = float(spec.get("leaseDurationSeconds") or self.timing.lease_duration)
        expired = now - self._observed_at >= duration
        if holder and holder != self.identity and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder != self.identity:
            transitions += 1
        try:
            await self.kube.replace(LEASES, self._record(lease, transitions))
        except ApiError as exc:
            if exc.status == 409:  # somebody else wrote in between: re-read next round
                return False
            raise
        self.holder = self.identity
        self._observed, self._observed_at = None, now
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign until `stop`; on stop, the leader releases the Lease so a follower takes
        over at once instead of after `lease_duration`."""
        last_renew = 0.0
        try:
            while not stop.is_set():
                try:
                    # As client-go: an attempt may take up to the renew deadline (a loaded
                    # apiserver answers slowly; giving up sooner only delays a takeover).
                    held = await asyncio.wait_for(self._try(), self.timing.renew_deadline)
                    if held:
                        last_renew = time.monotonic()
                except (ApiError, Unreachable, TimeoutError) as exc:
                    log.warning("leader election: %s", exc or "request timed out")
                    # A leader keeps leading through failed renewals until the renew deadline:
                    # nobody can take over before the lease duration, which is longer.
                    held = self.leading.is_set() and (
                        time.monotonic() - last_renew < self.timing.renew_deadline
                    )
                if held != self.leading.is_set():
                    await self._transition(held)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.timing.retry_period)
        finally:
            if self.leading.is_set():
                await self._release()
                await self._transition(False)

    async def _transition(self, leading: bool) -> None:
        self.transitions += 1
        self.metrics.leader.set(1 if leading else 0)
        self.metrics.leader_changes.labels("leader" if leading else "follower").inc()
        if leading:
            self.leading.set()
            log.info("became the leader (Lease %s/%s)", self.namespace, self.name)
        else:
            self.leading.clear()
            log.warning("stopped leading (Lease %s/%s)", self.namespace, self.name)
        for callback in self._on_start if leading else self._on_stop:
            try:
                await callback()
            except Exception:
                log.exception("leadership callback failed")

    async def _release(self) -> None:
        with contextlib.suppress(ApiError, Unreachable, TimeoutError):
            lease = await self.kube.get_or_none(LEASES, self.name, self.namespace)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = dict(lease["spec"])
                spec["holderIdentity"] = ""
                spec["leaseDurationSeconds"] = 1
                await asyncio.wait_for(self.kube.replace(LEASES, {**lease, "spec": spec}), 3)
