"""KServe v2 gRPC: `inference.GRPCInferenceService` on grpc.aio, beside the REST server.

The messages and the servicer base are the generated stubs tritonclient[grpc] ships
(`tritonclient.grpc.service_pb2`/`service_pb2_grpc`, package `inference`: KServe's v2 protocol
plus Triton's repository and statistics extensions). They were chosen over compiling the
published .proto with grpcio-tools because they are the exact stubs tritonclient's own gRPC
client is generated from (wire compatibility with the reference client by construction), they
carry Triton's extension messages, and they need no build step in an editable install and no
vendored copy of someone else's .proto.

ModelInfer checks a request as strictly as REST does (tensors.py for the data: typed
`contents` element types and ranges, `raw_input_contents` sizes and BYTES framing, exactly one
raw entry per input) and runs through the same Dispatcher. Errors are gRPC statuses with the
KServe message: 400 INVALID_ARGUMENT, 403 PERMISSION_DENIED, 404 NOT_FOUND, 413 (and a message
over the server's limit, refused by gRPC itself) and every QoS refusal (a tenant's concurrency,
compute budget, priority shedding; its Retry-After and x-ratelimit-* as trailers)
RESOURCE_EXHAUSTED, other 429/503 UNAVAILABLE, 504 DEADLINE_EXCEEDED, 500 INTERNAL.
ModelStreamInfer takes the same path per request and answers errors in-stream (Triton's
error_message); ModelConfig is Triton's model configuration extension (kserve.model_config).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from meshfn.common.unix import SOCKET_MODE
from meshfn.contracts.genai import GENERATION_HEADER
from meshfn.contracts.qos import TENANT_HEADER

from . import triton_generate
from .backend import Backend
from .generation import Finished, GenerationError
from .generative import Opened, bounds_of, collect, generation_record
from .kserve import (
    InferRequest,
    Input,
    KServeError,
    Requested,
    Signature,
    bad,
    check_parameters,
    request_timeout,
    select,
    unsupported,
)
from .manifest import TEXT_OUTPUT
from .pool import FunctionRuntime
from .qos import Refusal, tenant_of
from .results import Completed
from .tensors import TensorError, check_raw, dtype, element_count, pack
from .tracing import TraceContext

log = logging.getLogger("meshfn.inference")
T = TypeVar("T")

SERVICE = "inference.GRPCInferenceService"
STREAM_WINDOW = 64  # ModelStreamInfer: requests of one stream in flight or waiting to be sent
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Typed contents field per datatype (FP16 has none: raw_input_contents only).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_ALL_CONTENTS = tuple(sorted(set(_CONTENTS.values())))


def _trace(metadata: Mapping[str, Any]) -> TraceContext:
    """The trace context of a call's metadata (its sidecar forwards the HTTP/2 headers)."""
    return metadata.get("traceparent"), metadata.get("tracestate")


def status_code(status: int) -> grpc.StatusCode:
    return _CODES.get(status, grpc.StatusCode.INTERNAL)


# ---------------------------------------------------------------- parameters


