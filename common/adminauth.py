"""Who may use the control plane's admin port and its web console: every request names a
principal, and the principal's role decides what it may see.

Roles, in ascending order (a role may do everything the ones before it may):
- `viewer`: topology, proxies, breakers, functions, metrics, status, configuration dumps;
- `auditor`: also the audit trail's records, queries by subject, export and erasure (the
  personal data; every such read is itself an audit record, see meshfn.audit.access).

Credentials:
- **Admin tokens** (embedded mode): JWTs (HS256) signed with a key in the state directory
  (`STATE/admin/token.key`, 0600), audience `meshfn-admin`, naming a principal, a role and an
  expiry. `meshfn up` and `meshfn serve` write the owner's token (auditor) to
  `STATE/admin/token` (0600) at every start: the CLI (`meshfn status`, `meshfn console`...)
  reads it there, and `read_owner_token` / `admin_headers` are how tests and scripts get it.
  Revoking: a new key (delete `token.key`, restart) ends every token and session at once.
  `meshfn admin token` mints more (a viewer for a colleague). A separate key and
  audience from the mesh's own JWT issuer: a token that calls a model is never an admin token.
- **Console sessions**: the same key, audience `meshfn-console`, in an HttpOnly, SameSite=Strict
  cookie set by the login form or a one-time login link (control_plane/runtime/console).
- **A fixed token** (`--admin-token-file`, `$MESHFN_ADMIN_TOKEN` on the server side): the
  auditor role, for deployments that keep a secret elsewhere; compared in constant time.
- **Kubernetes** (`meshfn kube run`): the caller's own bearer token, authenticated by the
  apiserver (TokenReview) and authorized by it (SubjectAccessReview on the virtual resources
  `console` and `auditrecords` of group meshfn.io, verb `get`), so the cluster's RBAC decides
  (as Kiali's token strategy does). Decisions are cached for 30 s; while the apiserver cannot
  be reached, a principal it admitted within the last 5 minutes stays admitted (the operator's
  status, which says the apiserver is down, stays readable), and nobody else gets in.

Failures: a missing, malformed, wrong or expired credential is the same 401 (no detail
about which), answered no sooner than `FAILURE_FLOOR_S` after the request arrived, whatever the
check cost; an authenticated principal without the role an endpoint needs gets a 403.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import getpass
import hashlib
import hmac
import json
import os
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import jwt
from aiohttp import web

from meshfn.common.files import read_private, secret_key, write_private

VIEWER = "viewer"
AUDITOR = "auditor"
ROLES = (VIEWER, AUDITOR)  # ascending: a role may do everything the ones before it may
ADMIN_AUDIENCE = "meshfn-admin"
SESSION_AUDIENCE = "meshfn-console"
ISSUER = "meshfn-control-plane"
OWNER_TOKEN_TTL = timedelta(days=30)
SESSION_TTL = timedelta(hours=12)
# Every refused request is answered this long after it arrived (at least): the answer's timing
# says nothing about why (no token, a wrong one, an expired one), and guessing is slow.
FAILURE_FLOOR_S = 0.05
_NAME_MAX = 256


class AuthError(ValueError):
    """A token cannot be issued as asked (unknown role, bad name, bad lifetime)."""


def role_allows(have: str | None, need: str) -> bool:
    return have in ROLES and ROLES.index(have) >= ROLES.index(need)


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. `role` None: authenticated, but granted nothing (Kubernetes
    RBAC gave the user neither role): every guarded endpoint answers 403."""

    name: str  # "local:alice", "alice", "kube:system:serviceaccount:ops:grafana"
    role: str | None
    via: str  # "token" | "session" | "fixed-token" | "kubernetes"

    def may(self, role: str) -> bool:
        return role_allows(self.role, role)


# Where the guard leaves the authenticated caller on the request.
PRINCIPAL = web.RequestKey("meshfn.principal", Principal)


# ------------------------------------------------------------------ where embedded mode keeps it


def admin_dir(state_dir: Path) -> Path:
    return state_dir / "admin"


def key_path(state_dir: Path) -> Path:
    return admin_dir(state_dir) / "token.key"


