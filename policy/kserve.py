"""A Function's KServe routes: its own /v2/models/{name} paths, and what Functions add to a
gateway beyond those: KServe's server endpoints, the gRPC service, and the guard on Triton's
repository load/unload.

Server endpoints (/v2, health, the model list, Triton's repository index and statistics) and
gRPC (whose ModelInfer names the model inside the message, where Envoy cannot route on it) are
one set per gateway, sent to the backend that serves its functions; they are IR routes like
function routes, so every renderer picks them up. Load/unload are refused by an authorization
policy on the backend's sidecars (or, without sidecars, on the gateway) unless the caller is
one of the Function's `repository.callers`; over gRPC the model name is inside the message, so
those two methods are refused to everyone there (use REST). At a gateway that sheds by priority
each Function's unary gRPC calls (ModelInfer) have a route of their own too, chosen by the
gateway's model router from the model the message names (`grpc_route`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

from meshfn import ir
from meshfn.contracts.plugins import GRPC_MODEL_ROUTED_PATHS, MODEL_HEADER, OPENAI_OPERATIONS
from meshfn.contracts.rollout import SHADOW_PATH
from meshfn.contracts.tracing import SPANS_PATH

from .errors import PolicyError
from .validate import Loaded

GRPC_SERVICE = "/inference.GRPCInferenceService/"
SERVER_PATHS = (
    "/v2",
    "/v2/health/live",
    "/v2/health/ready",
    "/v2/models",
    "/v2/models/stats",
    "/v2/repository/index",
)
# Triton's index is a POST (meshfn up's curl examples follow the route's method).
_METHODS = {"/v2/repository/index": ("POST",)}
REPOSITORY_MODELS = "/v2/repository/models/"
# a backend's endpoints for `meshfn up` alone (inference.server), never for the mesh's callers
PRIVATE_PATHS = (SHADOW_PATH, SPANS_PATH)
GRPC_REPOSITORY = ("RepositoryModelLoad", "RepositoryModelUnload")
# Only retries that cannot repeat an inference: the request never reached the backend.
SAFE_RETRIES = ir.Retry(2, ("connect-failure", "refused-stream", "reset-before-request"))
# Above the function's own deadline, so the backend's 504 (not Envoy's) answers a slow call.
DEADLINE_MARGIN = timedelta(seconds=2)


def call_timeout(settings_timeout: timedelta, queue_delay: timedelta) -> timedelta:
    return settings_timeout + queue_delay + DEADLINE_MARGIN


def _queue_delay(function: ir.Function) -> timedelta:
    batching = function.settings.batching
    return batching.maxQueueDelay if batching is not None else timedelta(0)


def function_timeout(function: ir.Function) -> timedelta:
    """A function's route timeout: above the backend's own deadline, so the backend's answer
    (a 504, or a generation ended at its deadline) comes first. For a generative function that
    is the whole generation's deadline: a route timeout never cuts a healthy stream."""
    generation = function.settings.generation
    if generation is not None:
        return generation.timeout + DEADLINE_MARGIN
    return call_timeout(function.settings.limits.timeout, _queue_delay(function))


def idle_timeout(function: ir.Function) -> timedelta | None:
    """How long a generative function's stream may send nothing before a proxy cuts it (the
    backend sends a keep-alive after half of it); other functions: the proxy's default."""
    generation = function.settings.generation
    return generation.idleTimeout if generation is not None else None


def function_route(function: ir.Function) -> ir.Route | None:
    """KServe v2 REST paths of a function (and its Triton repository load/unload), to its
    backend; None when the function is not served over REST. Only retries that cannot repeat
    an inference (the request never reached the backend) are on."""
    if not function.settings.protocols.rest:
        return None
    base = f"/v2/models/{function.name}"
    return ir.Route(
        name=f"function-{function.name}",
        namespace=function.namespace,
        hosts=("*",),
        matches=(
            ir.RouteMatch(ir.PathMatch("exact", base)),
            ir.RouteMatch(ir.PathMatch("prefix", base + "/")),
            ir.RouteMatch(ir.PathMatch("prefix", f"{REPOSITORY_MODELS}{function.name}/")),
        ),
        service=function.backend,
        timeout=function_timeout(function),
        retries=SAFE_RETRIES,
        function=function.name,
        idle_timeout=idle_timeout(function),
    )


