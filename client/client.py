"""A Python client of the coordinator's public API, `specpipe.v1.Generation/Generate`.

Start a server (`specpipe local --stages 4 --port 50051`), then::

    from client import Client, SpecPipeError

    with Client("127.0.0.1:50051") as client:
        stream = client.generate("Name three rivers.", max_new_tokens=64)
        for delta in stream:                      # text, as tokens commit on the server
            print(delta, end="", flush=True)
        done = stream.result                      # a Completion, once the stream has ended
        print(f"\\n{len(done.token_ids)} tokens ({done.finish_reason}), "
              f"{done.stats.tokens_per_step:.2f} tokens/step, first token after {done.stats.ttft_ms:.0f} ms")

        done = client.complete("def fib(n):", raw=True, max_new_tokens=32, method="pp")   # all at once
        print(done.text, done.token_ids)

        try:
            client.complete("Hi", max_new_tokens=0)
        except SpecPipeError as e:
            print(e.code, e.message)              # INVALID_ARGUMENT max_new_tokens must be at least 1 ...

`AsyncClient` has the same API for asyncio: ``async for delta in client.generate(...)``, then
``stream.result``; ``await client.complete(...)``; ``async with AsyncClient(...) as client``.

Options (keywords of `generate` and `complete`) mirror the fields of `GenerateRequest`
(protos/generation.proto): `method`, `max_new_tokens` (unset: the server's default), `temperature` (0: greedy),
`top_p`, `top_k`, `seed` (0: the server picks one, reported in ``stats.counters["seed"]``), `stop` (a string or
a list), `ignore_eos`, `raw=True` (send the prompt as is) or `chat=True` (apply the model's chat template, the
default), `prompt_token_ids` (instead of prompt text); and `timeout` (seconds, this call only).

Text deltas never split a UTF-8 character and never show a stop string; a token whose text is still held back
yields nothing (its id is in ``stream.token_ids`` at once). Every failure of a call -- refused by the server,
unreachable server, deadline passed -- raises `SpecPipeError`; bad option values raise ValueError or TypeError
before anything is sent. TLS: `tls_ca` (a PEM CA bundle the server's certificate must chain to); `token`: the
API's bearer token (sent as ``authorization: Bearer <token>``; only over TLS or to this machine unless
``insecure=True``).
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import grpc

from protos import generation_pb2, generation_pb2_grpc

try:                                            # Python 3.11+
    from typing import Unpack
except ImportError:                             # pragma: no cover - Python 3.10
    from typing_extensions import Unpack

DEFAULT_ADDR = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 600.0


class RequestOptions(TypedDict, total=False):
    method: str
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: str | Sequence[str]
    ignore_eos: bool
    raw: bool
    chat: bool
    prompt_token_ids: Sequence[int]


class Options(RequestOptions, total=False):
    timeout: float


_SCALARS = ("method", "temperature", "top_p", "top_k", "seed", "ignore_eos")


def make_request(prompt: str = "", **options: Unpack[RequestOptions]) -> generation_pb2.GenerateRequest:
    """The GenerateRequest for a prompt and options (see the module docstring); ValueError or TypeError for
    values the request cannot carry. What the server would refuse (say max_new_tokens=0) is left to it."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be text, not {type(prompt).__name__} (token ids go in prompt_token_ids)")
    unknown = set(options) - set(RequestOptions.__optional_keys__)
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
    raw, chat = options.get("raw"), options.get("chat")
    if raw is not None and chat is not None and bool(raw) == bool(chat):
        raise ValueError("raw and chat contradict each other: give one of them")
    req = generation_pb2.GenerateRequest(prompt=prompt, raw=bool(raw) if raw is not None else chat is False)
    for name in _SCALARS + ("max_new_tokens",):
        value = options.get(name)
        if value is not None:
            _set(req, name, value)
    stop = options.get("stop")
    if stop:
        _set(req, "stop", [stop] if isinstance(stop, str) else list(stop))
    ids = options.get("prompt_token_ids")
    if ids:
        _set(req, "prompt_token_ids", list(ids))
    return req


