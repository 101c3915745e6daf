"""The OpenAI-compatible HTTP API (aiohttp, on the coordinator's event loop). A thin shell: requests are
parsed and answers shaped in schema.py (this folder); generation is Coordinator.generate, the same path as the
gRPC API.

    GET  /v1/models, /v1/models/{id}     the served model names (--served-model-name), with max_model_len
    POST /v1/completions                 raw prompt (text or token ids)
    POST /v1/chat/completions            messages rendered with the model's chat template
    POST /tokenize, /detokenize          vLLM's: prompt or messages -> token ids, token ids -> text
    GET  /health                         readiness: 200 while the pipeline serves, else 503 (no token needed)
    GET  /live                           liveness: 200 while the process runs (no token needed)

Limits: a body over `max_body_bytes` is refused with 413 (by its Content-Length before it is read, else once
it grows past the cap); headers must arrive within `timeout_s` of the connection's start or of the previous
response (else the connection is closed; an idle keep-alive connection too), the body within `timeout_s` of
the headers (else 408). Large JSON bodies are parsed and chat templates rendered in a worker thread.

Every answer carries X-Request-Id: the client's (when it sent a valid one) or the request's own id (the
one in logs and in the answer's `id`).

Streaming answers are server-sent events (`data: {...}` per chunk, then `data: [DONE]`). A client that hangs
up cancels its generation: the handler is cancelled (handler_cancellation) and the generator is closed, whose
`finally` cancels the request in the engine.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from common.logs import get_logger

from coordinator.frontends.grpc_api import client_identity, serving_state
from coordinator.frontends.openai.extras import REQUEST_ID_HEADER, client_request_id, detokenize, tokenize
from coordinator.frontends.openai.prompt import Prompts
from coordinator.frontends.openai.schema import (GRPC_TO_HTTP, ApiError, OpenAIRequest, ParseContext, chunk,
                                                 completion, from_generation_error, parse_chat, parse_completion,
                                                 usage)
from coordinator.core.admission import Overloaded
from coordinator.core.status import Status
from coordinator.core.validate import InvalidRequest
from coordinator.frontends.service import Chunk, Coordinator, GenerationFailed

T = TypeVar("T")
log = get_logger(__name__)
MAX_BODY_BYTES = 4 * 1024 * 1024        # default body cap (the coordinator passes --api-max-message-mb)
INLINE_JSON_BYTES = 64 * 1024           # bodies up to this are parsed on the event loop, larger in a thread
RID = web.RequestKey("request_id", str)                # the request's own id (engine, logs, the answer's `id`)
ECHO_ID = web.RequestKey("echo_id", str)        # what X-Request-Id echoes: the client's id, else RID


def _rate_limited(message: str) -> ApiError:
    """A 429 in OpenAI's shape (the mapping of RESOURCE_EXHAUSTED that failed generations use too)."""
    status, type_, code = GRPC_TO_HTTP[Status.RESOURCE_EXHAUSTED]
    return ApiError(status, message, type_, code=code)


def served_model_name(model: str) -> str:
    """The model id clients name by default: 'default', a hub id as given, or a model folder's name.

    >>> [served_model_name(m) for m in ["default", "HuggingFaceTB/SmolLM2-135M", "./m/tiny/"]]
    ['default', 'HuggingFaceTB/SmolLM2-135M', 'tiny']
    """
    if model in ("", "default"):
        return model or "default"
    if model.startswith((".", "/", "~")) or Path(model).expanduser().exists():
        return Path(model.rstrip("/")).name or model
    return model


