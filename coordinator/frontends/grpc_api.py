"""The public gRPC API: specpipe.v1.Generation/Generate. Translates proto <-> Coordinator, and what both public
APIs (this one and coordinator/frontends/openai/api.py) share: who a caller is (`client_identity`, for
--max-per-client), whether the coordinator serves (`serving_state`, for health checks), and the bearer-token
check that refuses a call before its request is read (`ApiTokenInterceptor`)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

import grpc
import structlog

from protos import generation_pb2, generation_pb2_grpc
from common.grpc_server import peer_host
from common.logs import get_logger

from coordinator.core.status import Status
from coordinator.core.validate import InvalidRequest
from coordinator.engine.state import EngineState
from coordinator.frontends.service import Chunk, Coordinator, GenerateInput, GenerationFailed

log = get_logger(__name__)
# stats with a field of their own in the wire's Stats (the rest go to its counters map)
STATS_FIELDS = {f.name for f in generation_pb2.Stats.DESCRIPTOR.fields} - {"counters", "completion_tokens"}
UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token (send metadata 'authorization: Bearer <token>')"
_GRPC_CODES = {c.value[0]: c for c in grpc.StatusCode}
# why the coordinator does not serve, by engine state (FAILED and UNAVAILABLE say their own why)
_NOT_SERVING = {EngineState.SUSPENDED: "a stage failed: recovering the pipeline",
                EngineState.HELD: "re-partitioning the pipeline",
                EngineState.UNAVAILABLE: "no pipeline (scaled to zero)"}


def grpc_code(status: Status) -> grpc.StatusCode:
    """The grpc.StatusCode a Status mirrors.

    >>> grpc_code(Status.RESOURCE_EXHAUSTED)
    <StatusCode.RESOURCE_EXHAUSTED: (8, 'resource exhausted')>
    """
    return _GRPC_CODES[status]


def token_identity(token: str) -> str:
    """The client identity of an API token (a fingerprint: the token itself never goes into state or logs).

    >>> token_identity("s3cret")
    'token:1ec1c26b50d5'
    """
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]




def client_identity(token: str, host: str) -> str:
    """Who a request counts against for --max-per-client: the API token when the API requires one (every
    caller has passed the check by then), else the caller's address (`host`)."""
    return token_identity(token) if token else host


def serving_state(coordinator: Coordinator, detail: bool = True) -> tuple[bool, str]:
    """(True, "") when a request submitted now can run (Engine.serving) and the coordinator is not closing;
    else (False, why). What the health checks of both APIs report. `detail=False`: the state in general
    words only, never the engine's own account (it names stage addresses): what anyone may read."""
    engine = coordinator.engine
    if coordinator.closing:
        return False, "the coordinator is shutting down"
    if engine.serving:
        return True, ""
    general = _NOT_SERVING.get(engine.state, engine.state.value)
    return False, (engine.why or general) if detail else general


class ApiTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call except health checks (kubelet probes send no
    token). The check reads the call's metadata only: a call without the token gets a handler that answers
    UNAUTHENTICATED without reading its request at all (a streaming-request handler that never iterates),
    so an unauthenticated body is never received in full, never parsed, and the message size limit does
    not even come into play."""

    EXEMPT = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty bearer token would admit anyone")
        self._expected = f"Bearer {token}".encode()

    def authorized(self, metadata: tuple | None) -> bool:
        got = dict(metadata or ()).get("authorization", "")
        got = got.encode() if isinstance(got, str) else got
        return hmac.compare_digest(got, self._expected)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method.startswith(self.EXEMPT) or self.authorized(details.invocation_metadata):
            return await continuation(details)
        return _DENY


async def _refuse(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    yield b""  # pragma: no cover - never reached; makes this an async generator


# the wire does not say whether a method streams: a stream-stream handler suits every kind of call, and it is
# called before any request message is read (no deserializer: the bytes would stay bytes)
_DENY = grpc.stream_stream_rpc_method_handler(_refuse)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """`token`: the API token in use ("" = open API), which makes every caller the same client.

    Bounds, each checked before the request is looked at, each refusal RESOURCE_EXHAUSTED: `max_streams`
    Generate streams at once (`--api-max-concurrent-rpcs`; health Watch streams are bounded apart,
    common/grpc_server.py), `max_per_client` of them per client (`--max-per-client`: its token, else its
    address; 0 = no limit). A stream whose client does not take a message for `write_timeout_s`
    (`--stream-write-timeout-s`: it stopped reading and the flow-control window is full) has its request
    cancelled at once and ends with DEADLINE_EXCEEDED. gRPC sends that status only behind the message the client
    has not taken, and cannot reset one stream from the server, so the call itself ends once its client reads
    again, cancels or disconnects: its stream slot (in all and per client) is held until then, as gRPC's own
    call slot is, so that the slots counted here are never fewer than the calls gRPC holds."""

    def __init__(self, coordinator: Coordinator, token: str = "", max_streams: int | None = None,
                 max_per_client: int = 0, write_timeout_s: float = 30.0) -> None:
        self.coordinator = coordinator
        self._token = token
        self.max_streams = max_streams
        self.max_per_client = max_per_client
        self.write_timeout_s = write_timeout_s
        self.streams: Counter[str] = Counter()        # Generate streams open now, per client

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        client = client_identity(self._token, peer_host(context.peer()))
        if self.max_streams is not None and self.streams.total() >= self.max_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.max_streams} Generate streams are running (--api-max-concurrent-rpcs); "
                                "retry when one ends")
        if self.max_per_client and self.streams[client] >= self.max_per_client:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this client has {self.max_per_client} Generate streams running "
                                "(--max-per-client); retry when one ends")
        self.streams[client] += 1
        context.add_done_callback(lambda _: self._release(client))     # the call has ended on the wire
        messages = self._generate(request, context, client)
        try:
            async for msg in messages:
                try:
                    await asyncio.wait_for(context.write(msg), self.write_timeout_s)
                except asyncio.TimeoutError:
                    log.warning("client stopped reading: request cancelled", write_timeout_s=self.write_timeout_s)
                    # (an abort would wait for the client to take the message before the status: return)
                    context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
                    context.set_details(f"the client took no message for {self.write_timeout_s} s "
                                        "(--stream-write-timeout-s); the request was cancelled")
                    return
        finally:
            await messages.aclose()                    # cancels the request if it still runs

    def _release(self, client: str) -> None:
        self.streams[client] -= 1
        if not self.streams[client]:
            del self.streams[client]

    async def _generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                        client: str) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request_id = uuid.uuid4().hex[:16]
        structlog.contextvars.bind_contextvars(request_id=request_id)     # this RPC's task only
        inp = GenerateInput(
            prompt=request.prompt, prompt_token_ids=list(request.prompt_token_ids), raw=request.raw,
            max_new_tokens=request.max_new_tokens if request.HasField("max_new_tokens") else None,
            method=request.method, temperature=request.temperature, top_p=request.top_p or 1.0,
            top_k=request.top_k, seed=request.seed, stop=list(request.stop), ignore_eos=request.ignore_eos,
            request_id=request_id, client=client)
        try:
            async with aclosing(self.coordinator.generate(inp)) as chunks:     # closed with this stream
                async for chunk in chunks:
                    yield to_proto(chunk)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except GenerationFailed as e:
            code = grpc_code(e.code)
            # refusals under overload are expected and counted (specpipe_requests_total): not a warning each
            level = log.debug if code == grpc.StatusCode.RESOURCE_EXHAUSTED else log.warning
            level("generation failed", error=str(e), code=code.name)
            await context.abort(code, str(e))


def to_proto(chunk: Chunk) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text,
                                          finish_reason=chunk.finish_reason or "", request_id=chunk.request_id)
    if chunk.stats is not None:
        s = chunk.stats
        msg.stats.steps = s.steps
        msg.stats.tokens_per_step = s.tokens_per_step
        msg.stats.tbt_ms = s.tbt_ms
        msg.stats.ttft_ms = s.ttft_ms
        msg.stats.wall_ms = s.wall_ms
        msg.stats.prompt_tokens = s.prompt_tokens
        msg.stats.completion_tokens = s.tokens
        for k, v in s.as_dict().items():        # the rest: the open map (core/stats.py names them)
            if k not in STATS_FIELDS and k != "tokens":       # tokens: completion_tokens
                msg.stats.counters[k] = v
    return msg