def _set(req: generation_pb2.GenerateRequest, name: str, value: Any) -> None:
    try:
        if isinstance(value, list):
            getattr(req, name).extend(value)
        else:
            setattr(req, name, value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"option {name}={value!r}: {e}") from None


class SpecPipeError(Exception):
    """A failed call: `code` is the gRPC status name (INVALID_ARGUMENT, UNAUTHENTICATED, RESOURCE_EXHAUSTED,
    UNAVAILABLE, DEADLINE_EXCEEDED, ...), `message` the server's (or gRPC's) explanation, `addr` the server."""

    def __init__(self, code: str, message: str, addr: str = "", unreachable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.addr = code, message, addr
        self.unreachable = unreachable      # no connection could be made (refused, unknown host, TLS handshake)

    @property
    def refused(self) -> bool:
        """Nothing listens at the address (connection refused)."""
        return self.unreachable and "connection refused" in self.message.lower()


def _error(e: grpc.RpcError, addr: str, received: bool) -> SpecPipeError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else "") or ""
    unreachable = (code == grpc.StatusCode.UNAVAILABLE and not received
                   and any(s in details for s in ("failed to connect", "errors resolving", "DNS resolution")))
    return SpecPipeError(code.name, details or code.name.lower().replace("_", " "), addr, unreachable)


@dataclass(frozen=True)
class Stats:
    """The server's statistics of one generation (GenerateResponse.stats)."""
    steps: int = 0                    # pipeline steps from the first injection to the last result
    tokens_per_step: float = 0.0
    tbt_ms: float = 0.0               # mean time between committed tokens
    ttft_ms: float = 0.0              # time to the first committed token (including any admission wait)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_ms: float = 0.0              # on the server, from submission to the end
    counters: dict[str, float] = field(default_factory=dict)   # per method: hits, misses, seed, ...

    @classmethod
    def from_proto(cls, s: generation_pb2.Stats) -> "Stats":
        return cls(steps=s.steps, tokens_per_step=s.tokens_per_step, tbt_ms=s.tbt_ms, ttft_ms=s.ttft_ms,
                   prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens, wall_ms=s.wall_ms,
                   counters=dict(s.counters))


@dataclass(frozen=True)
class Completion:
    """A finished generation."""
    text: str
    token_ids: list[int]              # generated tokens only
    finish_reason: str                # length, eos or stop
    stats: Stats
    request_id: str = ""
    wall_s: float = 0.0               # measured by the client, from the call to the last message


