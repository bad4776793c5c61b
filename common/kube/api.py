"""A small asyncio Kubernetes REST client on aiohttp, for unstructured objects.

Why our own and not a library: every object meshfn reads or writes is unstructured (its own
custom resources, Istio's, and a few core kinds it renders as plain dicts), so generated typed
models buy nothing; the semantics the operator depends on are exactly where the Python clients
differ (lightkube's watch restarts from "now" after a 410 Gone, silently losing the events in
between; kopf owns the event loop and elects peers with its own annotations, not a Lease; the
official `kubernetes` client blocks the loop). What remains is ~one request builder: list with
pagination, watch with bookmarks, server-side apply, status patches, Leases with optimistic
concurrency, all on the HTTP stack meshfn's servers already use, typed for mypy --strict.

The client never retries: callers decide (the source relists, the applier backs off).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import ssl
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import aiohttp
import yaml

from meshfn.common import env

Obj = dict[str, Any]

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_SECONDS = 290  # server-side watch timeout; the apiserver's default cap is 30-60 min
REQUEST_SECONDS = 15.0


@dataclass(frozen=True)
class Resource:
    """A REST collection: group "" is the core API."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, sub: str = "") -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{quote(namespace, safe='')}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{quote(name, safe='')}"
        if sub:
            base += f"/{sub}"
        return base


LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
EVENTS = Resource("", "v1", "events", "Event")
NAMESPACES = Resource("", "v1", "namespaces", "Namespace", namespaced=False)
CRDS = Resource(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False
)


class ApiError(Exception):
    """A non-2xx answer from the apiserver, with its Status object's reason and message."""

    def __init__(self, status: int, body: Obj | str, method: str, path: str) -> None:
        self.status = status
        self.method = method
        self.path = path
        self.body: Obj = body if isinstance(body, dict) else {"message": body}
        self.reason: str = str(self.body.get("reason", ""))
        self.message: str = str(self.body.get("message", body))
        super().__init__(f"{method} {path}: {status} {self.reason}: {self.message}")

    @property
    def causes(self) -> list[Obj]:
        details = self.body.get("details") or {}
        causes = details.get("causes") or []
        return [c for c in causes if isinstance(c, dict)]


class Unreachable(Exception):
    """The apiserver did not answer (connection refused, timeout, TLS failure)."""


@dataclass
class WatchEvent:
    type: Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]
    object: Obj


# ---------------------------------------------------------------- configuration


@dataclass
class KubeConfig:
    """Where the apiserver is and how to authenticate: a kubeconfig context or the pod's
    service account. Exec credential plugins (EKS, GKE) are run when a token is needed."""

    server: str
    token: str | None = None
    token_file: Path | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    exec_command: list[str] | None = None
    exec_env: dict[str, str] = field(default_factory=dict)
    namespace: str = "default"
    _tmp: Any = field(default=None, repr=False)

    @classmethod
    def in_cluster(cls) -> KubeConfig:
        host = env.KUBERNETES_SERVICE_HOST.get()
        port = env.KUBERNETES_SERVICE_PORT.get_or("443")
        if not host or not (SERVICE_ACCOUNT / "token").exists():
            raise ValueError("not running in a pod (no KUBERNETES_SERVICE_HOST or token)")
        if ":" in host:
            host = f"[{host}]"
        namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip()
        return cls(
            server=f"https://{host}:{port}",
            token_file=SERVICE_ACCOUNT / "token",
            ca_file=str(SERVICE_ACCOUNT / "ca.crt"),
            namespace=namespace or "default",
        )

    @classmethod
    def from_file(cls, path: Path, context: str | None = None) -> KubeConfig:
        try:
            document = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read kubeconfig {path}: {exc}") from None
        if not isinstance(document, dict):
            raise ValueError(f"kubeconfig {path} is not a mapping")

        def named(section: str, name: str) -> Obj:
            for entry in document.get(section) or []:
                if entry.get("name") == name:
                    return dict(entry.get(section.rstrip("s")) or {})
            raise ValueError(f"kubeconfig {path}: no {section.rstrip('s')} named {name!r}")

        context_name = context or document.get("current-context")
        if not context_name:
            raise ValueError(f"kubeconfig {path} has no current-context (pass --context)")
        ctx = named("contexts", context_name)
        cluster = named("clusters", ctx.get("cluster", ""))
        user = named("users", ctx["user"]) if ctx.get("user") else {}
        tmp = tempfile.TemporaryDirectory(prefix="meshfn-kube-")

        def material(file_key: str, data_key: str, source: Obj) -> str | None:
            if source.get(data_key):
                target = Path(tmp.name) / data_key
                target.write_bytes(base64.b64decode(source[data_key]))
                target.chmod(0o600)
                return str(target)
            value = source.get(file_key)
            if value:
                return str((path.parent / value).resolve())
            return None

        exec_spec = user.get("exec") or {}
        token_file = user.get("tokenFile")
        return cls(
            server=str(cluster.get("server", "")).rstrip("/"),
            token=user.get("token"),
            token_file=Path(token_file) if token_file else None,
            ca_file=material("certificate-authority", "certificate-authority-data", cluster),
            cert_file=material("client-certificate", "client-certificate-data", user),
            key_file=material("client-key", "client-key-data", user),
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
            exec_command=[exec_spec["command"], *exec_spec.get("args", [])]
            if exec_spec.get("command")
            else None,
            exec_env={e["name"]: e["value"] for e in exec_spec.get("env") or []},
            namespace=ctx.get("namespace") or "default",
            _tmp=tmp,
        )

    @classmethod
    def load(cls, kubeconfig: Path | None = None, context: str | None = None) -> KubeConfig:
        """--kubeconfig, else $KUBECONFIG, else the pod's service account, else ~/.kube/config."""
        if kubeconfig is not None:
            return cls.from_file(kubeconfig, context)
        if kubeconfigs := env.KUBECONFIG.get():
            return cls.from_file(Path(kubeconfigs.split(os.pathsep)[0]), context)
        if env.KUBERNETES_SERVICE_HOST.get():
            return cls.in_cluster()
        return cls.from_file(Path.home() / ".kube" / "config", context)

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.cert_file and self.key_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