def owner_token_path(state_dir: Path) -> Path:
    return admin_dir(state_dir) / "token"


def local_principal() -> str:
    """The owner of the state directory, as access records name it."""
    try:
        return f"local:{getpass.getuser()}"
    except (KeyError, OSError):  # a uid without a passwd entry (containers)
        return f"local:uid{os.getuid()}"


def read_owner_token(state_dir: Path) -> str | None:
    """The owner's admin token (auditor) that `meshfn up` / `meshfn serve` wrote into this state
    directory, or None if there is none yet. What the CLI sends, and what a test uses to reach
    a running control plane's admin port."""
    path = owner_token_path(state_dir)
    if not path.exists():
        return None
    return read_private(path).decode("ascii", "replace").strip() or None


def admin_headers(state_dir: Path) -> dict[str, str]:
    """`{"Authorization": "Bearer <owner token>"}` for a request to the admin port of the
    control plane that runs with `state_dir` (FileNotFoundError if it has not started yet)."""
    token = read_owner_token(state_dir)
    if token is None:
        raise FileNotFoundError(
            f"no admin token in {owner_token_path(state_dir)} (has the control plane started?)"
        )
    return {"Authorization": f"Bearer {token}"}


def state_file(state_dir: Path) -> Path:
    """What a running `meshfn up` writes: its pid, admin URL, xds address, children."""
    return state_dir / "state.json"


def running_admin_url(state_dir: Path) -> str | None:
    """The admin URL of the control plane that runs with `state_dir` now (its state.json
    names it, and that pid is alive), else None."""
    try:
        data = json.loads(state_file(state_dir).read_text())
    except (OSError, ValueError):
        return None
    pid, url = data.get("pid"), data.get("admin")
    if not isinstance(pid, int) or not isinstance(url, str):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return url.rstrip("/")


class AdminCallError(RuntimeError):
    """The admin port refused or could not be reached (`status` 0: unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def call_admin(
    url: str,
    token: str | None,
    method: str = "GET",
    body: dict[str, Any] | None = None,
    timeout: float = 30.0,
) -> Any:
    """One JSON request to a control plane's admin port, with the bearer token."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = str(json.loads(exc.read()).get("error", exc.reason))
        except ValueError:
            detail = str(exc.reason)
        raise AdminCallError(exc.code, detail) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AdminCallError(0, f"cannot reach the control plane at {url}: {reason}") from None


# ------------------------------------------------------------------ signed tokens


class AdminTokens:
    """Admin tokens and console sessions: HS256 JWTs under one key (created on first use)."""

    def __init__(self, key_file: Path) -> None:
        self.key_file = key_file
        try:
            self._key = secret_key(key_file)
        except ValueError as exc:
            raise AuthError(str(exc)) from None

    def issue(
        self,
        name: str,
        role: str,
        ttl: timedelta,
        audience: str = ADMIN_AUDIENCE,
        now: float | None = None,
    ) -> str:
        if role not in ROLES:
            raise AuthError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        if not name or len(name) > _NAME_MAX or not name.isprintable():
            raise AuthError(f"a principal's name is 1-{_NAME_MAX} printable characters")
        seconds = ttl.total_seconds()
        if not 0 < seconds <= 366 * 86400:
            raise AuthError("a token lives more than 0 s and at most 366 days")
        issued = int(time.time() if now is None else now)
        claims = {
            "iss": ISSUER,
            "aud": audience,
            "sub": name,
            "role": role,
            "iat": issued,
            "exp": issued + int(seconds),
            "jti": secrets.token_hex(8),
        }
        return jwt.encode(claims, self._key, algorithm="HS256")

    def verify(self, token: str, audience: str = ADMIN_AUDIENCE) -> Principal | None:
        """The principal a token names, or None (whatever the reason: never says which)."""
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=["HS256"],
                audience=audience,
                issuer=ISSUER,
                options={"require": ["exp", "iat", "sub", "aud", "iss"]},
                leeway=0,
            )
        except jwt.PyJWTError:
            return None
        role, name = claims.get("role"), claims.get("sub")
        if role not in ROLES or not isinstance(name, str) or not name:
            return None
        return Principal(name, role, "session" if audience == SESSION_AUDIENCE else "token")