class _Tally:
    """What a stream has delivered so far, and its Completion once the final message arrived."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.result: Completion | None = None
        self.received = False
        self.started = time.perf_counter()

    def feed(self, msg: generation_pb2.GenerateResponse) -> str:
        self.received = True
        self.token_ids.extend(msg.token_ids)
        if msg.text:
            self.parts.append(msg.text)
        if msg.finish_reason or msg.HasField("stats"):
            self.result = Completion("".join(self.parts), list(self.token_ids), msg.finish_reason,
                                     Stats.from_proto(msg.stats), msg.request_id, time.perf_counter() - self.started)
        return msg.text

    def end(self) -> None:
        if self.result is None:
            raise SpecPipeError("UNKNOWN", "the stream ended without its final message", self.addr)

    def completion(self) -> Completion:
        if self.result is None:
            raise RuntimeError("the generation has not finished: iterate over it to the end first "
                               "(or call complete())")
        return self.result


class _Stream:
    """What both kinds of streaming call offer besides iteration."""

    def __init__(self, call: Any, addr: str) -> None:
        self._call, self._tally = call, _Tally(addr)

    @property
    def token_ids(self) -> list[int]:
        """The tokens received so far."""
        return list(self._tally.token_ids)

    @property
    def result(self) -> Completion:
        """The Completion; RuntimeError before the stream has ended."""
        return self._tally.completion()

    def cancel(self) -> None:
        self._call.cancel()


class Generation(_Stream):
    """One streaming call: iterate for the text deltas; `result` once it has ended; `cancel()` to stop early."""

    def __init__(self, call: Any, addr: str) -> None:
        super().__init__(call, addr)
        self._messages = iter(call)

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> str:
        while True:
            try:
                msg = next(self._messages)
            except StopIteration:
                self._tally.end()
                raise
            except grpc.RpcError as e:
                raise _error(e, self._tally.addr, self._tally.received) from e
            if self._tally.feed(msg):
                return msg.text


class AsyncGeneration(_Stream):
    """One streaming call under asyncio: ``async for`` the text deltas; `result` once it has ended."""

    def __aiter__(self) -> "AsyncGeneration":
        return self

    async def __anext__(self) -> str:
        while True:
            try:
                msg = await self._call.read()
            except grpc.RpcError as e:
                raise _error(e, self._tally.addr, self._tally.received) from e
            if msg is grpc.aio.EOF:
                self._tally.end()
                raise StopAsyncIteration
            if self._tally.feed(msg):
                return msg.text


def _credentials(tls_ca: str | None) -> grpc.ChannelCredentials | None:
    if not tls_ca:
        return None
    if not os.path.isfile(tls_ca):
        raise ValueError(f"TLS file {tls_ca} does not exist")
    with open(tls_ca, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


def _metadata(token: str | None, addr: str, tls_ca: str | None,
              insecure: bool) -> tuple[tuple[str, str], ...] | None:
    """The bearer token, sent only over TLS, to this machine, or when the caller says `insecure`."""
    if not token:
        return None
    host = addr.rsplit(":", 1)[0].strip("[]") if ":" in addr else addr
    if not tls_ca and not insecure and host not in ("localhost", "127.0.0.1", "::1"):
        raise ValueError(f"refusing to send the API token in plaintext to {addr}: give tls_ca (the server's CA), "
                         "or insecure=True if the network is trusted")
    return (("authorization", f"Bearer {token}"),)


class Client:
    """A blocking client; one channel, reused by every call; thread-safe. Close it (or use `with`)."""

    def __init__(self, addr: str = DEFAULT_ADDR, tls_ca: str | None = None, token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, insecure: bool = False) -> None:
        self.addr, self.timeout = addr, timeout
        self._metadata = _metadata(token, addr, tls_ca, insecure)
        creds = _credentials(tls_ca)
        self._channel = grpc.secure_channel(addr, creds) if creds else grpc.insecure_channel(addr)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def generate(self, prompt: str = "", **options: Unpack[Options]) -> Generation:
        """Start a generation; iterate the returned Generation for text deltas."""
        timeout = options.pop("timeout", self.timeout)
        req = make_request(prompt, **options)
        return Generation(self._stub.Generate(req, timeout=timeout, metadata=self._metadata), self.addr)

    def complete(self, prompt: str = "", **options: Unpack[Options]) -> Completion:
        """Generate to the end and return the Completion."""
        stream = self.generate(prompt, **options)
        for _ in stream:
            pass
        return stream.result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The asyncio client; its channel opens on the first call (inside the running event loop)."""

    def __init__(self, addr: str = DEFAULT_ADDR, tls_ca: str | None = None, token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, insecure: bool = False) -> None:
        self.addr, self.timeout = addr, timeout
        self._metadata = _metadata(token, addr, tls_ca, insecure)
        self._creds = _credentials(tls_ca)
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationStub | None = None

    def generate(self, prompt: str = "", **options: Unpack[Options]) -> AsyncGeneration:
        """Start a generation; ``async for`` over the returned AsyncGeneration for text deltas."""
        timeout = options.pop("timeout", self.timeout)
        req = make_request(prompt, **options)
        if self._stub is None:
            self._channel = (grpc.aio.secure_channel(self.addr, self._creds) if self._creds
                             else grpc.aio.insecure_channel(self.addr))
            self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        return AsyncGeneration(self._stub.Generate(req, timeout=timeout, metadata=self._metadata), self.addr)

    async def complete(self, prompt: str = "", **options: Unpack[Options]) -> Completion:
        """Generate to the end and return the Completion."""
        stream = self.generate(prompt, **options)
        async for _ in stream:
            pass
        return stream.result

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
