"""Limits of the public APIs, against real servers on 127.0.0.1: the gRPC message cap, the bearer-token check
before a request is read, the concurrent-RPC cap, the HTTP body cap and read timeouts, the per-client limit."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import aiohttp
import grpc
import pytest
from aiohttp import web

from coordinator.config import CoordinatorConfig
from coordinator.frontends.grpc_api import client_identity, peer_host, token_identity
from coordinator.frontends.openai.api import OpenAIServer
from coordinator.frontends.server import ApiServer, api_server_options, start, start_http
from coordinator.frontends.service import Coordinator
from helpers.reference import hf_greedy
from helpers.stage_servers import stage_servers
from helpers.wait import wait_until
from protos import generation_pb2, generation_pb2_grpc

MiB = 1024 * 1024
GENERATE = "/specpipe.v1.Generation/Generate"
Code = grpc.StatusCode


@dataclass
class Served:
    coord: Coordinator
    server: ApiServer
    http: OpenAIServer

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}/v1"


@asynccontextmanager
async def serving(model, stage_time_ms: str = "0", method: str = "pp", **config) -> AsyncIterator[Served]:
    """Two in-process stages, the coordinator's gRPC API and its HTTP API, on free ports (plain pipeline
    parallelism: these tests are about the API, not speculation)."""
    async with stage_servers(str(model), 2, stage_time_ms=stage_time_ms) as (addrs, _):
        cfg = CoordinatorConfig(stages=tuple(addrs), model=str(model), port=0, max_new_tokens_cap=400,
                                default_max_new_tokens=8, method=method, **config)
        server, coord = await start(cfg)
        http = await start_http(cfg, coord, port=0)
        try:
            yield Served(coord, server, http)
        finally:
            await http.stop()
            await server.stop(0)
            await coord.close()


async def grpc_code(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return Code.OK


def request(prompt: list[int], n: int, **kw) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n, ignore_eos=True, **kw)


def test_identities_and_options():
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1" and peer_host("ipv6:%5B::1%5D:5000") == "::1"
    assert client_identity("", "10.1.2.3") == "10.1.2.3"
    assert client_identity("s3cret", "10.1.2.3") == token_identity("s3cret") != token_identity("other")
    assert "s3cret" not in token_identity("s3cret")
    opts = dict(api_server_options(4 * MiB))
    assert opts["grpc.max_receive_message_length"] == 4 * MiB
    assert opts["grpc.http2.max_ping_strikes"] > 0, "unlimited ping strikes let a client ping-flood"


@pytest.mark.grpc
async def test_a_message_over_the_api_limit_is_resource_exhausted(tiny_model, tiny_hf):
    async with serving(tiny_model, api_max_message_mb=1) as s:
        async with grpc.aio.insecure_channel(s.grpc_addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            big = request([200] * 600_000, 2)           # 2 bytes a token: 1.2 MB
            assert big.ByteSize() > MiB
            assert await grpc_code(stub.Generate(big, timeout=30)) == Code.RESOURCE_EXHAUSTED
            below = request([200] * 400_000, 2)         # 0.8 MB: received and parsed, then refused by content
            assert below.ByteSize() < MiB
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(below, timeout=30)]
            assert err.value.code() == Code.INVALID_ARGUMENT and "context" in err.value.details()
            msgs = [m async for m in stub.Generate(request([10, 20, 30], 4), timeout=30)]
            assert [t for m in msgs for t in m.token_ids] == hf_greedy(tiny_hf, [10, 20, 30], 4)
        # the stage hops keep their own (larger) limit
        assert s.coord.config.max_message_mb > s.coord.config.api_max_message_mb


@pytest.mark.grpc
async def test_an_unauthenticated_call_is_refused_before_its_body_is_read(tiny_model, tiny_hf, monkeypatch):
    """Garbage that cannot parse, and a body over the message limit, both get UNAUTHENTICATED without the
    token, and the request deserializer never runs; with the token the same bytes get INVALID_ARGUMENT
    (parsed, failed) and RESOURCE_EXHAUSTED (over the limit)."""
    parsed: list[int] = []
    real = generation_pb2.GenerateRequest.FromString

    def counting(raw: bytes) -> generation_pb2.GenerateRequest:
        parsed.append(len(raw))
        return real(raw)
    # where add_GenerationServicer_to_server (and the stub) take the request's (de)serializer from
    monkeypatch.setattr(generation_pb2_grpc, "protos_dot_generation__pb2", SimpleNamespace(
        GenerateRequest=SimpleNamespace(FromString=counting,
                                        SerializeToString=generation_pb2.GenerateRequest.SerializeToString),
        GenerateResponse=generation_pb2.GenerateResponse))
    async with serving(tiny_model, api_max_message_mb=1, api_token="s3cret") as s:
        async with grpc.aio.insecure_channel(s.grpc_addr) as ch:
            raw = ch.unary_stream(GENERATE)             # bytes in, bytes out: no client-side serialization
            garbage, big = b"\xff" * 64, b"\xff" * (3 * MiB)
            with pytest.raises(Exception):
                real(garbage)
            good = (("authorization", "Bearer s3cret"),)
            for body in (garbage, big):
                for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
                    assert await grpc_code(raw(body, metadata=metadata, timeout=30)) == Code.UNAUTHENTICATED
            assert parsed == [], "an unauthenticated request body was parsed"
            assert await grpc_code(raw(garbage, metadata=good, timeout=30)) == Code.INVALID_ARGUMENT
            assert parsed == [64]
            assert await grpc_code(raw(big, metadata=good, timeout=30)) == Code.RESOURCE_EXHAUSTED
            stub = generation_pb2_grpc.GenerationStub(ch)
            msgs = [m async for m in stub.Generate(request([7, 8], 3), metadata=good, timeout=30)]
            assert [t for m in msgs for t in m.token_ids] == hf_greedy(tiny_hf, [7, 8], 3)


@pytest.mark.grpc
async def test_rpcs_beyond_the_concurrency_cap_are_resource_exhausted(tiny_model):
    async with serving(tiny_model, stage_time_ms="100", api_max_concurrent_rpcs=2) as s:
        async with grpc.aio.insecure_channel(s.grpc_addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            running = [stub.Generate(request([5, 6, 7], 300), timeout=120) for _ in range(2)]
            for call in running:
                await call.read()                       # both are being served
            assert await grpc_code(stub.Generate(request([1], 2), timeout=30)) == Code.RESOURCE_EXHAUSTED
            for call in running:
                call.cancel()
            await wait_until(lambda: not s.coord.engine.admission.active, what="the cancelled requests end")
            assert await grpc_code(stub.Generate(request([1], 2), timeout=30)) == Code.OK


@pytest.mark.grpc
async def test_an_http_body_over_the_cap_is_413(tiny_model):
    async with serving(tiny_model, api_max_message_mb=1) as s, aiohttp.ClientSession() as h:
        url = s.url + "/completions"
        big = json.dumps({"model": "x", "prompt": [5] * 400_000}).encode()       # 1.2 MB
        assert len(big) > MiB
        async with h.post(url, data=big, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"

        async def chunked() -> AsyncIterator[bytes]:     # no Content-Length: the cap holds while reading
            for i in range(0, len(big), 64 * 1024):
                yield big[i:i + 64 * 1024]
        async with h.post(url, data=chunked(), headers={"Content-Type": "application/json"}) as r:
            assert r.status == 413
        async with h.post(url, json={"prompt": [5, 6], "max_tokens": 2, "temperature": 0, "ignore_eos": True}) as r:
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2


@pytest.mark.grpc
async def test_slow_http_headers_and_bodies_time_out(tiny_model):
    async with serving(tiny_model, http_timeout_s=0.5) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.http.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")          # the rest of the body never comes
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=30)          # then the server closes
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"request_timeout" in answer
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", s.http.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")         # the headers never end
        await writer.drain()
        async with aiohttp.ClientSession() as h:                            # others are served meanwhile
            body = {"prompt": [5, 6], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            async with h.post(s.url + "/completions", json=body) as r:
                assert r.status == 200
        assert await asyncio.wait_for(reader.read(), timeout=30) == b"", "a slow request head is cut off"
        writer.close()


@pytest.mark.grpc
async def test_the_per_client_limit_refuses_the_third_request_of_a_client_but_serves_another(tiny_model, tiny_hf):
    """Limit 2, no token: the client is its address. Two gRPC streams from 127.0.0.1 run; a third request
    from that address is refused on both APIs (RESOURCE_EXHAUSTED, 429), one from 127.0.0.2 is served."""
    async with serving(tiny_model, stage_time_ms="100", max_per_client=2) as s:
        async with grpc.aio.insecure_channel(s.grpc_addr) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            running = [stub.Generate(request([5, 6, 7], 300), timeout=120) for _ in range(2)]
            for call in running:
                await call.read()
            assert sorted(s.coord.engine.admission.client_of.values()) == ["127.0.0.1", "127.0.0.1"]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(request([1], 2), timeout=30)]
            assert err.value.code() == Code.RESOURCE_EXHAUSTED and "has 2 Generate streams running (--max-per-client)" in err.value.details()
            body = {"prompt": [9, 10], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            async with aiohttp.ClientSession() as h:
                async with h.post(s.url + "/completions", json=body) as r:
                    assert r.status == 429, "the same address over HTTP is the same client"
            other = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=other) as h:
                async with h.post(s.url + "/completions", json=body) as r:
                    assert r.status == 200
                    assert (await r.json())["choices"][0]["token_ids"] == hf_greedy(tiny_hf, [9, 10], 3)
            for call in running:
                call.cancel()
            await wait_until(lambda: not s.coord.engine.admission.client_of, what="the cancelled requests end")
            assert await grpc_code(stub.Generate(request([1], 2), timeout=30)) == Code.OK


@pytest.mark.grpc
async def test_a_client_at_its_limit_is_refused_before_its_prompt_is_prepared(tiny_model):
    """Limit 1: with a request of 127.0.0.1 running (over HTTP), a text prompt from that address is refused over
    gRPC and over HTTP before any of its pre-admission work (RESOURCE_EXHAUSTED / 429): the client's running
    and queued requests count with its requests being prepared. Before, it was tokenised first and refused by
    the admission after (here, with no tokenizer: INVALID_ARGUMENT / 400)."""
    async with serving(tiny_model, stage_time_ms="100", max_per_client=1) as s:
        body = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True, "return_token_ids": True}
        async with aiohttp.ClientSession() as h:
            running = await h.post(s.url + "/completions", json=body)
            try:
                assert running.status == 200 and (await running.content.readline()).startswith(b"data: ")
                assert list(s.coord.engine.admission.client_of.values()) == ["127.0.0.1"]
                prepared, prepare = [], s.coord.prepare
                s.coord.prepare = lambda inp: (prepared.append(inp.prompt), prepare(inp))[1]
                async with grpc.aio.insecure_channel(s.grpc_addr) as ch:
                    text = generation_pb2.GenerateRequest(prompt="hello there", max_new_tokens=2)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        [m async for m in generation_pb2_grpc.GenerationStub(ch).Generate(text, timeout=30)]
                assert err.value.code() == Code.RESOURCE_EXHAUSTED
                assert "being prepared, running or queued (--max-per-client)" in err.value.details()
                async with h.post(s.url + "/completions", json={"prompt": "hello there", "max_tokens": 2}) as r:
                    assert r.status == 429
                    assert "being prepared, running or queued" in (await r.json())["error"]["message"]
                assert prepared == [] and s.coord.prework.busy == 0
            finally:
                running.close()


@pytest.mark.grpc
async def test_with_a_token_the_token_is_the_client(tiny_model):
    """Every caller with the token is one client, whatever its address."""
    async with serving(tiny_model, stage_time_ms="100", max_per_client=2, api_token="s3cret") as s:
        auth = {"Authorization": "Bearer s3cret"}
        body = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True, "return_token_ids": True}
        async with aiohttp.ClientSession(headers=auth) as h, \
                aiohttp.ClientSession(headers=auth, connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as h2:
            streams = [await h.post(s.url + "/completions", json=body) for _ in range(2)]
            try:
                for r in streams:
                    assert r.status == 200
                    assert (await r.content.readline()).startswith(b"data: ")     # running: a first token
                assert list(s.coord.engine.admission.client_of.values()) == [token_identity("s3cret")] * 2
                async with h2.post(s.url + "/completions", json={"prompt": [1], "max_tokens": 2, "temperature": 0,
                                                                  "ignore_eos": True}) as r:
                    assert r.status == 429 and (await r.json())["error"]["type"] == "rate_limit_error"
            finally:
                for r in streams:
                    r.close()


async def test_held_health_watch_streams_never_lock_out_generate_or_check(tiny_model, tiny_hf):
    """200 Watch streams from one address (the per-address bound, 8, holds them to 8) and the other bounds:
    Generate still completes exactly and Check answers SERVING on the API port and the health port, although
    --api-max-concurrent-rpcs is 4. Before the bound, Watch streams counted against that cap."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from common.grpc_server import WATCH_PER_PEER
    from coordinator.engine.local import free_port
    async with serving(tiny_model, api_max_concurrent_rpcs=4, health_port=free_port()) as s:
        async with grpc.aio.insecure_channel(s.grpc_addr) as ch, \
                grpc.aio.insecure_channel(f"127.0.0.1:{s.server.health_port}") as hch:
            watches = []
            for i in range(WATCH_PER_PEER):           # admitted one by one: both ports count together
                watches.append(health_pb2_grpc.HealthStub(ch if i % 2 else hch).Watch(health_pb2.HealthCheckRequest()))
                assert (await watches[-1].read()).status == health_pb2.HealthCheckResponse.SERVING
            more = [health_pb2_grpc.HealthStub(ch if i % 2 else hch).Watch(health_pb2.HealthCheckRequest())
                    for i in range(200 - WATCH_PER_PEER)]
            refused = await asyncio.gather(*(grpc_code(w) for w in more))
            assert set(refused) == {Code.RESOURCE_EXHAUSTED}, "one address holds at most 8 Watch streams"
            assert s.server.health.watching == WATCH_PER_PEER
            for c in (ch, hch):
                check = await health_pb2_grpc.HealthStub(c).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
            prompt = [5, 6, 7]
            got = [t async for m in generation_pb2_grpc.GenerationStub(ch).Generate(request(prompt, 6), timeout=60)
                   for t in m.token_ids]
            assert got == hf_greedy(tiny_hf, prompt, 6)
            for w in watches[:WATCH_PER_PEER]:
                w.cancel()
            await wait_until(lambda: s.server.health.watching == 0, timeout=10)


