"""Whole-mesh chaos soak: steady load through the gateway while seeded random faults overlap.

The mesh: `meshfn serve` (control plane: ADS, SDS, access-log stream, drift breaker, CA), a
gateway Envoy and two sidecar Envoys in front of two backend processes (one Service, two
endpoints), a standalone audit collector (`meshfn audit collect`) whose store sits on its own
small filesystem (a tmpfs), eBPF acceleration as `--acceleration` says. Every request carries a
JWT the sidecars verify, crosses mTLS (SPIFFE certificates with a 20 s TTL: leaf rotation every
~10 s), passes RBAC and is audited at the sidecar. Processes are supervised as `meshfn up`
supervises its own (restart with backoff): the faults kill, the supervisor brings back.

Faults, in a seeded random order, each kind at least once, overlapping in time:
  cp_kill          SIGKILL the control plane (restarted by its supervisor)
  backend_kill     SIGKILL one backend process
  sidecar_kill     SIGKILL one sidecar Envoy
  ca_rotation      `meshfn ca rotate`, wait until every proxy has a certificate of the new root,
                   `meshfn ca retire` (leaf certificates rotate all along: TTL 20 s)
  collector_restart SIGKILL or SIGTERM the audit collector (restarted)
  policy_valid     a valid policy edit (a route's timeout), then back
  policy_invalid   a broken policy file for a few seconds (refused; the last good one stays)
  stream_drop      every connection from the proxies to the control plane is cut (ADS and the
                   access-log stream: they go through a relay the soak owns)
  disk_full        the audit store's filesystem is filled up, held, then freed
A fault that takes an endpoint away (backend, sidecar) waits until the other endpoint is
serving: both endpoints of the one Service down at once is an outage, not a fault to ride out.

At the end: load stopped, the collector drained, every process stopped; then checked:
`meshfn audit verify` (chain and signatures), each request answered 200 has a 200 record from
some proxy it crossed (audit_missing) and exactly one from the gateway, which no fault kills
(gateway_records_lost, gateway_records_twice), no journal line is stored twice
(audit_duplicates), a sidecar's record is lost only for a request answered just before a
sidecar was SIGKILLed (sidecar_records_lost; sidecar_lost_unexplained: any other), a sidecar
records a request twice only when the gateway retried it (executed_twice <= gateway_retries),
max_recovery_ms over the faults that recovered (unrecovered_faults: the others), control-plane
and backend RSS over each control-plane and backend incarnation that lived a minute or more
(after 10 s of load, against its last sample), no process of the soak left, no eBPF program left
attached.

  .venv/bin/python bench/chaos.py                  # 10 minutes
  .venv/bin/python bench/chaos.py --seconds 25     # the e2e smoke's short run
Prints one line:
  chaos: sent=… failed=… audit_missing=… audit_duplicates=… chain=ok max_recovery_ms=… cp_rss_growth=… …
and writes bench/results/chaos.json (or --json): every fault with its time and recovery.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshfn.audit import layout
from meshfn.audit.sqlite import SqliteStore
from meshfn.audit.store import StoreError
from meshfn.common.adminauth import admin_headers
from meshfn.contracts.journal import journal_path
from meshfn.control_plane.identity.bootstrap_token import BootstrapTokens
from meshfn.control_plane.identity.issuer import LocalIssuer
from meshfn.control_plane.runtime.audit import signer_process
from meshfn.control_plane.runtime.bootstrap import ProxyIdentity
from meshfn.control_plane.runtime.envoy import envoy_process
from meshfn.control_plane.runtime.process import SupervisedProcess
from meshfn.control_plane.runtime.upstreams import upstream_process, upstreams_for
from meshfn.ebpf import Accelerator
from meshfn.policy import load_policies
from meshfn.testing import policies as p
from meshfn.testing.ports import named_ports
from meshfn.testing.processes import MESHFN

HERE = Path(__file__).resolve().parent
TD = "chaos.local"
KINDS = (
    "cp_kill", "backend_kill", "sidecar_kill", "ca_rotation", "collector_restart",
    "policy_valid", "policy_invalid", "stream_drop", "disk_full",
)  # fmt: skip
STORE_FS_MB = 256
ISSUER = "https://issuer.meshfn.local"


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- policies


def policies(ports: dict[str, int], jwks: str, timeout: str = "10s") -> str:
    allowed = {"principals": [f"{TD}/ns/ingress/sa/edge"], "requestPrincipals": ["*"]}
    return p.documents(
        p.mesh("chaos", TD, ports["relay"], ports["admin"], identity={"certificateTTL": "20s"},
               audit={"proxies": "all"}),
        p.gateway(ports["envoy_admin"], ports["listener"], namespace="ingress"),
        p.service("model", ports["app1"], [p.endpoint(ports["app1"], sidecar=ports["sidecar1"]),
                                           p.endpoint(ports["app2"], sidecar=ports["sidecar2"])]),
        p.route("model", "model", "/v2", gateway="ingress/edge", timeout=timeout,
                retries={"attempts": 3, "perTryTimeout": "2s",
                         "retryOn": [*p.RETRY_ON, "gateway-error"]}),
        p.doc("FallbackPolicy", "model", {
            "service": "model",
            "outlierDetection": {"consecutiveGatewayErrors": 1, "consecutive5xxErrors": 3,
                                 "interval": "500ms", "baseEjectionTime": "2s"},
        }),
        p.jwt_authentication("jwt", {"service": "model"}, ISSUER,
                             jwks=jwks, audiences=["meshfn"], maxLifetime="2h"),
        p.authorization("allow", {"service": "model"}, [{"from": [{"source": allowed}]}]),
    )  # fmt: skip


BROKEN = "apiVersion: meshfn.io/v1alpha1\nkind: Route\nmetadata: {name: broken}\nspec: {destination: {service: nowhere}, timeoot: 1s}\n"


# ---------------------------------------------------------------------- the relay


class Relay:
    """TCP relay proxies -> control plane, so the soak can cut their streams (`drop`)."""

    def __init__(self, listen: int, target: int) -> None:
        self.listen, self.target = listen, target
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", self.listen)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:  # the control plane is down: the proxy retries
            writer.close()
            return
        self.writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.writers -= {writer, up_writer}

    def drop(self) -> int:
        cut = len(self.writers) // 2
        for writer in list(self.writers):
            transport = writer.transport
            transport.abort()  # RST, as a broken network path
        return cut

    async def stop(self) -> None:
        self.drop()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


# ---------------------------------------------------------------------- load


class Load:
    """Steady load through the gateway: `rate` requests/s over `connections` keep-alive
    connections; each request has its own path (/v2/chaos/<n>), so audit records can be
    matched to requests one by one."""

    def __init__(self, port: int, token: str, rate: float, connections: int) -> None:
        self.port, self.token = port, token
        self.interval = connections / rate
        self.results: list[tuple[int, float, int, str]] = []  # (n, time, status, detail)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.counter = iter(range(1 << 62))
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(connections)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=15)
        headers = {"authorization": f"Bearer {self.token}"}
        next_at = time.monotonic()
        while not self.stop.is_set():
            with self.lock:
                n = next(self.counter)
            try:
                conn.request("GET", f"/v2/chaos/{n}", headers=headers)
                response = conn.getresponse()
                body = response.read()
                status, detail = (
                    response.status,
                    "" if response.status == 200 else body[:200].decode(errors="replace"),
                )
            except (OSError, http.client.HTTPException) as exc:
                status, detail = 0, repr(exc)[:200]
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=15)
            with self.lock:
                self.results.append((n, time.monotonic(), status, detail))
            next_at += self.interval
            time.sleep(max(0.0, next_at - time.monotonic()))

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def ok_since(self, t: float) -> bool:
        with self.lock:
            return any(r[1] > t and r[2] == 200 for r in self.results[-50:])


# ---------------------------------------------------------------------- the mesh


def rss_kb(pid: int | None) -> int:
    if pid is None:
        return 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def get_json(url: str, state: Path | None = None, timeout: float = 2) -> Any:
    """A GET of a JSON document: on the control plane's admin port as its owner (the token in
    its state directory `state`), or an Envoy admin's (no token)."""
    request = urllib.request.Request(url, headers=admin_headers(state) if state else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@dataclass
class Mesh:
    work: Path
    ports: dict[str, int]
    acceleration: str
    state: Path = field(init=False)
    policies: Path = field(init=False)
    store_dir: Path = field(init=False)
    procs: dict[str, SupervisedProcess] = field(default_factory=dict)
    pids: set[int] = field(default_factory=set)
    accelerator: Accelerator | None = None
    relay: Relay | None = None
    token: str = ""

    def __post_init__(self) -> None:
        self.state = self.work / "state"
        self.policies = self.work / "policies"
        self.store_dir = self.work / "store"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    @property
    def store(self) -> Path:
        return self.store_dir / "audit.db"

    def write_policies(self, timeout: str = "10s") -> None:
        p.write(self.policies / "mesh.yaml", policies(self.ports, self.jwks, timeout))

    async def start(self) -> None:
        self.policies.mkdir(parents=True)
        self.store_dir.mkdir()
        mounted = await asyncio.to_thread(
            subprocess.run,
            ["mount", "-t", "tmpfs", "-o", f"size={STORE_FS_MB}m", "tmpfs", str(self.store_dir)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if mounted.returncode != 0:
            raise SystemExit(f"chaos: needs root to mount the store's tmpfs: {mounted.stderr}")
        issuer = LocalIssuer(self.state / "issuer", ISSUER)
        self.jwks = json.dumps(issuer.jwks())
        self.token = issuer.issue("chaos", ["meshfn"], {"tenant": "acme"}, dt.timedelta(hours=1))
        self.write_policies()
        model = load_policies(self.policies)
        tokens = BootstrapTokens(self.state / "xds-token.key")
        self.accelerator = Accelerator(self.state)
        status = await asyncio.to_thread(self.accelerator.setup, self.acceleration)  # type: ignore[arg-type]
        log(status.line())
        preexec = self.accelerator.child_preexec()
        self.relay = Relay(self.ports["relay"], self.ports["xds"])
        await self.relay.start()
        cp = SupervisedProcess(
            "control plane",
            [MESHFN, "serve", "--policies", str(self.policies), "--state-dir", str(self.state),
             "--xds-port", str(self.ports["xds"]), "--log-level", "warning"],
            self.state / "logs" / "cp.log", ready=self._cp_ready, preexec=preexec,
            ready_timeout=30,
        )  # fmt: skip
        await self._add("cp", cp)
        for spec in upstreams_for(model).values():
            await self._add(
                f"backend-{spec.port}", upstream_process(spec, self.state, None, preexec)
            )
        for workload in model.workloads:
            identity = ProxyIdentity.for_workload(workload, tokens.header(workload.node_cluster))
            name = (
                "gateway"
                if workload.kind == "gateway"
                else f"sidecar-{workload.node_cluster.rsplit(':', 1)[1]}"
            )
            proc = envoy_process(
                identity, self.ports["relay"], self.state, 1, "warning", preexec=preexec
            )
            await self._add(name, proc)
        self.journals = {
            w.node_cluster: journal_path(self.state, w.node_cluster) for w in model.workloads
        }
        journals = [f"{source}={path}" for source, path in self.journals.items()]
        # the signer keeps its key and the witness in the state dir, off the store's tmpfs
        await asyncio.to_thread(lambda: SqliteStore(self.store).close())
        signer, address = signer_process(self.state, self.store)
        await self._add("signer", signer)
        collector = SupervisedProcess(
            "collector",
            [MESHFN, "audit", "collect", "--store", str(self.store), "--checkpoint-every", "500",
             "--signer", address, *(arg for j in journals for arg in ("--journal", j))],
            self.state / "logs" / "collector.log", preexec=preexec,
        )  # fmt: skip
        await self._add("collector", collector)

    async def _add(self, name: str, proc: SupervisedProcess) -> None:
        self.procs[name] = proc
        await proc.start()
        self.track()

    def track(self) -> None:
        """Remember every PID a supervised process ever had (restarts included)."""
        for proc in self.procs.values():
            if proc.pid is not None:
                self.pids.add(proc.pid)

    async def _cp_ready(self) -> bool:
        def healthy() -> bool:
            with urllib.request.urlopen(self.admin + "/healthz", timeout=2) as response:
                return bool(response.status == 200)

        try:
            return await asyncio.to_thread(healthy)
        except OSError:
            return False

    def status(self) -> dict[str, Any] | None:
        try:
            document: dict[str, Any] = get_json(self.admin + "/debug/status", self.state)
            return document
        except (OSError, ValueError):
            return None

    def synced(self) -> bool:
        """The control plane is up and every proxy holds a stream, in sync for every type."""
        document = self.status()
        if document is None:
            return False
        proxies = document["proxies"]
        return len(proxies) == 3 and all(
            len(x["types"]) >= 3 and all(t["in_sync"] for t in x["types"].values()) for x in proxies
        )

    def endpoints_healthy(self) -> bool:
        """The gateway sees both sidecars of the model service healthy: not ejected by outlier
        detection, present in its endpoints (its admin /clusters)."""
        try:
            clusters = get_json(
                f"http://127.0.0.1:{self.ports['envoy_admin']}/clusters?format=json"
            )
        except (OSError, ValueError):
            return False
        wanted = {self.ports["sidecar1"], self.ports["sidecar2"]}
        healthy = set()
        for cluster in clusters.get("cluster_statuses", []):
            if not cluster["name"].startswith("model."):
                continue
            for host in cluster.get("host_statuses", []):
                health = host.get("health_status", {})
                flags = {k for k, v in health.items() if v is True}
                if not flags and health.get("eds_health_status", "HEALTHY") == "HEALTHY":
                    healthy.add(host["address"]["socket_address"]["port_value"])
        return wanted <= healthy

    def stored_up_to(self, sizes: dict[str, int]) -> bool:
        """The store holds every journal at least up to `sizes` (bytes per source)."""
        try:
            store = SqliteStore(self.store, readonly=True)
        except (OSError, StoreError):  # being created or busy: not yet
            return False
        try:
            for source, size in sizes.items():
                position = store.journal_position(source)
                if position is None or position.offset < size:
                    return False
            return True
        finally:
            store.close()

    async def stop(self) -> None:
        for name in ("gateway", *sorted(n for n in self.procs if n.startswith("sidecar")),
                     *sorted(n for n in self.procs if n.startswith("backend")), "collector", "signer", "cp"):  # fmt: skip
            if name in self.procs:
                self.track()
                await self.procs[name].stop(timeout=10)
        if self.relay is not None:
            await self.relay.stop()

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.store_dir)], check=False)