class OpenAIServer:
    """Serves the OpenAI-compatible API for one Coordinator. `token`: the bearer token required on /v1,
    /tokenize and /detokenize (empty: open); `tls`: (cert, key) PEM files to serve HTTPS; `grace_s`: how long
    stop() lets running requests finish before they are cancelled; `max_body_bytes`: the largest request body (413 beyond);
    `timeout_s`: how long headers, and then the body, may take to arrive; `write_timeout_s`: how long a stream
    waits for its client to take an event (`--stream-write-timeout-s`; then the request is cancelled);
    `max_in_progress`: API requests served at once (`--api-max-concurrent-rpcs`; more: 429; health apart), and
    twice that many connections open at once (one more is closed as soon as it is made: idle keep-alive
    connections and connections whose request has not arrived count too). The model answers to the names of
    --served-model-name, else to `model_name` (comma-separated), else to served_model_name(--model); the
    first is the one answers name when a request names none."""

    def __init__(self, coordinator: Coordinator, model_name: str = "", token: str = "",
                 tls: tuple[str, str] | None = None, grace_s: float = 10.0,
                 max_body_bytes: int = MAX_BODY_BYTES, timeout_s: float = 30.0,
                 write_timeout_s: float = 30.0, max_in_progress: int = 512) -> None:
        self.coordinator = coordinator
        self.names: tuple[str, ...] = (coordinator.config.served_model_name
                                       or tuple(n.strip() for n in model_name.split(",") if n.strip())
                                       or (served_model_name(coordinator.config.model),))
        self.model = self.names[0]
        self.prompts = Prompts(coordinator.encoder.tokenizer)
        self.created = int(time.time())
        self._token = token
        self._expected = f"Bearer {token}".encode() if token else None
        self._tls = tls
        self.max_body_bytes, self.timeout_s, self.write_timeout_s = max_body_bytes, timeout_s, write_timeout_s
        self.max_in_progress, self.in_progress = max_in_progress, 0     # API requests (not health) at once
        self.max_connections = 2 * max_in_progress
        self.app = web.Application(middlewares=[self._middleware], client_max_size=max_body_bytes)
        self.app.add_routes([web.get("/v1/models", self.models), web.get("/v1/models/{model:.+}", self.model_info),
                             web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions),
                             web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                             web.get("/health", self.health), web.get("/live", self.live)])
        # keepalive_timeout is the header timeout: a connection whose next request head has not arrived within
        # it (from its start or the previous response) is closed. lingering_time: after an early answer (408,
        # 413) the rest of the body is read and dropped for that long, then the connection closes.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=grace_s,
                                     keepalive_timeout=timeout_s, lingering_time=min(10.0, timeout_s))
        self.port = 0
        self.scheme = "https" if tls else "http"

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: a free port); returns the port."""
        await self._runner.setup()
        server = self._runner.server          # aiohttp's protocol factory: each connection reports to it
        server.connection_made = functools.partial(self._connection_made, server, server.connection_made)
        context = None
        if self._tls:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*self._tls)
        site = web.TCPSite(self._runner, host, port, ssl_context=context)
        await site.start()
        self.port = int(self._runner.addresses[-1][1])      # the bound port, also when port was 0
        log.info("openai api serving", host=host, port=self.port, models=list(self.names), tls=bool(self._tls))
        return self.port

    @property
    def connections(self) -> int:
        """HTTP connections open now."""
        server = self._runner.server
        return len(server.connections) if server is not None else 0

    async def stop(self) -> None:
        """Stop accepting, let running requests finish within grace_s, then cancel the rest."""
        await self._runner.cleanup()

    # -- plumbing -------------------------------------------------------------------------------------
    def _connection_made(self, server: web.Server, made: Callable[..., None], handler: Any,
                         transport: asyncio.Transport) -> None:
        """A connection beyond `max_connections` is closed at once: its client sees a reset, nothing is read."""
        made(handler, transport)
        if len(server.connections) > self.max_connections:
            log.debug("http connection refused", open=len(server.connections), limit=self.max_connections)
            transport.abort()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Request ids, the token, errors in OpenAI's shape; X-Request-Id on every answer (a stream sets
        it itself, before its headers go out)."""
        request[RID] = request[ECHO_ID] = uuid.uuid4().hex[:16]
        try:
            request[ECHO_ID] = client_request_id(request.headers.get(REQUEST_ID_HEADER)) or request[RID]
            guarded = request.path.startswith(("/v1", "/tokenize", "/detokenize"))
            if self._expected is not None and guarded:
                # a header of bytes that are not UTF-8 (aiohttp keeps them as surrogates) is a wrong key: 401
                got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
                if not hmac.compare_digest(got, self._expected):
                    raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <token>')",
                                   code="invalid_api_key")
            if guarded and self.in_progress >= self.max_in_progress:
                raise _rate_limited(f"{self.max_in_progress} requests are in progress (--api-max-concurrent-rpcs)")
            self.in_progress += guarded
            try:
                resp = await handler(request)
            finally:
                self.in_progress -= guarded
        except ApiError as e:
            resp = web.json_response(e.body(), status=e.status)
            if e.status in (408, 413):          # the rest of the body may still be coming: do not read it
                resp.force_close()
        except web.HTTPException as e:        # the router's 404 / 405, in OpenAI's shape
            if e.status < 400:
                raise
            message = f"Invalid URL ({request.method} {request.path})" if e.status == 404 else e.reason
            resp = web.json_response(ApiError(e.status, message).body(), status=e.status)
        except Exception as e:                 # noqa: BLE001 - any bug answers 500, the server stays up
            log.exception("openai api request failed", path=request.path)
            resp = web.json_response(ApiError(500, f"internal error: {e}", "server_error").body(), status=500)
        if not resp.prepared:
            resp.headers[REQUEST_ID_HEADER] = request[ECHO_ID]
        return resp

    def _context(self) -> ParseContext:
        c = self.coordinator
        return ParseContext(self.names, c.limits.max_position, c.limits.max_new_tokens_cap, self.prompts.encode,
                            self.prompts.render, c.generation_defaults)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                        code="request_too_large")

    async def _read(self, request: web.Request) -> bytes:
        """The body, at most max_body_bytes (413), within timeout_s (408)."""
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise self._too_large()
        try:
            async with asyncio.timeout(self.timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:        # no Content-Length (chunked), or it lied
            raise self._too_large() from None
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.timeout_s:g} s",
                           code="request_timeout") from None

    async def _prework(self, request: web.Request, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the coordinator's bounded pre-admission pool (coordinator/frontends/prework.py),
        counted for the caller: 429 when it is full."""
        try:
            return await self.coordinator.prework.run(self._client(request), fn, *args)
        except Overloaded as e:
            raise _rate_limited(str(e)) from None

    def _admit(self, request: web.Request) -> None:
        """429 at once where `_prework` would refuse this caller now."""
        try:
            self.coordinator.prework.admit(self._client(request))
        except Overloaded as e:
            raise _rate_limited(str(e)) from None

    def _client(self, request: web.Request) -> str:
        return client_identity(self._token, request.remote or "")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await self._read(request)
        try:
            body = json.loads(raw) if len(raw) <= INLINE_JSON_BYTES else await self._prework(request, json.loads, raw)
        except (ValueError, UnicodeDecodeError, RecursionError):        # RecursionError: absurd nesting
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    # -- routes ---------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 200 while the pipeline serves; 503 (and why) while it is down, recovering, held by a
        re-partition, scaled to zero, or the coordinator is closing."""
        ok, why = serving_state(self.coordinator, detail=False)      # public: no stage addresses
        if ok:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable", "reason": why}, status=503)

    async def live(self, request: web.Request) -> web.Response:
        """Liveness: the process answers, whatever the pipeline does."""
        return web.json_response({"status": "alive"})

    def _model_object(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "specpipe",
                "max_model_len": self.coordinator.limits.max_position}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_object(n) for n in self.names]})

    async def model_info(self, request: web.Request) -> web.Response:
        if request.match_info["model"] not in self.names:
            raise ApiError(404, f"The model '{request.match_info['model']}' does not exist", param="model",
                           code="model_not_found")
        return web.json_response(self._model_object(request.match_info["model"]))

    # tokenizing a long prompt and the chat template (jinja) are neither the event loop's work nor unbounded
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._prework(request, parse_completion, await self._body(request), self._context())
        return await self._generate(request, req, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._prework(request, parse_chat, await self._body(request), self._context())
        return await self._generate(request, req, chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        self._admit(request)                # all of it is pre-admission work: refused before the body is read
        body, ctx, strs = await self._body(request), self._context(), self.prompts.token_strs
        text = await self._prework(request, lambda: json.dumps(tokenize(body, ctx, strs)))   # a long list of ids
        return web.Response(text=text, content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        self._admit(request)
        body = await self._body(request)
        out = await self._prework(request, detokenize, body, self._context(), self.coordinator.limits.vocab_size,
                                  self.prompts.decode)
        return web.json_response(out)

    # -- generation -----------------------------------------------------------------------------------
    async def _generate(self, request: web.Request, req: OpenAIRequest, chat: bool) -> web.StreamResponse:
        request_id = request[RID]
        req.inp.request_id = request_id
        req.inp.client = self._client(request)
        oid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        theirs = {} if request[ECHO_ID] == request_id else {"client_request_id": request[ECHO_ID]}
        with structlog.contextvars.bound_contextvars(request_id=request_id, **theirs):
            gen = self.coordinator.generate(req.inp)
            async with aclosing(gen):        # closed on every exit: the engine cancels an unfinished request
                try:
                    first = await anext(gen)
                    if not req.stream:
                        chunks = [first] + [c async for c in gen]
                        return web.json_response(self._whole(chunks, req, oid, chat))
                except (InvalidRequest, GenerationFailed) as e:
                    raise from_generation_error(e) from None
                return await self._stream(request, first, gen, req, oid, chat)

    def _whole(self, chunks: list[Chunk], req: OpenAIRequest, oid: str, chat: bool) -> dict[str, Any]:
        ids = [t for c in chunks for t in c.token_ids]
        last = chunks[-1]
        use = usage(last.stats.prompt_tokens if last.stats else req.prompt_tokens, len(ids))
        return completion(chat, oid, int(time.time()), req.model, "".join(c.text for c in chunks),
                          last.finish_reason, use, ids if req.return_token_ids else None)

    async def _stream(self, request: web.Request, first: Chunk, gen: AsyncIterator[Chunk], req: OpenAIRequest,
                      oid: str, chat: bool) -> web.StreamResponse:
        """Server-sent events, one per chunk with text (or token ids, when asked for); errors after the
        headers went out are sent as an {"error": ...} event."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           REQUEST_ID_HEADER: request[ECHO_ID]})
        await resp.prepare(request)
        created, n_ids = int(time.time()), 0

        async def send(obj: dict[str, Any] | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
            try:             # a client that stopped reading holds nothing longer than this
                await asyncio.wait_for(resp.write(f"data: {data}\n\n".encode()), self.write_timeout_s)
            except asyncio.TimeoutError:
                if request.transport is not None:
                    request.transport.abort()          # nothing more to flush to it, not even the end
                raise ConnectionResetError(f"the client took no event for {self.write_timeout_s:g} s") from None

        def event(text: str, reason: str | None = None, delta: dict[str, str] | None = None,
                  ids: list[int] | None = None) -> dict[str, Any]:
            return chunk(chat, oid, created, req.model, delta, text, reason, req.include_usage,
                         ids if req.return_token_ids else None,
                         usage(req.prompt_tokens, n_ids) if req.continuous_usage else None)

        try:
            if chat:
                await send(event("", delta={"role": "assistant", "content": ""}))
            c = first
            while True:
                n_ids += len(c.token_ids)
                if c.finish_reason:
                    if chat and c.text:           # the held-back tail, then the finish on its own
                        await send(event(c.text, ids=c.token_ids))
                        await send(event("", c.finish_reason, ids=[]))
                    else:
                        await send(event(c.text, c.finish_reason, ids=c.token_ids))
                    if req.include_usage:
                        prompt_tokens = c.stats.prompt_tokens if c.stats else req.prompt_tokens
                        await send({**event(""), "choices": [], "usage": usage(prompt_tokens, n_ids)})
                    break
                if c.text or req.return_token_ids:
                    await send(event(c.text, ids=c.token_ids))
                c = await anext(gen)
        except (InvalidRequest, GenerationFailed) as e:
            log.warning("generation failed mid-stream", error=str(e))
            await send(from_generation_error(e).body())
        except ConnectionError:             # the client went away: aclosing() cancels the generation
            log.info("client disconnected")
            return resp
        except Exception as e:              # noqa: BLE001 - the headers are out: report it in the stream
            log.exception("openai api stream failed")
            await send(ApiError(500, f"internal error: {e}", "server_error").body())
        await send("[DONE]")
        await resp.write_eof()
        return resp