async def test_the_watch_bounds_are_the_flags(tiny_model):
    """--health-watch-per-client 2 --health-watch-max 3: a third stream from one address is refused, naming
    the bound; the config refuses a per-client bound above the total."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with pytest.raises(ValueError, match="health_watch_per_client"):
        CoordinatorConfig(stages=("a:1",), health_watch_per_client=5, health_watch_max=4)
    async with serving(tiny_model, health_watch_per_client=2, health_watch_max=3) as s:
        async with grpc.aio.insecure_channel(s.grpc_addr) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
            for w in watches:
                assert (await w.read()).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health.Watch(health_pb2.HealthCheckRequest()).read()
            assert err.value.code() == Code.RESOURCE_EXHAUSTED and "2 health Watch streams" in err.value.details()
            assert (s.server.health.per_peer, s.server.health.total) == (2, 3)
            for w in watches:
                w.cancel()


class WatchContext:
    """The parts of a grpc.aio.ServicerContext that BoundedHealth.Watch uses."""

    def __init__(self, peer: str) -> None:
        self._peer, self.sent = peer, []

    def peer(self) -> str:
        return self._peer

    async def write(self, msg) -> None:
        self.sent.append(msg.status)

    async def abort(self, code, details: str):
        raise grpc.aio.AbortError(code, details)


async def test_the_watch_bound_counts_per_address_and_all_addresses_together():
    from grpc_health.v1 import health_pb2

    from common.grpc_server import BoundedHealth
    health = BoundedHealth(per_peer=2, total=3)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    req = health_pb2.HealthCheckRequest()
    a = [WatchContext("ipv4:10.0.0.1:1000"), WatchContext("ipv4:10.0.0.1:1001")]
    held = [asyncio.create_task(health.Watch(req, c)) for c in a]
    await wait_until(lambda: all(c.sent for c in a), timeout=5)
    with pytest.raises(grpc.aio.AbortError, match="10.0.0.1"):          # a third from the same address
        await health.Watch(req, WatchContext("ipv4:10.0.0.1:1002"))
    held.append(asyncio.create_task(health.Watch(req, b := WatchContext("ipv6:[::2]:7"))))
    await wait_until(lambda: bool(b.sent), timeout=5)
    assert health.watching == 3
    with pytest.raises(grpc.aio.AbortError, match="3 health Watch streams"):   # a fresh address, but 3 in all
        await health.Watch(req, WatchContext("ipv4:10.0.0.9:5"))
    held[0].cancel()
    await asyncio.gather(held[0], return_exceptions=True)
    assert health.watching == 2
    held.append(asyncio.create_task(health.Watch(req, c := WatchContext("ipv4:10.0.0.9:5"))))
    await wait_until(lambda: bool(c.sent), timeout=5)                    # room again
    for t in held:
        t.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert health.watching == 0


async def test_an_authorization_header_that_is_not_utf8_is_401_not_500(tiny_model):
    async with serving(tiny_model, api_token="s3cret") as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.http.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        assert status_line.split()[1] == b"401", status_line


async def test_http_requests_in_progress_and_connections_are_capped(tiny_model):
    """--api-max-concurrent-rpcs 2: with two streams in progress a third API request gets 429 while /health
    answers; the server holds at most twice that, 4 connections: a fifth is closed as soon as it is made,
    and once one of them closes a new one is served."""
    async with serving(tiny_model, stage_time_ms="100", api_max_concurrent_rpcs=2) as s:
        body = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True, "return_token_ids": True}
        url = f"http://127.0.0.1:{s.http.port}"
        async with aiohttp.ClientSession() as h:
            streams = [await h.post(s.url + "/completions", json=body) for _ in range(2)]
            idle: list[asyncio.StreamWriter] = []
            try:
                for r in streams:
                    assert r.status == 200 and (await r.content.readline()).startswith(b"data: ")
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as once:
                    async with once.post(s.url + "/completions", json={"prompt": [1], "max_tokens": 2}) as r:
                        assert r.status == 429
                        assert "2 requests are in progress" in (await r.json())["error"]["message"]
                    async with once.get(url + "/health") as r:
                        assert r.status == 200
                await wait_until(lambda: s.http.connections == 2, what="the closed connections are gone")
                for _ in range(2):                    # idle connections count: no request sent on them
                    idle.append((await asyncio.open_connection("127.0.0.1", s.http.port))[1])
                await wait_until(lambda: s.http.connections == 4, what="four connections open")
                reader, writer = await asyncio.open_connection("127.0.0.1", s.http.port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                try:
                    got = await asyncio.wait_for(reader.read(), 10)
                except ConnectionResetError:
                    got = b""
                writer.close()
                assert got == b"", "the fifth connection is closed unanswered"
                idle.pop().close()
                await wait_until(lambda: s.http.connections == 3, what="an idle connection closed")
                async with aiohttp.ClientSession() as again:
                    async with again.get(url + "/health") as r:
                        assert r.status == 200
            finally:
                for w in idle:
                    w.close()
                for r in streams:
                    r.close()


class StreamContext:
    """The parts of a grpc.aio.ServicerContext that GenerationServicer.Generate uses; `write` never completes
    (a client that stopped reading) when `stuck`."""

    def __init__(self, stuck: bool) -> None:
        self.stuck, self.written, self.done = stuck, [], []
        self.code = self.details = None

    def peer(self) -> str:
        return "ipv4:10.0.0.1:999"

    def add_done_callback(self, fn) -> None:
        self.done.append(fn)

    def end(self) -> None:
        """The call ends on the wire (its status sent, or its client gone)."""
        for fn in self.done:
            fn(self)

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def write(self, msg) -> None:
        if self.stuck:
            await asyncio.Event().wait()
        self.written.append(msg)

    async def abort(self, code, details: str):
        raise grpc.aio.AbortError(code, details)


class SlowCoordinator:
    """A Coordinator whose generations yield a chunk every 10 ms until closed; records the closes."""

    def __init__(self) -> None:
        self.closed = 0

    async def generate(self, inp):
        from coordinator.frontends.service import Chunk
        try:
            while True:
                yield Chunk([1], "a", request_id=inp.request_id)
                await asyncio.sleep(0.01)
        finally:
            self.closed += 1


async def test_a_stream_whose_client_stops_reading_ends_and_its_request_is_closed():
    from coordinator.frontends.grpc_api import GenerationServicer
    coord = SlowCoordinator()
    servicer = GenerationServicer(coord, write_timeout_s=0.2)
    context = StreamContext(stuck=True)
    await asyncio.wait_for(servicer.Generate(request([5], 4), context), 10)
    assert context.code == Code.DEADLINE_EXCEEDED and "took no message for 0.2 s" in context.details
    assert coord.closed == 1, "the request was cancelled"
    assert servicer.streams == {"10.0.0.1": 1}, "the slot is held while gRPC holds the call"
    context.end()
    assert not servicer.streams


@pytest.mark.grpc
async def test_a_real_client_that_stops_reading_loses_its_stream_and_its_request(tiny_model):
    """Over real gRPC: a client whose stream window is 1 KiB takes the first message of a 400-token stream and
    reads no more. Once the window is full the server's writes wait; after --stream-write-timeout-s (1 s) its
    request is cancelled, long before its 400 tokens (~40 s at 2 x 50 ms a token) would have ended it, and the
    stream ends with DEADLINE_EXCEEDED once the client reads again. Before, the server awaited an abort that
    gRPC sends only behind the message the client had not taken: the request ran on."""
    async with serving(tiny_model, stage_time_ms="50", stream_write_timeout_s=1.0) as s:
        small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(s.grpc_addr, options=small_window) as ch:
            call = generation_pb2_grpc.GenerationStub(ch).Generate(request([5, 6, 7], 400), timeout=120)
            await call.read()
            assert len(s.coord.engine.admission.active) == 1
            await wait_until(lambda: not s.coord.engine.admission.active, timeout=30,
                             what="the request of the client that stopped reading is cancelled")
            # gRPC holds the call until its client reads again (the status waits behind the message it did
            # not take): so does its slot
            assert s.server.generation.streams == {"127.0.0.1": 1}
            taken = 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while (await call.read()) is not grpc.aio.EOF:
                    taken += 1
            assert err.value.code() == Code.DEADLINE_EXCEEDED and "--stream-write-timeout-s" in err.value.details()
            assert 1 < taken < 400
            await wait_until(lambda: not s.server.generation.streams, what="the slot is freed as the call ends")


async def test_an_event_stream_whose_client_stops_reading_is_closed_and_its_request_cancelled(tiny_model,
                                                                                              monkeypatch):
    """HTTP: after its first two events every write of the server waits (as on a socket whose client stopped
    reading and whose buffers are full: loopback's are too large to fill with this model's 512 positions).
    After --stream-write-timeout-s (0.5 s) the connection is closed and the request cancelled, long before
    its 300 tokens (~30 s) would have ended it."""
    write = web.StreamResponse.write
    events: list[bytes] = []

    async def stalls(self, data: bytes) -> None:
        if len(events) >= 2:
            await asyncio.Event().wait()
        events.append(data)
        await write(self, data)
    monkeypatch.setattr(web.StreamResponse, "write", stalls)
    async with serving(tiny_model, stage_time_ms="50", stream_write_timeout_s=0.5) as s:
        body = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True, "return_token_ids": True}
        async with aiohttp.ClientSession() as h:
            async with h.post(s.url + "/completions", json=body) as r:
                assert r.status == 200
                got = []
                with pytest.raises(aiohttp.ClientPayloadError):
                    async with asyncio.timeout(20):
                        async for line in r.content:
                            got += [line] if line.startswith(b"data: ") else []
        assert len(got) == 2
        await wait_until(lambda: not s.coord.engine.admission.active, timeout=10, what="the request is cancelled")


async def test_generate_streams_are_bounded_in_all_and_per_client_before_any_work():
    from coordinator.frontends.grpc_api import GenerationServicer
    coord = SlowCoordinator()
    servicer = GenerationServicer(coord, max_streams=3, max_per_client=2)
    contexts = [StreamContext(stuck=False) for _ in range(2)]
    first = [asyncio.create_task(servicer.Generate(request([5], 4), c)) for c in contexts]
    await wait_until(lambda: servicer.streams.total() == 2, timeout=5)
    with pytest.raises(grpc.aio.AbortError, match="--max-per-client"):
        await servicer.Generate(request([5], 4), StreamContext(stuck=False))
    other = StreamContext(stuck=False)
    other.peer = lambda: "ipv4:10.0.0.2:5"
    third = asyncio.create_task(servicer.Generate(request([5], 4), other))
    await wait_until(lambda: servicer.streams.total() == 3, timeout=5)
    another = StreamContext(stuck=False)
    another.peer = lambda: "ipv4:10.0.0.3:5"
    with pytest.raises(grpc.aio.AbortError, match="--api-max-concurrent-rpcs"):
        await servicer.Generate(request([5], 4), another)
    for t in [*first, third]:
        t.cancel()
    await asyncio.gather(*first, third, return_exceptions=True)
    for c in [*contexts, other]:
        c.end()
    assert not servicer.streams and coord.closed == 3