# OpenAI's API under /v1 (and KServe's /openai/v1): the operations name their model in the JSON
# body, so the gateway's model router (part of its meshfn plugin) writes it to MODEL_HEADER and
# these routes, one per model, send the request below that model: /v2/models/{model}/openai/v1/
# ..., the path the backend's sidecars authorise (the same policies as the model's KServe
# paths), where the backend refuses a body naming another model than the path.
OPENAI_MODEL_PATHS = ("/v1/models", "/openai/v1/models")
_OPENAI_ROOT = r"^/(?:openai/)?v1/"
# the model router's paths (contracts.plugins.MODEL_ROUTED_PATHS) as one RE2, matched whole
OPENAI_OPERATIONS_PATH = (
    r"/(?:openai/)?v1/(?:" + "|".join(op.replace("/", r"/") for op in OPENAI_OPERATIONS) + ")"
)


def openai_route(function: ir.Function) -> ir.Route | None:
    """The function's OpenAI operations (chat and text completions, embeddings) on a gateway:
    a POST to one of them whose body names this model. None when it is not served over REST."""
    if not function.settings.protocols.rest:
        return None
    return ir.Route(
        name=f"openai-{function.name}",
        namespace=function.namespace,
        hosts=("*",),
        matches=(
            ir.RouteMatch(
                ir.PathMatch("regex", OPENAI_OPERATIONS_PATH),
                headers=(ir.HeaderMatch(MODEL_HEADER, "exact", function.name),),
                methods=("POST",),
            ),
        ),
        service=function.backend,
        timeout=function_timeout(function),
        retries=SAFE_RETRIES,
        function=function.name,
        idle_timeout=idle_timeout(function),
        rewrite=ir.PathRewrite(_OPENAI_ROOT, f"/v2/models/{function.name}/openai/v1/"),
        model=function.name,
    )


def grpc_route(function: ir.Function, backend: ir.Service) -> ir.Route | None:
    """The function's unary KServe gRPC calls (ModelInfer) at a gateway that sheds its lower
    priorities (QoSPolicy gatewayShedding): the gateway's model router writes the model the
    message names to MODEL_HEADER, so these calls reach the function's own per-priority
    circuit breakers, as its REST routes do, instead of the backend's (the sum over all its
    functions: a burst on one would pass the gateway and be shed by the backend). Every other
    gRPC call keeps the backend's own route (server_routes). None when the function is not
    served over gRPC."""
    if not (function.settings.protocols.grpc and backend.speaks_grpc):
        return None
    return ir.Route(
        name=f"grpc-{function.name}",
        namespace=function.namespace,
        hosts=("*",),
        matches=tuple(
            ir.RouteMatch(
                ir.PathMatch("exact", path),
                headers=(
                    ir.HeaderMatch("content-type", "prefix", "application/grpc"),
                    ir.HeaderMatch(MODEL_HEADER, "exact", function.name),
                ),
            )
            for path in GRPC_MODEL_ROUTED_PATHS
        ),
        service=function.backend,
        timeout=function_timeout(function),
        retries=SAFE_RETRIES,
        grpc=True,
        function=function.name,
        model=function.name,
    )


def gateway_routes(
    gateway: str, hosted: Sequence[tuple[Loaded, ir.Function]], services: Mapping[str, ir.Service]
) -> tuple[ir.Route, ...] | PolicyError:
    """The server routes of Gateway `gateway` (its key) for the Functions it hosts (each with
    its object, where an error points), which must share one backend."""
    first = hosted[0][1]
    for item, function in hosted:
        if function.backend != first.backend:
            return item.error(
                ("spec", "backend"),
                f"the Functions on Gateway {gateway} must share one backend: {first.name} is "
                f"served by {first.backend}, {function.name} by {function.backend}. KServe's "
                "server endpoints (/v2, health, the model list) and gRPC (which names the model "
                "inside the message) reach one backend per gateway; attach this Function to "
                "another Gateway",
            )
    return server_routes([f for _, f in hosted], services[first.backend])