# ---------------------------------------------------------------------- faults


@dataclass
class Fault:
    kind: str
    at: float
    target: str = ""
    recovery_ms: float | None = None
    detail: str = ""
    recovering_at: float = 0.0  # monotonic: when the fault itself was over


class Chaos:
    def __init__(self, mesh: Mesh, load: Load, rng: random.Random, t0: float) -> None:
        self.mesh, self.load, self.rng, self.t0 = mesh, load, rng, t0
        self.faults: list[Fault] = []
        self.endpoint_lock = asyncio.Lock()  # one endpoint away at a time
        self.ca_lock = asyncio.Lock()
        self.policy_lock = asyncio.Lock()
        self.disk_lock = asyncio.Lock()

    async def until(self, what: str, condition: Callable[[], bool], timeout: float = 90) -> float:
        started = time.monotonic()
        while not await asyncio.to_thread(condition):
            if time.monotonic() - started > timeout:
                status = json.dumps(self.mesh.status(), default=str)[:3000]
                raise RuntimeError(f"chaos: {what} not within {timeout} s; status: {status}")
            await asyncio.sleep(0.05)
        return (time.monotonic() - started) * 1000

    async def run(self, kind: str) -> None:
        """Inject one fault; its recovery runs from the moment the fault itself is over (the
        process killed, the policy restored, the disk freed) until the mesh is whole again."""
        fault = Fault(kind, time.monotonic() - self.t0)
        self.faults.append(fault)
        fault.recovering_at = time.monotonic()
        await getattr(self, kind)(fault)
        fault.recovery_ms = round((time.monotonic() - fault.recovering_at) * 1000)
        log(f"{kind} {fault.target} {fault.detail}: recovered in {fault.recovery_ms} ms")
        self.mesh.track()

    def _kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        pid = self.mesh.procs[name].pid
        if pid is not None:
            os.kill(pid, sig)

    async def _process_back(self, name: str, pid_before: int | None) -> None:
        proc = self.mesh.procs[name]
        await self.until(f"{name} restarted", lambda: proc.pid not in (None, pid_before))
        await self.until("the mesh in sync", self.mesh.synced)

    async def cp_kill(self, fault: Fault) -> None:
        before = self.mesh.procs["cp"].pid
        self._kill("cp")
        await self._process_back("cp", before)

    async def _endpoint_fault(self, fault: Fault, prefix: str) -> None:
        async with self.endpoint_lock:
            # both endpoints in service first (none still ejected after an earlier fault)
            await self.until("both endpoints healthy", self.mesh.endpoints_healthy)
            name = self.rng.choice(sorted(n for n in self.mesh.procs if n.startswith(prefix)))
            fault.target = name
            fault.recovering_at = time.monotonic()
            before = self.mesh.procs[name].pid
            self._kill(name)
            await self._process_back(name, before)
            # in service again: the gateway's outlier detection has let it back
            await self.until("both endpoints healthy again", self.mesh.endpoints_healthy)

    async def backend_kill(self, fault: Fault) -> None:
        await self._endpoint_fault(fault, "backend")

    async def sidecar_kill(self, fault: Fault) -> None:
        await self._endpoint_fault(fault, "sidecar")

    async def collector_restart(self, fault: Fault) -> None:
        sig = self.rng.choice([signal.SIGKILL, signal.SIGTERM])
        fault.detail = signal.Signals(sig).name
        before = self.mesh.procs["collector"].pid
        self._kill("collector", sig)
        proc = self.mesh.procs["collector"]
        await self.until("collector restarted", lambda: proc.pid not in (None, before))

    def _cli(self, *args: str) -> str:
        done = subprocess.run(
            [MESHFN, *args, "--policies", str(self.mesh.policies), "--state-dir", str(self.mesh.state)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"meshfn {' '.join(args)}: {done.stderr}")
        return done.stdout

    def _all_on_root(self, root: str) -> bool:
        document = self.mesh.status()
        if document is None:
            return False
        for proxy in document["proxies"]:
            try:
                certs = get_json(
                    f"{self.mesh.admin}/debug/certs?node={proxy['workload']}", self.mesh.state
                )
            except (OSError, ValueError):
                return False
            if certs.get("issuer_root") != root:
                return False
        return len(document["proxies"]) == 3

    async def ca_rotation(self, fault: Fault) -> None:
        async with self.ca_lock:
            async with self.policy_lock:  # `meshfn ca` reads the policies: not while broken
                out = await asyncio.to_thread(self._cli, "ca", "rotate")
            root = out.split()[2].rstrip(";")  # "new root <fp>; trusted: ..."
            fault.detail = root
            await self.until("every proxy on the new root", lambda: self._all_on_root(root), 120)
            async with self.policy_lock:
                await asyncio.to_thread(self._cli, "ca", "retire")
            await self.until("the mesh in sync", self.mesh.synced)

    async def policy_valid(self, fault: Fault) -> None:
        async with self.policy_lock:
            timeout = self.rng.choice(["11s", "12s", "13s"])
            fault.detail = f"route timeout {timeout}"
            self.mesh.write_policies(timeout)
            await asyncio.sleep(self.rng.uniform(1, 4))
            self.mesh.write_policies()
            fault.recovering_at = time.monotonic()
            await self.until("the mesh in sync", self.mesh.synced)

    async def policy_invalid(self, fault: Fault) -> None:
        async with self.policy_lock:
            broken = self.mesh.policies / "broken.yaml"
            p.write(broken, BROKEN)
            await asyncio.sleep(self.rng.uniform(1, 4))
            broken.unlink()
            fault.recovering_at = time.monotonic()
            await self.until("the mesh in sync", self.mesh.synced)

    async def stream_drop(self, fault: Fault) -> None:
        assert self.mesh.relay is not None
        fault.detail = f"{self.mesh.relay.drop()} connections cut"
        await asyncio.sleep(0.2)
        await self.until("the mesh in sync", self.mesh.synced)

    async def disk_full(self, fault: Fault) -> None:
        async with self.disk_lock:
            filler = self.mesh.store_dir / "filler"
            with filler.open("wb") as out:
                chunk = b"\0" * (1 << 20)
                with contextlib.suppress(OSError):  # ENOSPC: full
                    while True:
                        out.write(chunk)
                        out.flush()
            hold = self.rng.uniform(2, 6)
            fault.detail = f"full for {hold:.1f} s"
            await asyncio.sleep(hold)
            filler.unlink()
            fault.recovering_at = time.monotonic()
            sizes = {s: p.stat().st_size for s, p in self.mesh.journals.items() if p.exists()}
            await self.until("the collector caught up", lambda: self.mesh.stored_up_to(sizes))


def schedule(rng: random.Random, seconds: float, gap: float = 12.0) -> list[tuple[float, str]]:
    """Every kind at least once in the first ~70% of the run; on longer runs (> 1 min) more
    faults of random kinds at random times over the whole run, one per `gap` seconds on
    average, so that their effects overlap."""
    kinds = list(KINDS)
    rng.shuffle(kinds)
    plan = [(rng.uniform(2, seconds * 0.7), kind) for kind in kinds]
    if seconds > 60:
        plan += [
            (rng.uniform(2, seconds - 20), rng.choice(KINDS))
            for _ in range(int((seconds - 22) / gap))
        ]
    return sorted(plan)


# ---------------------------------------------------------------------- checks


# A SIGKILLed Envoy loses the access-log lines it had not flushed (--file-flush-interval-msec
# 200): the lines of requests it answered within that interval before the kill. A request the
# client saw answered up to LOST_BEFORE_KILL_S before a sidecar_kill (5x the interval: a loaded
# machine delays the flush timer) or up to LOST_AFTER_KILL_S after (the client reads the answer
# a little after the sidecar wrote it) is explained by that kill; any other lost record is not.
LOST_BEFORE_KILL_S = 1.0
LOST_AFTER_KILL_S = 0.2


def audit_check(
    store: Path,
    state: Path,
    results: list[tuple[int, float, int, str]],
    faults: list[dict[str, Any]],
) -> dict[str, Any]:
    """What the audit trail holds against what was answered. What is promised: every request
    answered 200 has exactly one 200 record from the gateway (which no fault kills:
    gateway_records_lost and gateway_records_twice are 0), no journal line is stored twice
    (duplicates 0), a sidecar's record is lost only by a sidecar_kill (sidecar_lost_unexplained
    0: see LOST_BEFORE_KILL_S), and a sidecar records a request twice only when the gateway
    retried it (executed_twice at most the gateway's retries, checked by the caller)."""
    verify = subprocess.run(
        [MESHFN, "audit", "verify", "--store", str(store), "--json",
         "--public-key", str(layout.public_key_path(state)),
         "--witness", str(layout.witness_path(state))],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    report = json.loads(verify.stdout) if verify.stdout.strip().startswith("{") else {}
    store_reader = SqliteStore(store, readonly=True)
    try:
        rows = store_reader.query(limit=None)
    finally:
        store_reader.close()

    def ok_paths(rows_of: list[dict[str, Any]]) -> Counter[str]:
        return Counter(
            r["path"] for r in rows_of
            if r.get("status") == 200 and str(r.get("path", "")).startswith("/v2/chaos/")
        )  # fmt: skip

    sidecars = ok_paths([r for r in rows if str(r.get("source", "")).startswith("model.")])
    gateway = ok_paths([r for r in rows if str(r.get("source", "")).startswith("edge.")])
    # one journal line stored twice is the same record twice (source, id and time alike); a
    # retried request executed twice has two records that differ in time or source
    by_line = Counter(
        (r.get("source"), r.get("id"), r.get("time"), r.get("path"), r.get("status")) for r in rows
    )
    answered = {f"/v2/chaos/{n}" for n, _, status, _ in results if status == 200}
    missing = sorted(path for path in answered if not sidecars[path] and not gateway[path])
    sidecar_lost = sorted(path for path in answered if not sidecars[path])
    gateway_lost = sorted(path for path in answered if not gateway[path])
    answered_at = {f"/v2/chaos/{n}": at for n, at, status, _ in results if status == 200}
    kills = [f["recovering_at"] for f in faults if f["kind"] == "sidecar_kill"]
    unexplained = [
        path for path in sidecar_lost
        if not any(k - LOST_BEFORE_KILL_S <= answered_at[path] <= k + LOST_AFTER_KILL_S
                   for k in kills)
    ]  # fmt: skip
    return {
        "verify_ok": verify.returncode == 0 and bool(report.get("ok")),
        "verify": {k: v for k, v in report.items() if k != "problems"}
        | {"problems": report.get("problems", [])[:5]},
        "records": len(rows),
        # a request answered 200 without a 200 record from any proxy it crossed
        "missing": len(missing),
        "missing_examples": missing[:10],
        # ... without one from the sidecar (or the gateway) alone: a SIGKILLed Envoy loses
        # the access-log lines it had not flushed yet (--file-flush-interval-msec 200)
        "sidecar_records_lost": len(sidecar_lost),
        "sidecar_lost_examples": sidecar_lost[:10],
        # ... and not answered just before a sidecar_kill: lost some other way
        "sidecar_lost_unexplained": len(unexplained),
        "sidecar_lost_unexplained_examples": unexplained[:10],
        "gateway_records_lost": len(gateway_lost),
        # a journal line stored twice
        "duplicates": sum(c - 1 for c in by_line.values() if c > 1),
        # requests a sidecar answered 200 twice: the gateway retried after the first answer
        # was lost on its way back (a reset mid-response): executed twice, recorded twice
        "executed_twice": sum(1 for c in sidecars.values() if c > 1),
        "gateway_records_twice": sum(1 for c in gateway.values() if c > 1),
    }


def leftover_processes(pids: set[int], work: Path) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            alive.append(pid)
    marker = str(work)
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    alive.append(int(proc.name))
    return sorted(set(alive))


# ---------------------------------------------------------------------- main


async def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ports = named_ports("xds", "relay", "admin", "envoy_admin", "listener", "app1", "app2",
                        "sidecar1", "sidecar2")  # fmt: skip
    mesh = Mesh(work, ports, args.acceleration)
    rng = random.Random(args.seed)
    load: Load | None = None
    result: dict[str, Any] = {"seed": args.seed, "seconds": args.seconds, "rate": args.rate}
    try:
        await mesh.start()
        chaos_wait = Chaos(mesh, None, rng, time.monotonic())  # type: ignore[arg-type]
        await chaos_wait.until("the mesh in sync", mesh.synced, 60)
        load = Load(ports["listener"], mesh.token, args.rate, args.connections)
        await chaos_wait.until("a first answer", lambda: answer(ports["listener"], mesh.token), 60)
        load.start()
        await asyncio.sleep(args.warmup)
        rss_warm = {n: rss_kb(proc.pid) for n, proc in mesh.procs.items()}
        t0 = time.monotonic()
        samples: list[tuple[str, int, float, int]] = []  # (process, pid, time, RSS KiB)
        sampler = asyncio.create_task(sample_rss(mesh, samples))
        chaos = Chaos(mesh, load, rng, t0)
        tasks = []
        for at, kind in schedule(rng, args.seconds):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            log(f"t={at:.1f}s {kind}")
            tasks.append(asyncio.create_task(chaos.run(kind)))
        await asyncio.sleep(max(0.0, t0 + args.seconds - time.monotonic()))
        results_of_tasks = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [repr(r) for r in results_of_tasks if isinstance(r, BaseException)]
        await chaos.until("the mesh in sync at the end", mesh.synced, 120)
        await asyncio.sleep(1.0)
        load.close()
        result["gateway_upstream_stats"] = await asyncio.to_thread(upstream_stats, mesh)
        rss_end = {n: rss_kb(proc.pid) for n, proc in mesh.procs.items()}
        sampler.cancel()
        await asyncio.sleep(1.0)  # the proxies' last access-log flush (200 ms interval)
        await mesh.stop()
        result.update(
            faults=[f.__dict__ for f in chaos.faults],
            fault_errors=errors,
            rss_warm_kb=rss_warm,
            rss_end_kb=rss_end,
            rss_by_incarnation=incarnations(samples),
            cp_restarts=mesh.procs["cp"].restarts,
        )
    finally:
        if load is not None:
            load.close()
        with contextlib.suppress(Exception):
            await mesh.stop()
        problems = mesh.accelerator.shutdown() if mesh.accelerator is not None else []
        result["ebpf_problems"] = problems
        result["ebpf_left"] = ebpf_left(mesh)
        if load is None or "faults" not in result:
            mesh.unmount()
    assert load is not None
    result["audit"] = await asyncio.to_thread(
        audit_check, mesh.store, mesh.state, load.results, result["faults"]
    )
    mesh.unmount()
    result["leftover_processes"] = leftover_processes(mesh.pids, work)
    results = load.results
    failures = [r for r in results if r[2] != 200]
    result["sent"] = len(results)
    result["failed"] = len(failures)
    result["failures"] = Counter(
        f"{status} {detail[:80]}" for _, _, status, detail in failures
    ).most_common(10)
    result["failure_times_s"] = [round(r[1] - t0, 2) for r in failures[:50]]
    return result


def upstream_stats(mesh: Mesh) -> dict[str, int]:
    """The gateway's non-zero failure counters towards the model service (connect failures,
    TLS handshake and verification failures, ejections): what a failed request ran into."""
    wanted = ("cx_connect_fail", "ssl.", "outlier_detection.ejections", "upstream_rq_retry",
              "upstream_cx_destroy_remote_with_active_rq", "lb_healthy_panic", "upstream_rq_5")  # fmt: skip
    try:
        stats = get_json(f"http://127.0.0.1:{mesh.ports['envoy_admin']}/stats?format=json")
    except (OSError, ValueError):
        return {}
    return {
        s["name"]: s["value"] for s in stats.get("stats", [])
        if str(s.get("name", "")).startswith("cluster.model.") and s.get("value")
        and any(w in s["name"] for w in wanted)
    }  # fmt: skip


def ebpf_left(mesh: Mesh) -> list[str]:
    """What of an eBPF attachment is still there after shutdown (should be nothing)."""
    left = []
    accel = mesh.accelerator
    if accel is not None and accel.cgroup_path is not None and accel.cgroup_path.exists():
        left.append(f"cgroup {accel.cgroup_path}")
    if str(mesh.state / "ebpf") in Path("/proc/self/mounts").read_text():
        left.append("bpffs mounted")
    if (mesh.state / "ebpf" / "state.json").exists():
        left.append("ebpf/state.json")
    return left


async def sample_rss(mesh: Mesh, out: list[tuple[str, int, float, int]]) -> None:
    """RSS of the control plane and the backends every 2 s, by PID (restarts are new PIDs)."""
    while True:
        now = time.monotonic()
        for name, proc in mesh.procs.items():
            if (name == "cp" or name.startswith("backend")) and proc.pid is not None:
                with contextlib.suppress(OSError):
                    out.append((name, proc.pid, now, rss_kb(proc.pid)))
        await asyncio.sleep(2)


def incarnations(
    samples: list[tuple[str, int, float, int]], warm_s: float = 10
) -> list[dict[str, Any]]:
    """Per process and PID: RSS once it has run `warm_s` under load, and at its last sample."""
    by_pid: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for name, pid, at, rss in samples:
        by_pid.setdefault((name, pid), []).append((at, rss))
    out = []
    for (name, pid), points in by_pid.items():
        start = points[0][0]
        warm = [(at, rss) for at, rss in points if at - start >= warm_s]
        if len(warm) >= 2:
            out.append({
                "process": name, "pid": pid, "seconds": round(warm[-1][0] - warm[0][0]),
                "warm_kb": warm[0][1], "end_kb": warm[-1][1],
            })  # fmt: skip
    return out


def answer(port: int, token: str) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/v2/chaos/warm", headers={"authorization": f"Bearer {token}"})
        response = conn.getresponse()
        response.read()
        return response.status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def growth(result: dict[str, Any], prefix: str, min_seconds: float = 60) -> float:
    """The largest RSS growth (end / after warm-up) of a `prefix` process over an incarnation
    that lived at least `min_seconds` (the whole run when it was never restarted); falls back
    to the soak's own warm-up and end figures on short runs."""
    lived = [
        i["end_kb"] / i["warm_kb"]
        for i in result.get("rss_by_incarnation", [])
        if i["process"].startswith(prefix) and i["seconds"] >= min_seconds and i["warm_kb"]
    ]
    if lived:
        return max(lived)
    pairs = [
        result["rss_end_kb"][n] / result["rss_warm_kb"][n]
        for n in result["rss_warm_kb"]
        if n.startswith(prefix) and result["rss_warm_kb"][n] and result["rss_end_kb"].get(n)
    ]
    return max(pairs) if pairs else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=600, help="soak duration (default 10 min)")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--rate", type=float, default=200, help="requests/s through the gateway")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=5)
    parser.add_argument("--acceleration", choices=["off", "auto", "ebpf"], default="auto")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "chaos.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshfn-chaos-"))
    try:
        result = asyncio.run(soak(args, work))
    except BaseException:
        log(f"failed; logs kept in {work}/state/logs")
        raise
    shutil.rmtree(work, ignore_errors=True)
    audit = result["audit"]
    result["cp_rss_growth"] = growth(result, "cp")
    result["backend_rss_growth"] = growth(result, "backend")
    # a fault whose task raised never recovered: counted apart, never as a 0 ms recovery
    recoveries = [f["recovery_ms"] for f in result["faults"]]
    result["unrecovered_faults"] = sum(1 for r in recoveries if r is None)
    result["max_recovery_ms"] = max((r for r in recoveries if r is not None), default=0)
    # a sidecar executes a request twice only when the gateway retried it (its route retries
    # on reset, gateway errors and the per-try timeout)
    result["gateway_retries"] = sum(
        v for k, v in result["gateway_upstream_stats"].items() if k.endswith(".upstream_rq_retry")
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=str))
    kinds = Counter(f["kind"] for f in result["faults"])
    print(
        f"chaos: sent={result['sent']} failed={result['failed']} "
        f"audit_missing={audit['missing']} audit_duplicates={audit['duplicates']} "
        f"sidecar_records_lost={audit['sidecar_records_lost']} "
        f"executed_twice={audit['executed_twice']} "
        f"chain={'ok' if audit['verify_ok'] else 'BROKEN'} "
        f"max_recovery_ms={result['max_recovery_ms']} cp_rss_growth={result['cp_rss_growth']:.2f} "
        f"gateway_records_lost={audit['gateway_records_lost']} "
        f"gateway_records_twice={audit['gateway_records_twice']} "
        f"sidecar_lost_unexplained={audit['sidecar_lost_unexplained']} "
        f"gateway_retries={result['gateway_retries']} "
        f"unrecovered_faults={result['unrecovered_faults']} "
        f"backend_rss_growth={result['backend_rss_growth']:.2f} faults={sum(kinds.values())} "
        f"cp_restarts={result['cp_restarts']} fault_errors={len(result['fault_errors'])} "
        f"leftover_processes={len(result['leftover_processes'])} "
        f"ebpf_left={len(result['ebpf_left']) + len(result['ebpf_problems'])} seconds={args.seconds:.0f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    sys.exit(main())