# ---------------------------------------------------------------- client


class KubeClient:
    """One connection pool to one apiserver. Use as `async with KubeClient(config) as kube:`."""

    def __init__(self, config: KubeConfig, user_agent: str = "meshfn") -> None:
        self.config = config
        self.user_agent = user_agent
        self._session: aiohttp.ClientSession | None = None
        self._token: tuple[str, float] | None = None  # value, expiry (monotonic)
        self.requests = 0  # every request sent (tests and metrics read these)
        self.writes = 0  # POST/PUT/PATCH/DELETE sent

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self.config.ssl_context(), limit=16)
            self._session = aiohttp.ClientSession(
                base_url=self.config.server,
                connector=connector,
                headers={"User-Agent": self.user_agent},
                json_serialize=lambda o: json.dumps(o, separators=(",", ":")),
            )
        return self._session

    async def _bearer(self) -> str | None:
        config = self.config
        if config.token:
            return config.token
        now = time.monotonic()
        if self._token is not None and now < self._token[1]:
            return self._token[0]
        if config.token_file is not None:
            # Projected service-account tokens are rotated on disk: re-read once a minute.
            token = (await asyncio.to_thread(config.token_file.read_text)).strip()
            self._token = (token, now + 60)
            return token
        if config.exec_command:
            token, lifetime = await self._exec_credential()
            self._token = (token, now + lifetime)
            return token
        return None

    async def _exec_credential(self) -> tuple[str, float]:
        command = self.config.exec_command or []
        process = await asyncio.create_subprocess_exec(
            *command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **self.config.exec_env},
        )
        stdout, stderr = await process.communicate()
        if process.returncode != 0:
            raise Unreachable(
                f"credential plugin {command[0]} failed: {stderr.decode(errors='replace')[:300]}"
            )
        status = json.loads(stdout).get("status") or {}
        if not status.get("token"):
            raise Unreachable(f"credential plugin {command[0]} returned no token")
        return str(status["token"]), 300.0

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Obj | None = None,
        content_type: str = "application/json",
        timeout: float = REQUEST_SECONDS,
    ) -> Obj:
        headers = {"Accept": "application/json"}
        bearer = await self._bearer()
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body, separators=(",", ":"))
        self.requests += 1
        if method != "GET":
            self.writes += 1
        try:
            async with self._http().request(
                method,
                path,
                params=params,
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                text = await response.text()
                payload: Obj | str
                try:
                    payload = json.loads(text) if text else {}
                except ValueError:
                    payload = text
                if response.status >= 400:
                    raise ApiError(response.status, payload, method, path)
                return payload if isinstance(payload, dict) else {}
        except (aiohttp.ClientConnectionError, TimeoutError, ssl.SSLError) as exc:
            raise Unreachable(
                f"{method} {self.config.server}{path}: {exc or type(exc).__name__}"
            ) from exc

    # ------------------------------------------------------------ verbs

    async def get(self, res: Resource, name: str, namespace: str | None = None) -> Obj:
        return await self.request("GET", res.path(namespace, name))

    async def get_or_none(
        self, res: Resource, name: str, namespace: str | None = None
    ) -> Obj | None:
        try:
            return await self.get(res, name, namespace)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self,
        res: Resource,
        namespace: str | None = None,
        label_selector: str | None = None,
        page: int = 500,
    ) -> tuple[list[Obj], str]:
        """Every object (paginated), and the list's resourceVersion to watch from."""
        items: list[Obj] = []
        params = {"limit": str(page)}
        if label_selector:
            params["labelSelector"] = label_selector
        while True:
            document = await self.request("GET", res.path(namespace), params=params)
            for item in document.get("items") or []:
                item.setdefault("apiVersion", res.api_version)
                item.setdefault("kind", res.kind)
                items.append(item)
            metadata = document.get("metadata") or {}
            token = metadata.get("continue")
            if not token:
                return items, str(metadata.get("resourceVersion", ""))
            params["continue"] = token

    async def watch(
        self,
        res: Resource,
        resource_version: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        timeout_seconds: int = WATCH_SECONDS,
    ) -> AsyncIterator[WatchEvent]:
        """Events after `resource_version` until the server ends the watch. Bookmarks are
        asked for, so an idle watch still advances the version to resume from. A 410 (the
        version was compacted away) arrives as an ApiError with status 410."""
        params = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
        }
        if label_selector:
            params["labelSelector"] = label_selector
        headers = {"Accept": "application/json"}
        bearer = await self._bearer()
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        self.requests += 1
        path = res.path(namespace)
        try:
            async with self._http().get(
                path,
                params=params,
                headers=headers,
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=REQUEST_SECONDS, sock_read=timeout_seconds + 30
                ),
            ) as response:
                if response.status >= 400:
                    text = await response.text()
                    try:
                        payload: Obj | str = json.loads(text)
                    except ValueError:
                        payload = text
                    raise ApiError(response.status, payload, "WATCH", path)
                buffer = b""
                # Not readline(): aiohttp caps a line at 64 KiB, a custom resource may be 1.5 MB.
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        if event.get("type") == "ERROR":
                            status = event.get("object") or {}
                            raise ApiError(int(status.get("code", 500)), status, "WATCH", path)
                        yield WatchEvent(event["type"], event.get("object") or {})
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise Unreachable(
                f"WATCH {self.config.server}{path}: {exc or type(exc).__name__}"
            ) from exc

    async def apply(
        self,
        res: Resource,
        obj: Obj,
        field_manager: str,
        force: bool = False,
        dry_run: bool = False,
        status: bool = False,
    ) -> Obj:
        """Server-side apply: `obj` is the whole intent of `field_manager`; fields it no longer
        names are removed if only it owned them. A 409 means another manager owns a field."""
        metadata = obj["metadata"]
        params = {"fieldManager": field_manager}
        if force:
            params["force"] = "true"
        if dry_run:
            params["dryRun"] = "All"
        path = res.path(metadata.get("namespace"), metadata["name"], "status" if status else "")
        return await self.request(
            "PATCH", path, params=params, body=obj, content_type="application/apply-patch+yaml"
        )

    async def patch(
        self,
        res: Resource,
        name: str,
        body: Obj,
        namespace: str | None = None,
        sub: str = "",
        patch_type: Literal["merge", "json"] = "merge",
    ) -> Obj:
        content = {
            "merge": "application/merge-patch+json",
            "json": "application/json-patch+json",
        }[patch_type]
        return await self.request(
            "PATCH", res.path(namespace, name, sub), body=body, content_type=content
        )

    async def create(
        self, res: Resource, obj: Obj, namespace: str | None = None, dry_run: bool = False
    ) -> Obj:
        params = {"dryRun": "All"} if dry_run else None
        ns = namespace or obj.get("metadata", {}).get("namespace")
        return await self.request("POST", res.path(ns), params=params, body=obj)

    async def replace(self, res: Resource, obj: Obj) -> Obj:
        """PUT: fails with 409 when metadata.resourceVersion is not the stored one."""
        metadata = obj["metadata"]
        return await self.request(
            "PUT", res.path(metadata.get("namespace"), metadata["name"]), body=obj
        )

    async def delete(self, res: Resource, name: str, namespace: str | None = None) -> None:
        try:
            await self.request(
                "DELETE",
                res.path(namespace, name),
                body={
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "propagationPolicy": "Background",
                },
            )
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def has_api(self, group_version: str) -> bool:
        """Whether the apiserver serves `group/version` (e.g. keda.sh/v1alpha1)."""
        try:
            await self.request("GET", f"/apis/{group_version}")
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True


class Backoff:
    """Exponential backoff with jitter (0.5 s doubling to 30 s): how every meshfn loop retries
    an apiserver that is down or slow, without a thundering herd when it comes back."""

    def __init__(self, first: float = 0.5, cap: float = 30.0) -> None:
        self.first = first
        self.cap = cap
        self.attempt = 0

    def next(self) -> float:
        delay = min(self.cap, self.first * 2.0**self.attempt)
        self.attempt += 1
        return float(delay * (0.5 + random.random() / 2))

    def reset(self) -> None:
        self.attempt = 0