def ensure_owner_token(state_dir: Path, ttl: timedelta = OWNER_TOKEN_TTL) -> str:
    """Issue the owner's token (auditor, `local:<user>`) into STATE/admin/token (0600): at
    every start of a control plane, so the file always holds a live token."""
    token = AdminTokens(key_path(state_dir)).issue(local_principal(), AUDITOR, ttl)
    write_private(owner_token_path(state_dir), (token + "\n").encode())
    return token


# ------------------------------------------------------------------ authenticators


class Authenticator(Protocol):
    async def authenticate(self, token: str) -> Principal | None: ...


@dataclass
class LocalAuthenticator:
    """Embedded mode: the state directory's admin tokens, and an optional fixed token."""

    tokens: AdminTokens
    fixed: str | None = None

    async def authenticate(self, token: str) -> Principal | None:
        if self.fixed is not None:
            fixed = hmac.compare_digest(token.encode(), self.fixed.encode())
            if fixed:
                return Principal("fixed-token", AUDITOR, "fixed-token")
        return self.tokens.verify(token)


# The virtual resources RBAC grants the roles on (`meshfn.io`, verb `get`): a ClusterRole rule
# `{apiGroups: [meshfn.io], resources: [console], verbs: [get]}` makes a viewer.
KUBE_GROUP = "meshfn.io"
KUBE_RESOURCES = {VIEWER: "console", AUDITOR: "auditrecords"}
KUBE_CACHE_S = 30.0
KUBE_STALE_S = 300.0  # how long an admitted principal stays admitted while the apiserver is down
KubeCreate = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass
class KubeAuthenticator:
    """Kubernetes mode: TokenReview, then SubjectAccessReview for each role (highest first).
    `create(path, body)` POSTs to the apiserver as the control plane (its ServiceAccount needs
    `create` on tokenreviews and subjectaccessreviews: the chart's system:auth-delegator
    binding). `namespace`: where the control plane runs (the reviews ask about it)."""

    create: KubeCreate
    namespace: str
    cache_s: float = KUBE_CACHE_S
    stale_s: float = KUBE_STALE_S
    _cache: dict[bytes, tuple[float, Principal]] = field(default_factory=dict)

    async def authenticate(self, token: str) -> Principal | None:
        if not token or len(token) > 16384:
            return None
        key = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        try:
            principal = await self._review(token)
        except Exception:  # unreachable, or refusing us: only whom it admitted lately
            if cached is not None and now - cached[0] < self.stale_s:
                return cached[1]
            return None
        if len(self._cache) > 1024:
            self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.stale_s}
        if principal is not None:
            self._cache[key] = (now, principal)
        else:
            self._cache.pop(key, None)
        return principal

    async def _review(self, token: str) -> Principal | None:
        review = await self.create(
            "/apis/authentication.k8s.io/v1/tokenreviews",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token},
            },
        )
        status = review.get("status") or {}
        user = status.get("user") or {}
        if not status.get("authenticated") or not user.get("username"):
            return None
        spec: dict[str, Any] = {"user": user["username"], "groups": user.get("groups") or []}
        if user.get("uid"):
            spec["uid"] = user["uid"]
        if user.get("extra"):
            spec["extra"] = user["extra"]
        name = f"kube:{user['username']}"
        for role in reversed(ROLES):
            answer = await self.create(
                "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                {
                    "apiVersion": "authorization.k8s.io/v1",
                    "kind": "SubjectAccessReview",
                    "spec": {
                        **spec,
                        "resourceAttributes": {
                            "group": KUBE_GROUP,
                            "resource": KUBE_RESOURCES[role],
                            "verb": "get",
                            "namespace": self.namespace,
                        },
                    },
                },
            )
            if (answer.get("status") or {}).get("allowed"):
                return Principal(name, role, "kubernetes")
        return Principal(name, None, "kubernetes")


# ------------------------------------------------------------------ lookups per principal


