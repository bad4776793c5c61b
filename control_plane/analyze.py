"""`meshfn analyze`: findings about a policy set that loads but is unsafe or will not work as
meant, after `istioctl analyze`: each finding has a code from a fixed catalogue, a severity,
where it is (the policy's file:line, or the file in the state directory) and the fix.

It reads the loaded policies (with their source lines), the state directory (key files, CA
certificates) and, when given, the running control plane's drift-breaker status (how much
traffic a route really sees). It changes nothing.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from cryptography import x509

from meshfn.ir import MeshModel
from meshfn.policy.model import (
    AuthorizationPolicy,
    Condition,
    FallbackPolicy,
    Gateway,
    Mesh,
    Operation,
    PeerAuthentication,
    RequestAuthentication,
    Route,
    Rule,
    Service,
    Source,
)
from meshfn.policy.validate import Loaded

T = TypeVar("T")
Severity = Literal["Error", "Warning", "Info"]
SEVERITIES: tuple[Severity, ...] = ("Error", "Warning", "Info")
EXPIRY_WARNING = dt.timedelta(days=30)

# code -> (severity, what it means): docs/reference/analyze/ has a page per code, generated from
# this catalogue and docs/gen/analyze.yaml (the explanations and examples).
CATALOGUE: dict[str, tuple[Severity, str]] = {
    "MF0101": ("Error", "mTLS DISABLE: plaintext between proxies"),
    "MF0102": ("Warning", "mTLS PERMISSIVE: plaintext accepted beside mTLS"),
    "MF0103": ("Warning", "a service with sidecars and no ALLOW policy: every mTLS caller allowed"),
    "MF0104": ("Warning", "an ALLOW rule that a DENY rule shadows: it can never grant anything"),
    "MF0105": ("Warning", "a JWT rule without audiences: tokens minted for any audience accepted"),
    "MF0106": ("Warning", "a JWT rule that accepts tokens without exp"),
    "MF0107": ("Error", "a key file readable or writable by group or others"),
    "MF0108": ("Error", "a CA or certificate that has expired"),
    "MF0109": ("Warning", "a CA or certificate that expires soon"),
    "MF0201": ("Error", "a fallback chain with no tier that has an endpoint"),
    "MF0202": (
        "Warning",
        "a drift breaker whose route gets fewer samples per window than minSamples",
    ),
    "MF0203": ("Info", "a drift breaker not checked against traffic (no running control plane)"),
    "MF0204": ("Warning", "retries without a per-try timeout"),
}


@dataclass(frozen=True)
class Finding:
    code: str
    severity: Severity
    where: str  # file:line of the policy (or the path of a file in the state directory)
    resource: str  # e.g. "PeerAuthentication default/plaintext"
    message: str
    fix: str

    def line(self) -> str:
        return f"{self.severity} [{self.code}] ({self.resource} {self.where}) {self.message} Fix: {self.fix}"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def _finding(code: str, where: str, resource: str, message: str, fix: str) -> Finding:
    return Finding(code, CATALOGUE[code][0], where, resource, message, fix)


def _at(item: Loaded, *loc: str | int) -> str:
    return f"{item.doc.file}:{item.doc.line_of(tuple(loc))}"


def _name(item: Loaded) -> str:
    meta = item.obj.metadata
    namespace = getattr(meta, "namespace", None)
    return (
        f"{item.obj.kind} {namespace}/{meta.name}" if namespace else f"{item.obj.kind} {meta.name}"
    )


def analyze(
    items: list[Loaded],
    model: MeshModel,
    state_dir: Path | None = None,
    drift_status: dict[str, Any] | None = None,
    now: dt.datetime | None = None,
) -> list[Finding]:
    """Every finding, most severe first, then by place."""
    now = now or dt.datetime.now(dt.UTC)
    checks: list[Iterable[Finding]] = [
        _mtls(items),
        _no_allow(items),
        _shadowed(items),
        _jwt(items),
        _fallback(items),
        _drift(items, drift_status),
        _retries(items),
    ]
    if state_dir is not None and state_dir.is_dir():
        checks += [_key_files(state_dir), _certificates(state_dir, now)]
    del model  # the checks read the policies themselves: they need their source lines
    findings = [f for check in checks for f in check]
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), f.where, f.code))


def _of(items: list[Loaded], kind: type[T]) -> Iterator[tuple[Loaded, T]]:
    """The items of one kind, each with its object typed as that kind."""
    return ((i, i.obj) for i in items if isinstance(i.obj, kind))


# ---------------------------------------------------------------------- security


def _mtls(items: list[Loaded]) -> Iterator[Finding]:
    def one(item: Loaded, mode: str, loc: tuple[str, ...], scope: str) -> Iterator[Finding]:
        if mode == "DISABLE":
            yield _finding(
                "MF0101", _at(item, *loc), _name(item),
                f"mTLS is DISABLE for {scope}: requests reach it in plaintext, without a caller "
                "identity for authorization to check.",
                "set mode: STRICT (meshfn's default), or PERMISSIVE only while migrating clients",
            )  # fmt: skip
        elif mode == "PERMISSIVE":
            yield _finding(
                "MF0102", _at(item, *loc), _name(item),
                f"mTLS is PERMISSIVE for {scope}: plaintext requests are accepted too.",
                "set mode: STRICT once every caller goes through the mesh",
            )  # fmt: skip

    for item, mesh in _of(items, Mesh):
        yield from one(item, mesh.spec.mtls.mode, ("spec", "mtls", "mode"), "the whole mesh")
    for item, peer in _of(items, PeerAuthentication):
        spec = peer.spec
        scope = (
            f"service {spec.selector.service}"
            if spec.selector and spec.selector.service
            else f"namespace {peer.metadata.namespace}"
        )
        if spec.mtls is not None:
            yield from one(item, spec.mtls.mode, ("spec", "mtls", "mode"), scope)
        for port, setting in sorted(spec.portLevelMtls.items()):
            loc = ("spec", "portLevelMtls", port, "mode")
            yield from one(item, setting.mode, loc, f"{scope} port {port}")


def _applies(policy: AuthorizationPolicy, kind: str, namespace: str, name: str) -> bool:
    """Whether an AuthorizationPolicy applies to the workload (Istio: no selector = every
    workload of the policy's namespace)."""
    if policy.metadata.namespace != namespace:
        return False
    selector = policy.spec.selector
    if selector is None:
        return True
    return bool(getattr(selector, kind) == name)


def _workloads(items: list[Loaded]) -> Iterator[tuple[Loaded, str, str, str]]:
    """(item, kind, namespace, name) of services with sidecars and of gateways: what
    authorization policies apply to."""
    for item, service in _of(items, Service):
        if any(e.sidecar is not None for e in service.spec.endpoints):
            yield item, "service", service.metadata.namespace, service.metadata.name
    for item, gateway in _of(items, Gateway):
        yield item, "gateway", gateway.metadata.namespace, gateway.metadata.name


def _no_allow(items: list[Loaded]) -> Iterator[Finding]:
    policies = [obj for _, obj in _of(items, AuthorizationPolicy)]
    for item, kind, namespace, name in _workloads(items):
        if kind != "service":
            continue
        if not any(
            p.spec.action == "ALLOW" and _applies(p, "service", namespace, name) for p in policies
        ):
            yield _finding(
                "MF0103", _at(item, "metadata", "name"), _name(item),
                "its sidecars authenticate callers (mTLS) but no ALLOW policy selects it, so "
                "every workload of the mesh may call it.",
                f"add an AuthorizationPolicy (action: ALLOW, selector: {{service: {name}}}) "
                "naming the principals that may call it",
            )  # fmt: skip


def _pattern_covers(wide: str, narrow: str) -> bool:
    """Istio path/host patterns (exact, `prefix*`, `*suffix`, `*`): does `wide` match every
    value `narrow` matches?"""
    if wide in ("*", narrow):
        return True
    if "*" not in narrow:
        return fnmatch.fnmatchcase(narrow, wide)
    if wide.endswith("*") and narrow.endswith("*"):
        return narrow.startswith(wide[:-1])
    if wide.startswith("*") and narrow.startswith("*"):
        return narrow.endswith(wide[1:])
    return False


def _values_cover(wide: Sequence[str], narrow: Sequence[str], patterns: bool = False) -> bool:
    """A constraint `wide` (empty: none) holds for everything constraint `narrow` admits."""
    if not wide:
        return True
    if not narrow:
        return False
    if patterns:
        return all(any(_pattern_covers(w, n) for w in wide) for n in narrow)
    return "*" in wide or set(narrow) <= set(wide)


def _source_covers(d: Source, a: Source) -> bool:
    if d.notPrincipals or d.notNamespaces or d.notRequestPrincipals:
        return False  # conservative: negations are not reasoned about
    return (
        _values_cover(d.principals, a.principals)
        and _values_cover(d.namespaces, a.namespaces, patterns=True)
        and _values_cover(d.requestPrincipals, a.requestPrincipals, patterns=True)
    )


def _operation_covers(d: Operation, a: Operation) -> bool:
    if d.notPaths or d.notMethods:
        return False
    return _values_cover(d.paths, a.paths, patterns=True) and _values_cover(d.methods, a.methods)


def _condition_covered(d: Condition, a_conditions: list[Condition]) -> bool:
    if d.notValues:
        return False
    return any(
        c.key == d.key and not c.notValues and set(c.values) <= set(d.values) for c in a_conditions
    )


def _rule_covers(d: Rule, a: Rule) -> bool:
    """Does DENY rule `d` match every request ALLOW rule `a` matches (so `a` never grants)?"""

    def each(
        wide: list[Any], narrow: list[Any], covers: Callable[[Any, Any], bool], field: str
    ) -> bool:
        if not wide:
            return True
        return bool(narrow) and all(
            any(covers(getattr(w, field), getattr(n, field)) for w in wide) for n in narrow
        )

    return (
        each(d.from_, a.from_, _source_covers, "source")
        and each(d.to, a.to, _operation_covers, "operation")
        and all(_condition_covered(c, a.when) for c in d.when)
    )


def _shadowed(items: list[Loaded]) -> Iterator[Finding]:
    """meshfn evaluates DENY policies first (Istio's order): an ALLOW rule never shadows a DENY
    rule, but a DENY rule that matches every request of an ALLOW rule makes that rule dead, the
    mistake of reading the rules as first-match-wins (as a firewall's)."""
    policies = list(_of(items, AuthorizationPolicy))
    for _, kind, namespace, name in _workloads(items):
        applying = [(i, p) for i, p in policies if _applies(p, kind, namespace, name)]
        denies = [
            (i, d, r) for i, p in applying if p.spec.action == "DENY"
            for d, r in enumerate(p.spec.rules)
        ]  # fmt: skip
        for allow, policy in ((i, p) for i, p in applying if p.spec.action == "ALLOW"):
            for index, rule in enumerate(policy.spec.rules):
                for deny, deny_index, deny_rule in denies:
                    if _rule_covers(deny_rule, rule):
                        yield _finding(
                            "MF0104", _at(allow, "spec", "rules", index), _name(allow),
                            f"rule {index} (for {kind} {name}) never allows anything: "
                            f"DENY rule {deny_index} of {_name(deny)} "
                            f"({_at(deny, 'spec', 'rules', deny_index)}) matches every request "
                            "it matches, and DENY is evaluated first.",
                            "narrow the DENY rule (e.g. add the paths or principals it means), or "
                            "remove the dead ALLOW rule",
                        )  # fmt: skip
                        break


def _jwt(items: list[Loaded]) -> Iterator[Finding]:
    for item, obj in _of(items, RequestAuthentication):
        for index, rule in enumerate(obj.spec.jwtRules):
            if not rule.audiences:
                yield _finding(
                    "MF0105", _at(item, "spec", "jwtRules", index, "issuer"), _name(item),
                    f"JWT rule {index} ({rule.issuer}) has no audiences: a token the issuer "
                    "minted for another service is accepted here too.",
                    "list the audiences meant for this mesh: audiences: [<aud>]",
                )  # fmt: skip
            if not rule.requireExpiration:
                yield _finding(
                    "MF0106", _at(item, "spec", "jwtRules", index, "requireExpiration"),
                    _name(item),
                    f"JWT rule {index} ({rule.issuer}) accepts tokens without exp: a leaked "
                    "token works until the issuer's keys are rotated.",
                    "remove requireExpiration: false once the issuer sets exp (and consider "
                    "maxLifetime)",
                )  # fmt: skip


def _key_files(state_dir: Path) -> Iterator[Finding]:
    """Secrets meshfn writes 0600 (CA and issuer keys, bootstrap-token key, subject salt, audit
    signing keys): any that group or others can read or write."""
    for path in sorted(state_dir.rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        if not (path.suffix in (".key", ".salt") or path.name.endswith("-key.pem")):
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            yield _finding(
                "MF0107", str(path), "key file",
                f"mode {mode:04o}: group or others can read or change a secret of the mesh.",
                f"chmod 600 {path}",
            )  # fmt: skip


def _certificates(state_dir: Path, now: dt.datetime) -> Iterator[Finding]:
    for path in sorted(state_dir.rglob("*")):
        if (
            not path.is_file()
            or path.suffix not in (".crt", ".pem")
            or path.name.endswith("-key.pem")
        ):
            continue
        try:
            certs = x509.load_pem_x509_certificates(path.read_bytes())
        except ValueError:
            continue  # not a certificate
        for cert in certs:
            left = cert.not_valid_after_utc - now
            subject = cert.subject.rfc4514_string() or "(no subject)"
            is_ca = _is_ca(cert)
            what = "CA certificate" if is_ca else "certificate"
            fix = (
                "meshfn ca rotate (then meshfn ca retire once every workload has the new root)"
                if is_ca
                else "re-issue it"
            )
            if left <= dt.timedelta(0):
                yield _finding(
                    "MF0108", str(path), what,
                    f"{subject} expired on {cert.not_valid_after_utc:%Y-%m-%d}.", fix,
                )  # fmt: skip
            elif left < EXPIRY_WARNING:
                yield _finding(
                    "MF0109", str(path), what,
                    f"{subject} expires on {cert.not_valid_after_utc:%Y-%m-%d} "
                    f"(in {left.days} days).", fix,
                )  # fmt: skip


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


# ---------------------------------------------------------------------- reliability


def _fallback(items: list[Loaded]) -> Iterator[Finding]:
    services = {(s.metadata.namespace, s.metadata.name): s for _, s in _of(items, Service)}
    for item, obj in _of(items, FallbackPolicy):
        spec = obj.spec
        if not spec.chain:
            continue
        namespace = obj.metadata.namespace
        tiers = spec.chain[: spec.maxFallbackDepth]
        if not any(
            (svc := services.get((namespace, name))) is not None and svc.spec.endpoints
            for name in tiers
        ):
            yield _finding(
                "MF0201", _at(item, "spec", "chain"), _name(item),
                f"no service of the chain within maxFallbackDepth ({', '.join(tiers)}) has an "
                f"endpoint: when {spec.service} fails, every request gets a 503.",
                "give a fallback service endpoints, or put one that has them in the chain",
            )  # fmt: skip


def _drift(items: list[Loaded], status: dict[str, Any] | None) -> Iterator[Finding]:
    """Whether the breaker can trip: it needs minSamples answers of the route per window. The
    live control plane knows how many a route gets (its samples over the breaker's horizon)."""
    for item, obj in _of(items, FallbackPolicy):
        breaker = obj.spec.driftBreaker
        if breaker is None:
            continue
        namespace, service = obj.metadata.namespace, obj.spec.service
        routes = [
            r for _, r in _of(items, Route)
            if r.metadata.namespace == namespace and r.spec.destination.service == service
        ]  # fmt: skip
        if status is None:
            yield _finding(
                "MF0203", _at(item, "spec", "driftBreaker", "minSamples"), _name(item),
                "traffic not known: no running control plane to read the breaker's samples.",
                "run with the control plane up (meshfn analyze --admin URL) to check minSamples "
                "against real traffic",
            )  # fmt: skip
            continue
        window = breaker.window.total_seconds()
        horizon = max(
            breaker.baselineWindow.total_seconds() + window, breaker.recoverAfter.total_seconds()
        )
        for route in routes:
            key = f"{namespace}/{route.metadata.name}"
            state = status.get(key)
            if state is None:
                continue
            per_window = state.get("samples", 0) * window / horizon
            if per_window < breaker.minSamples:
                yield _finding(
                    "MF0202", _at(item, "spec", "driftBreaker", "minSamples"), _name(item),
                    f"route {key} gets ~{per_window:.0f} answers per {window:g} s window and the "
                    f"breaker needs minSamples {breaker.minSamples}: it can never trip.",
                    f"lower minSamples to at most {max(5, int(per_window))}, or widen window",
                )  # fmt: skip


def _retries(items: list[Loaded]) -> Iterator[Finding]:
    for item, obj in _of(items, Route):
        retries = obj.spec.retries
        if retries is not None and retries.attempts > 0 and retries.perTryTimeout is None:
            timeout = obj.spec.timeout
            yield _finding(
                "MF0204", _at(item, "spec", "retries"), _name(item),
                f"{retries.attempts} retries without perTryTimeout: one hung try uses up the "
                f"whole route timeout ({'none' if timeout is None else timeout}), so no retry "
                "ever runs for a hang.",
                "set retries.perTryTimeout below the route's timeout",
            )  # fmt: skip