def from_parameters(params: Mapping[str, pb.InferParameter], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        if choice is None:
            raise bad(f"{where}: parameter {key!r} has no value")
        out[key] = getattr(value, choice)
    check_parameters(out, where)
    binary = [k for k in out if k.startswith("binary_data")]
    if binary:
        raise bad(
            f"{where}: binary tensor parameter(s) {', '.join(binary)} are REST's; gRPC carries "
            "raw data in raw_input_contents"
        )
    return out


def set_parameters(target: Any, params: Mapping[str, Any] | None) -> None:
    for key, value in (params or {}).items():
        entry = target[key]
        if isinstance(value, bool):
            entry.bool_param = value
        elif isinstance(value, int):
            if value >= 1 << 63:
                entry.uint64_param = value
            else:
                entry.int64_param = value
        elif isinstance(value, float):
            entry.double_param = value
        else:
            entry.string_param = str(value)


# ---------------------------------------------------------------- ModelInfer


def parse_infer(message: pb.ModelInferRequest, signature: Signature) -> InferRequest:
    params = from_parameters(message.parameters, "request")
    timeout = request_timeout(params)
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise bad(
            f"{len(raw)} raw_input_contents for {len(message.inputs)} inputs (one per input, "
            "in input order)"
        )
    if not message.inputs:
        raise bad("'inputs' must be a non-empty list")
    seen: set[str] = set()
    inputs = []
    for i, tensor in enumerate(message.inputs):
        sig = signature.input_named(tensor.name, seen)
        name, where = sig.name, f"input {sig.name!r}"
        if tensor.datatype != sig.datatype:
            raise bad(f"{where}: datatype {tensor.datatype!r}, expected {sig.datatype}")
        shape = signature.check_shape(name, list(tensor.shape))
        tparams = from_parameters(tensor.parameters, where)
        dt, count = dtype(sig.datatype), element_count(shape)
        given = [f for f in _ALL_CONTENTS if len(getattr(tensor.contents, f))]
        try:
            if raw:
                if given:
                    raise bad(f"{where}: contents given beside raw_input_contents")
                data = raw[i]
                check_raw(data, dt, count)
            else:
                data = _typed_contents(tensor.contents, given, dt.name, count)
        except TensorError as exc:
            raise bad(f"{where}: {exc}") from None
        inputs.append(Input(name, dt, shape, data, tparams))
    signature.check_complete(seen)
    outputs = None
    if message.outputs:
        outputs = [
            Requested(o.name, None, from_parameters(o.parameters, f"output {o.name!r}"))
            for o in message.outputs
        ]
        signature.check_outputs([o.name for o in outputs])
    return InferRequest(message.id or None, inputs, params, outputs, False, timeout)


def _typed_contents(
    contents: pb.InferTensorContents, given: list[str], datatype: str, count: int
) -> bytes:
    field = _CONTENTS.get(datatype)
    if field is None:
        raise TensorError(f"{datatype} data must come in raw_input_contents")
    wrong = [f for f in given if f != field]
    if wrong:
        raise TensorError(f"contents.{wrong[0]} given for {datatype} (use contents.{field})")
    values = list(getattr(contents, field))
    if len(values) != count:
        raise TensorError(f"{len(values)} elements for {count} expected by the shape")
    dt = dtype(datatype)
    if dt.kind == "int" and dt.size < 4:  # carried in 32-bit fields: check the narrow range
        low, high = dt.low, dt.high
        for v in values:
            if not low <= v <= high:
                raise TensorError(f"{v} is out of range for {datatype}")
    return pack(values, dt)


def encode_infer(
    completed: Completed, request: InferRequest, rt: FunctionRuntime
) -> pb.ModelInferResponse:
    outputs, params = completed.parsed(rt.label)
    response = pb.ModelInferResponse(
        model_name=rt.name, model_version=rt.version, id=request.id or ""
    )
    set_parameters(response.parameters, params)
    for out in select(outputs, request.outputs, rt.label):
        tensor = response.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
        set_parameters(tensor.parameters, out.parameters)
        response.raw_output_contents.append(out.raw())
    return response


def _text_response(
    rt: FunctionRuntime, ident: str | None, text: str | None, params: Mapping[str, Any]
) -> pb.ModelInferResponse:
    """A generative model's response: text_output BYTES [1] (none: an empty final response)."""
    response = pb.ModelInferResponse(model_name=rt.name, model_version=rt.version, id=ident or "")
    set_parameters(response.parameters, params)
    if text is not None:
        response.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])
        response.raw_output_contents.append(pack([text], dtype("BYTES")))
    return response


def _stream_text(
    rt: FunctionRuntime, ident: str | None, text: str | None, params: Mapping[str, Any]
) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(infer_response=_text_response(rt, ident, text, params))


def _stream_error(
    rt: FunctionRuntime, ident: str | None, message: str
) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(
            model_name=rt.name, model_version=rt.version, id=ident or ""
        ),
    )