@dataclass
class LookupLimiter:
    """A token bucket per principal for lookups of personal data (queries by subject, erasures):
    `burst` at once, then one every `60 / per_minute` seconds."""

    burst: int = 10
    per_minute: float = 10.0
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)

    def take(self, principal: str, now: float | None = None) -> float:
        """0.0 if the lookup may go ahead (and it is counted), else the seconds to wait."""
        now = time.monotonic() if now is None else now
        tokens, at = self._buckets.get(principal, (float(self.burst), now))
        rate = self.per_minute / 60.0
        tokens = min(float(self.burst), tokens + (now - at) * rate)
        if tokens >= 1.0:
            self._buckets[principal] = (tokens - 1.0, now)
            return 0.0
        self._buckets[principal] = (tokens, now)
        return (1.0 - tokens) / rate


# ------------------------------------------------------------------ the HTTP guard


Refusal = Callable[[web.Request, int], web.StreamResponse]


def _plain_refusal(_: web.Request, status: int) -> web.StreamResponse:
    text = "authentication required" if status == 401 else "your role does not allow this"
    return web.json_response({"error": text}, status=status)


@dataclass
class Guard:
    """What the admin middleware needs: who authenticates bearer tokens, which requests are
    open, optional console sessions (the cookie `cookie` holding a session token), and how a
    refusal looks (`refusal(request, 401 | 403)`: JSON by default; the console's login page)."""

    authenticator: Authenticator
    is_open: Callable[[web.Request], bool]
    sessions: AdminTokens | None = None
    cookie: str = "meshfn_console"
    refusal: Refusal = _plain_refusal
    floor_s: float = FAILURE_FLOOR_S

    async def principal(self, request: web.Request) -> Principal | None:
        header = request.headers.get("Authorization", "")
        if header:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return None
            return await self.authenticator.authenticate(token.strip())
        if self.sessions is not None:
            session = request.cookies.get(self.cookie, "")
            if session:
                return self.sessions.verify(session, SESSION_AUDIENCE)
        return None


def guard_middleware(guard: Guard) -> Any:
    """Every request but the open ones must name a principal with a role (401 / 403 otherwise);
    the handler finds it at `request[PRINCIPAL]` and asks for more with `require`."""

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if guard.is_open(request):
            return await handler(request)
        started = time.monotonic()
        principal = await guard.principal(request)
        if principal is None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(max(0.0, guard.floor_s - (time.monotonic() - started)))
            response = guard.refusal(request, 401)
            response.headers["WWW-Authenticate"] = 'Bearer realm="meshfn"'
            return response
        if principal.role is None:
            return guard.refusal(request, 403)
        request[PRINCIPAL] = principal
        try:
            return await handler(request)
        except Forbidden:
            return guard.refusal(request, 403)

    return middleware


class Forbidden(Exception):
    """Raised by `require`: the guard answers 403 (the caller is known, the role too low)."""


def principal_of(request: web.Request) -> Principal:
    found = request.get(PRINCIPAL)
    if not isinstance(found, Principal):
        raise Forbidden("no principal")
    return found


def require(request: web.Request, role: str) -> Principal:
    """The caller, if its role allows `role`; else Forbidden (a 403 from the guard)."""
    principal = principal_of(request)
    if not principal.may(role):
        raise Forbidden(role)
    return principal


# ------------------------------------------------------------------ one-time login links


@dataclass
class LoginLinks:
    """One-time codes for the console's login link (`/ui/login?code=...`), as Jupyter prints
    one: held in memory (a restart forgets them), each good for one session, for `ttl_s`."""

    ttl_s: float = 12 * 3600.0
    most: int = 64  # outstanding at once; the oldest go first
    _codes: dict[str, tuple[float, Principal]] = field(default_factory=dict)

    def mint(self, principal: Principal, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        self._codes = {c: v for c, v in self._codes.items() if now - v[0] < self.ttl_s}
        while len(self._codes) >= self.most:
            del self._codes[next(iter(self._codes))]
        code = base64.urlsafe_b64encode(secrets.token_bytes(24)).decode().rstrip("=")
        self._codes[code] = (now, principal)
        return code

    def redeem(self, code: str, now: float | None = None) -> Principal | None:
        now = time.monotonic() if now is None else now
        found = self._codes.pop(code, None) if code else None
        if found is None or now - found[0] >= self.ttl_s:
            return None
        return found[1]