def server_routes(functions: list[ir.Function], backend: ir.Service) -> tuple[ir.Route, ...]:
    """The gateway's KServe server routes (and gRPC, where the backend speaks it) for its
    `functions`, all served by `backend`."""
    routes = [
        ir.Route(
            name="kserve-server",
            namespace=backend.namespace,
            hosts=("*",),
            matches=tuple(
                ir.RouteMatch(ir.PathMatch("exact", path), methods=_METHODS.get(path, ()))
                for path in SERVER_PATHS
            ),
            service=backend.key,
            retries=SAFE_RETRIES,
        )
    ]
    if any(f.settings.protocols.rest for f in functions):  # OpenAI's model list (and one model)
        routes.append(
            ir.Route(
                name="openai-models",
                namespace=backend.namespace,
                hosts=("*",),
                matches=tuple(
                    match
                    for path in OPENAI_MODEL_PATHS
                    for match in (
                        ir.RouteMatch(ir.PathMatch("exact", path), methods=("GET",)),
                        ir.RouteMatch(ir.PathMatch("prefix", path + "/"), methods=("GET",)),
                    )
                ),
                service=backend.key,
                retries=SAFE_RETRIES,
            )
        )
    grpc = [f for f in functions if f.settings.protocols.grpc]
    if grpc and backend.speaks_grpc:
        routes.append(
            ir.Route(
                name="kserve-grpc",
                namespace=backend.namespace,
                hosts=("*",),
                matches=(
                    ir.RouteMatch(
                        ir.PathMatch("prefix", GRPC_SERVICE),
                        headers=(ir.HeaderMatch("content-type", "prefix", "application/grpc"),),
                    ),
                ),
                service=backend.key,
                timeout=max(function_timeout(f) for f in grpc),
                retries=SAFE_RETRIES,
                grpc=True,
            )
        )
    return tuple(routes)


def repository_guards(
    gateways: Mapping[str, list[ir.Function]],
    services: Sequence[ir.Service],
    served: Mapping[str, list[ir.Function]],
) -> tuple[dict[tuple[str, str], ir.AuthzPolicy], tuple[ir.AuthzObject, ...]]:
    """Where the repository guard goes: on the sidecars of every service that serves functions
    (`served`: its functions by service key), and on a gateway (`gateways`: its functions, by
    gateway key) for its functions whose backend has no sidecars. Per ("gateway" | "service",
    key) the policy its proxies add, and the same as objects (gateways first, then services
    with sidecars, each in the order given)."""
    by_key = {s.key: s for s in services}
    guards: dict[tuple[str, str], ir.AuthzPolicy] = {}
    objects = []
    for key, functions in gateways.items():
        unguarded = [f for f in functions if not by_key[f.backend].has_sidecars]
        if unguarded:
            namespace, name = key.split("/")
            guards[("gateway", key)] = repository_guard(namespace, unguarded)
            objects.append(guard_object(namespace, ir.Selector("gateway", name), unguarded))
    for service in services:
        guarded = served.get(service.key)
        if guarded:
            guards[("service", service.key)] = repository_guard(service.namespace, guarded)
            if service.has_sidecars:
                selector = ir.Selector("service", service.name)
                objects.append(guard_object(service.namespace, selector, guarded))
    return guards, tuple(objects)


def guard_object(
    namespace: str, selector: ir.Selector, functions: list[ir.Function]
) -> ir.AuthzObject:
    """The repository guard as a namespace-scoped object (what the Istio renderer writes as an
    AuthorizationPolicy on the same workload the xDS translator puts it on)."""
    guard = repository_guard(namespace, functions)
    return ir.AuthzObject(
        name=f"meshfn-kserve-repository-{selector.name}",
        namespace=namespace,
        selector=selector,
        action="DENY",
        rules=guard.rules,
        derived_from=tuple(sorted({("Function", f.namespace, f.name) for f in functions})),
    )


def repository_guard(namespace: str, functions: list[ir.Function]) -> ir.AuthzPolicy:
    """DENY load/unload to everyone but each function's named callers (nobody by default),
    and the backend's private endpoints to every caller of the mesh: `meshfn up` reads the
    rollouts' shadow comparisons and collects spans on the backend's own socket, and the
    sidecar forwards to that same socket."""
    open_to = [f for f in functions if f.settings.repository.callers]
    everyone = ir.AuthzRule(
        operations=(
            ir.OperationMatch(
                paths=(
                    REPOSITORY_MODELS + "*",
                    *(GRPC_SERVICE + m for m in GRPC_REPOSITORY),
                    *PRIVATE_PATHS,
                ),
                not_paths=tuple(f"{REPOSITORY_MODELS}{f.name}/*" for f in open_to),
            ),
        )
    )
    named = [
        ir.AuthzRule(
            sources=(ir.SourceMatch(not_request_principals=tuple(f.settings.repository.callers)),),
            operations=(ir.OperationMatch(paths=(f"{REPOSITORY_MODELS}{f.name}/*",)),),
        )
        for f in open_to
    ]
    return ir.AuthzPolicy(f"{namespace}/meshfn-kserve-repository", "DENY", (everyone, *named))