# ---------------------------------------------------------------- the service


class Service(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def _fail(self, context: grpc.aio.ServicerContext[Any, Any], exc: KServeError) -> None:
        if exc.headers:  # a QoS refusal: Retry-After and x-ratelimit-* as trailers
            context.set_trailing_metadata(tuple((k.decode(), v.decode()) for k, v in exc.headers))
        # A QoS refusal is the tenant's quota, not the server being down: RESOURCE_EXHAUSTED, as
        # the gateway's rate limits answer gRPC (UNAVAILABLE would invite transparent retries).
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, Refusal) else None
        await context.abort(code or status_code(exc.status), exc.message)

    async def _answered(
        self, context: grpc.aio.ServicerContext[Any, Any], work: Callable[[], T]
    ) -> T:
        """`work()`, or its KServeError as the call's status (then re-raised)."""
        try:
            return work()
        except KServeError as exc:
            await self._fail(context, exc)
            raise

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Any
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Any
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.backend.ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        return json_format.ParseDict(self.backend.server_metadata(), pb.ServerMetadataResponse())

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Any
    ) -> pb.ModelReadyResponse:
        # An unknown model or version is not ready, not an error: Triton answers so, and a
        # client polling is_model_ready() for a model to appear expects False, not an exception
        try:
            rt = self.backend.lookup(request.name, request.version or None)
        except KServeError as exc:
            if exc.status != 404:
                await self._fail(context, exc)
                raise
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.backend.is_ready(rt))

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Any
    ) -> pb.ModelMetadataResponse:
        meta = await self._answered(
            context, lambda: self.backend.model_metadata(request.name, request.version or None)
        )
        return json_format.ParseDict(meta, pb.ModelMetadataResponse())

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: Any
    ) -> pb.ModelInferResponse:
        try:
            return await self._infer(request, context)
        except KServeError as exc:
            await self._fail(context, exc)
            raise

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Triton's streaming inference, for models that are not decoupled: one response per
        request, each as soon as it is done (tritonclient matches them by id), the requests run
        concurrently like unary calls. A failed request is a response with its error_message
        (and its id): the stream goes on."""
        answers: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()
        # Requests in flight or answered but not yet sent: at STREAM_WINDOW the stream is not
        # read on, so gRPC's flow control holds back a client that sends without reading.
        window = asyncio.Semaphore(STREAM_WINDOW)

        async def answer(request: pb.ModelInferRequest) -> None:
            try:
                if self._generates(request):  # decoupled: many responses per request
                    await self._generate_stream(request, context, answers.put_nowait)
                    return
                reply = pb.ModelStreamInferResponse(
                    infer_response=await self._infer(request, context, streamed=True)
                )
            except Exception as exc:
                if not isinstance(exc, KServeError):
                    log.exception("stream request failed", extra={"model": request.model_name})
                message = exc.message if isinstance(exc, KServeError) else "internal error"
                reply = pb.ModelStreamInferResponse(
                    error_message=message,
                    infer_response=pb.ModelInferResponse(
                        model_name=request.model_name,
                        model_version=request.model_version,
                        id=request.id,
                    ),
                )
            answers.put_nowait(reply)

        async def read() -> None:
            try:
                async for request in requests:
                    await window.acquire()
                    task = asyncio.create_task(answer(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:
                    await asyncio.wait(set(running))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (reply := await answers.get()) is not None:
                yield reply
                window.release()
            await reader  # a broken request stream ends the call with its error
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Any
    ) -> pb.ModelConfigResponse:
        config = await self._answered(
            context, lambda: self.backend.model_config(request.name, request.version or None)
        )
        return json_format.ParseDict({"config": config}, pb.ModelConfigResponse())

    def _generates(self, request: pb.ModelInferRequest) -> bool:
        try:
            rt = self.backend.lookup(request.model_name, request.model_version or None)
        except KServeError:
            return False
        return self.backend.generative.generates(rt)

    @staticmethod
    def _no_counted_stream(rt: FunctionRuntime) -> None:
        qos = rt.spec.qos
        if qos is not None and qos.counts_requests:
            raise KServeError(
                403,
                f"model {rt.label} is under QoSPolicy {qos.policy}, whose rate and concurrency "
                "limits the gateway counts per request: a stream would pass as one; use "
                "ModelInfer",
            )

    async def _open(
        self, request: pb.ModelInferRequest, context: Any
    ) -> tuple[FunctionRuntime, Opened, bool, str | None]:
        """Start a generation from an inference request of a generative model: the model,
        the stream, whether the client wants an empty final response, the request's id."""
        backend = self.backend
        rt = backend.lookup(request.model_name, request.model_version or None)
        backend.dispatcher.admit(rt, "grpc")
        limit = rt.spec.limits.maxRequestBytes
        if request.ByteSize() > limit:
            raise KServeError(413, f"request message exceeds {limit} bytes for {rt.label}")
        assert rt.signature is not None
        generative = backend.generative
        metadata = dict(context.invocation_metadata() or ())
        tenant = tenant_of(metadata.get(TENANT_HEADER))
        operation = "text_completion"
        try:
            with generative.traced(rt, "grpc", operation, _trace(metadata), tenant) as span:
                parsed, empty_final = triton_generate.from_infer(
                    parse_infer(request, rt.signature), bounds_of(generative.settings(rt))
                )
                opened = await generative.open(
                    rt, "grpc", parsed.prompt, parsed.sampling, tenant, operation, span
                )
        except GenerationError as exc:
            raise KServeError(exc.status, str(exc)) from None
        return rt, opened, empty_final, parsed.id

    async def _generate_whole(
        self, request: pb.ModelInferRequest, context: Any
    ) -> pb.ModelInferResponse:
        """ModelInfer of a generative model: the whole text in one response."""
        rt, opened, _, ident = await self._open(request, context)
        text, done = await collect(opened.stream)
        if done.reason == "error":
            raise KServeError(500, f"model {rt.label} failed: {done.error}")
        context.set_trailing_metadata(
            ((GENERATION_HEADER, generation_record(rt, "text_completion", done).decode()),)
        )
        return _text_response(rt, ident, text, triton_generate.usage_parameters(done))

    async def _generate_stream(
        self,
        request: pb.ModelInferRequest,
        context: Any,
        send: Callable[[pb.ModelStreamInferResponse], None],
    ) -> None:
        """ModelStreamInfer of a generative (decoupled) model: a response per piece of text, as
        it comes. With `triton_enable_empty_final_response` the last response is empty and says
        `triton_final_response: true` (the others false), as Triton does; without it the last
        piece carries the flag (one piece is held back for that)."""
        rt = self.backend.lookup(request.model_name, request.model_version or None)
        self._no_counted_stream(rt)
        rt, opened, empty_final, ident = await self._open(request, context)
        held: str | None = None
        async for event in opened.stream.events():
            if isinstance(event, Finished):
                if event.reason == "error":
                    send(_stream_error(rt, ident, f"model {rt.label} failed: {event.error}"))
                    return
                final = {**triton_generate.usage_parameters(event), triton_generate.FINAL: True}
                if empty_final:
                    send(_stream_text(rt, ident, None, final))
                else:
                    send(_stream_text(rt, ident, held or "", final))
                return
            if not event.text:
                continue
            if empty_final:
                send(_stream_text(rt, ident, event.text, {triton_generate.FINAL: False}))
            else:
                if held is not None:
                    send(_stream_text(rt, ident, held, {}))
                held = event.text

    async def _infer(
        self, request: pb.ModelInferRequest, context: Any, streamed: bool = False
    ) -> pb.ModelInferResponse:
        backend = self.backend
        rt = backend.lookup(request.model_name, request.model_version or None)
        if streamed:
            self._no_counted_stream(rt)
        if backend.generative.generates(rt):
            return await self._generate_whole(request, context)

        def parse() -> InferRequest:
            limit = rt.spec.limits.maxRequestBytes
            if request.ByteSize() > limit:
                raise KServeError(413, f"request message exceeds {limit} bytes for {rt.label}")
            assert rt.signature is not None
            parsed = parse_infer(request, rt.signature)
            remaining = context.time_remaining()
            if remaining is not None:
                parsed.timeout = (
                    remaining if parsed.timeout is None else min(parsed.timeout, remaining)
                )
            return parsed

        def encode(completed: Completed, parsed: InferRequest) -> pb.ModelInferResponse:
            return encode_infer(completed, parsed, rt)

        metadata = dict(context.invocation_metadata() or ())
        tenant = tenant_of(metadata.get(TENANT_HEADER))
        span = backend.tracer.begin(f"infer {rt.name}", *_trace(metadata))
        return await backend.dispatcher.serve(rt, "grpc", parse, encode, tenant, span)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Any
    ) -> pb.ModelStatisticsResponse:
        stats = await self._answered(
            context, lambda: self.backend.statistics(request.name or None, request.version or None)
        )
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Any
    ) -> pb.RepositoryIndexResponse:
        index = self.backend.repository_index(request.ready)
        return json_format.ParseDict({"models": index}, pb.RepositoryIndexResponse())

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        await self._repository(self.backend.load, request, context)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        await self._repository(self.backend.unload, request, context)
        return pb.RepositoryModelUnloadResponse()

    async def _repository(self, action: Any, request: Any, context: Any) -> None:
        try:
            params = _repository_parameters(request.parameters.items())
            await action(request.model_name, None, params)
        except KServeError as exc:
            await self._fail(context, exc)
            raise


# The gRPC methods of Triton's extensions meshfn does not offer (kserve.UNSUPPORTED): they say
# so, instead of the generated base's "Unexpected <class 'NotImplementedError'>".
_UNSUPPORTED_METHODS = {
    "SystemSharedMemoryStatus": "system_shared_memory",
    "SystemSharedMemoryRegister": "system_shared_memory",
    "SystemSharedMemoryUnregister": "system_shared_memory",
    "CudaSharedMemoryStatus": "cuda_shared_memory",
    "CudaSharedMemoryRegister": "cuda_shared_memory",
    "CudaSharedMemoryUnregister": "cuda_shared_memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


def _refusal(method: str, extension: str) -> Any:
    async def refuse(self: Service, request: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method}: {unsupported(extension)}")

    refuse.__name__ = method
    return refuse


for _method, _extension in _UNSUPPORTED_METHODS.items():
    setattr(Service, _method, _refusal(_method, _extension))


def _repository_parameters(items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, value in items:
        choice = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, choice) if choice else None
    return out


class GrpcServer:
    """grpc.aio server for the Service; the message limit is the largest maxRequestBytes (each
    function's own limit is checked again per request). `share_port`: SO_REUSEPORT, for the
    `processes: N` children only (the supervisor cannot hold a socket for grpc-core to adopt);
    otherwise a second server on the port fails to bind instead of silently taking half the
    connections."""

    def __init__(self, backend: Backend, share_port: bool = False) -> None:
        limits = [f.limits.maxRequestBytes for f in backend.config.functions or []]
        self.max_message = max([1 << 20, *limits])
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.max_message),
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.so_reuseport", int(share_port)),
            ]
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Service(backend), self.server)
        self.port = 0

    async def start_unix(self, path: Path) -> None:
        """Serve on a unix socket (mode 0600) instead of a port."""
        address = f"unix:{path}"
        try:
            bound = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
        if not bound:
            raise OSError(f"cannot listen for gRPC on {address}")
        os.chmod(path, SOCKET_MODE)  # before it accepts (the directory is private too)
        await self.server.start()

    async def start(self, host: str, port: int) -> int:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
        if not self.port:
            raise OSError(f"cannot listen for gRPC on {address}")
        await self.server.start()
        return self.port

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
