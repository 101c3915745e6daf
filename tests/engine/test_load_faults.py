"""One minute of load that mixes malformed and valid requests over gRPC and HTTP against real stages
(issue 15): every malformed request is refused as INVALID_ARGUMENT / 400 naming what is wrong, every valid
output is exact, the pipeline never recovers, and memory stays flat. Beside them (issue 26): health Watch
streams held open beyond their bound, prompts of several prefill chunks with each of the six methods, clients
that hang up in the middle of a stream or stop reading it, /tokenize calls, a last stage that answers some
requests' micro-batches wrongly (another live request's id, a token too few), and a draft that fails some
requests. Each fault ends its own request with INTERNAL naming it, never another's; at the end no stage and
no draft holds anything."""
from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import aiohttp
import grpc
import pytest
from prometheus_client import REGISTRY

from common.batch import MicroBatch, Segment
from coordinator.config import CoordinatorConfig
from coordinator.frontends.server import start, start_http
from helpers.reference import hf_greedy, prompts
from helpers.stage_servers import stage_servers
from helpers.wait import wait_until
from protos import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.grpc

DURATION_S = float(os.environ.get("SPECPIPE_LOAD_FAULTS_S", "60"))
WORKERS = 6

# (fields of a GenerateRequest, a word the refusal must contain)
BAD_GRPC = [
    (dict(prompt_token_ids=[1, 2], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_token_ids=[1, 2], max_new_tokens=2 ** 31 - 1), "max_new_tokens"),
    (dict(prompt_token_ids=[1, 2], top_k=-5, temperature=0.5), "top_k"),
    (dict(prompt_token_ids=[1, 256]), "token id 256"),
    (dict(prompt_token_ids=[1, -3]), "token id -3"),
    (dict(prompt_token_ids=[1] * 600), "context"),
    (dict(prompt_token_ids=[1, 2], temperature=float("nan")), "temperature"),
    (dict(prompt_token_ids=[1, 2], top_p=2.0, temperature=0.5), "top_p"),
    (dict(prompt_token_ids=[1, 2], method="beam"), "method"),
    (dict(prompt_token_ids=[1, 2], stop=["x"] * 17), "stop"),
    (dict(), "empty prompt"),
    (dict(prompt="hi", prompt_token_ids=[1]), "not both"),
]
BAD_HTTP = [
    (b'{"prompt": [1, 2], "max_tokens": ', "JSON"),
    ({"prompt": [1, 2], "max_tokens": 4, "top_k": 2 ** 32, "temperature": 0.5}, "top_k"),
    ({"prompt": [1, 2], "max_tokens": 4, "seed": -1, "temperature": 0.5}, "seed"),
    ({"prompt": [1, 2], "max_tokens": "four"}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 4, "temperature": 1e39}, "temperature"),
    ({"prompt": [1, 10 ** 10], "max_tokens": 4}, "token id"),
    ({"prompt": {"a": 1}, "max_tokens": 4}, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 4, "stop": [["x"]]}, "stop"),
]


def failures() -> float:
    return sum(REGISTRY.get_sample_value("specpipe_stage_failures_total", {"outcome": o}) or 0.0
               for o in ("recovered", "gave_up", "failed"))


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    pytest.fail("no VmRSS in /proc/self/status")


METHODS = ["pp", "cb-pp", "specpipe", "sps", "tree", "pipeinfer"]
CHUNK = 16          # --prefill-chunk: the long prompts below take 4 to 6 micro-batches
STAGE_FAULT, DRAFT_FAULT = 251, 252      # a prompt starting with one of these is a fault's victim


def spoil_some_results(runner) -> dict[str, int]:
    """The last stage answers one later micro-batch of each request whose prompt starts with STAGE_FAULT
    wrongly, in turns: the segment carries another live request's id (the corruption validation must stop),
    or a token too few. Only micro-batches of such requests alone are spoilt, so a fault never touches a
    request that did not ask for one. Returns counts by fault."""
    step, doomed, spoilt, done = runner.step, set(), {"wrong id": 0, "few rows": 0}, set()

    def answer(batch: MicroBatch) -> MicroBatch:
        doomed.update(s.request_id for s in batch.segments if s.positions[:1] == [0] and s.token_ids[0] == STAGE_FAULT)
        first = {s.request_id for s in batch.segments if s.positions[:1] == [0]}
        out = step(batch)
        rids = {s.request_id for s in out.segments}
        if not rids or not rids <= doomed - done or rids & first:
            return out
        others = sorted(set(runner.cache.requests) - rids)
        if sum(spoilt.values()) % 2 == 0 and others:
            victim = others[0]
            out.segments = [Segment(victim, s.node_ids, s.parent_ids, s.positions, s.token_ids, s.want_output)
                            for s in out.segments]
            spoilt["wrong id"] += 1
        elif out.argmax:
            out.argmax = list(out.argmax)[:-1]
            spoilt["few rows"] += 1
        else:
            return out
        done.update(rids)
        return out
    runner.step = answer
    return spoilt


def fail_some_drafts(draft) -> dict[str, int]:
    """The draft's prefill computes every prompt, then fails those starting with DRAFT_FAULT (their KV and
    sampling state are there: the failure must free them). Returns {"failed": n}."""
    begin_many, failed = draft.begin_many, {"failed": 0}

    def begin(jobs, *args):
        errors = begin_many(jobs, *args)
        out = []
        for (rid, prompt, *_), error in zip(jobs, errors):
            if error is None and prompt[0] == DRAFT_FAULT:
                failed["failed"] += 1
                error = RuntimeError("the draft failed (simulated)")
            out.append(error)
        return out
    draft.begin_many = begin
    return failed


@pytest.mark.slow
async def test_a_minute_of_mixed_malformed_and_valid_requests(chat_model, tiny_hf):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from common.grpc_server import WATCH_PER_PEER
    tiny_model = chat_model                  # the tiny model with a byte tokenizer (token id = byte), for /tokenize
    ps = prompts(6, seed=5)
    rng0 = random.Random(26)
    long_ps = [[rng0.randrange(3, 250) for _ in range(rng0.randrange(4 * CHUNK, 6 * CHUNK))] for _ in range(3)]
    faulty = {kind: [[first] + p[1:] for p in ps[:3]] for kind, first in (("stage", STAGE_FAULT),
                                                                        ("draft", DRAFT_FAULT))}
    want = {tuple(p): hf_greedy(tiny_hf, p, 8) for p in ps + long_ps + faulty["stage"] + faulty["draft"]}
    async with stage_servers(str(tiny_model), 2) as (addrs, servicers):
        spoilt = spoil_some_results(servicers[-1].runner)
        cfg = CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), port=0, recovery_timeout_s=30,
                                probe_interval_s=0.5, max_new_tokens_cap=400, default_max_new_tokens=8,
                                prefill_chunk=CHUNK, stream_write_timeout_s=1.0)
        server, coord = await start(cfg)
        draft_failed = fail_some_drafts(coord.engine.spec.draft)
        http = await start_http(cfg, coord, port=0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        stub = generation_pb2_grpc.GenerationStub(channel)
        raw = channel.unary_stream("/specpipe.v1.Generation/Generate", request_serializer=lambda b: b,
                                   response_deserializer=generation_pb2.GenerateResponse.FromString)
        url = f"http://127.0.0.1:{http.port}/v1/completions"
        before = failures()
        counts = {"valid": 0, "refused": 0, "long": 0, "hung_up": 0, "watch_refused": 0, "tokenized": 0,
                  "stage_fault": 0, "draft_fault": 0, "stalled": 0}
        loop = asyncio.get_running_loop()
        end = loop.time() + DURATION_S
        rss: list[int] = []

        async def valid_grpc(rng: random.Random) -> None:
            p = rng.choice(ps)
            msgs = [m async for m in stub.Generate(generation_pb2.GenerateRequest(
                prompt_token_ids=p, max_new_tokens=8, ignore_eos=True,
                method=rng.choice(["pp", "specpipe", "cb-pp"])), timeout=60)]
            assert [t for m in msgs for t in m.token_ids] == want[tuple(p)]

        async def valid_http(session: aiohttp.ClientSession, rng: random.Random) -> None:
            p = rng.choice(ps)
            body = {"model": tiny_model.name, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "method": rng.choice(["pp", "specpipe"])}
            async with session.post(url, json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["choices"][0]["token_ids"] == want[tuple(p)]

        async def long_prompt(rng: random.Random) -> None:
            p, method = rng.choice(long_ps), rng.choice(METHODS)
            msgs = [m async for m in stub.Generate(generation_pb2.GenerateRequest(
                prompt_token_ids=p, max_new_tokens=8, ignore_eos=True, method=method), timeout=60)]
            assert [t for m in msgs for t in m.token_ids] == want[tuple(p)], method
            counts["long"] += 1

        async def hang_up(rng: random.Random) -> None:
            p = rng.choice(ps)
            call = stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=p, max_new_tokens=8,
                                                                ignore_eos=True, method=rng.choice(METHODS)),
                                 timeout=60)
            async for _ in call:
                call.cancel()                           # the client goes away after its first message
                break
            counts["hung_up"] += 1

        async def tokenize(session: aiohttp.ClientSession, rng: random.Random) -> None:
            text = "".join(rng.choice("abc déf \n") for _ in range(rng.randrange(1, 2000)))
            async with session.post(f"http://127.0.0.1:{http.port}/tokenize",
                                    json={"model": tiny_model.name, "prompt": text}) as resp:
                if resp.status == 429:                  # the pool of pre-admission work is full: allowed
                    return
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["tokens"] == list(text.encode())
            counts["tokenized"] += 1

        async def faulty_request(rng: random.Random, kind: str) -> None:
            """A request whose stage result or draft fails (if its micro-batch is alone / it uses the draft):
            it ends with INTERNAL naming the fault, or exact."""
            p = rng.choice(faulty[kind])
            methods = ["pp" if kind == "stage" else "specpipe", "sps", "tree", "pipeinfer"]
            call = stub.Generate(generation_pb2.GenerateRequest(
                prompt_token_ids=p, max_new_tokens=8, ignore_eos=True, method=rng.choice(methods)), timeout=60)
            tokens = []
            try:
                async for m in call:
                    tokens += m.token_ids
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.INTERNAL, (e.code(), e.details())
                word = "answered micro-batch" if kind == "stage" else "draft failed"
                assert word in e.details(), e.details()
                counts[f"{kind}_fault"] += 1
                return
            assert tokens == want[tuple(p)]

        async def stalled() -> None:
            """A client whose stream window is 1 KiB takes the first message of a 400-token stream and stops
            reading: its request is cancelled after --stream-write-timeout-s (or, if the stream fitted in the
            window, ran to its end); reading again, it gets DEADLINE_EXCEEDED or the exact tokens."""
            small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=small_window) as ch:
                p = ps[0]
                call = generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                    prompt_token_ids=p, max_new_tokens=400, ignore_eos=True, method="pp"), timeout=120)
                first = await call.read()
                rid, tokens = first.request_id, list(first.token_ids)
                await wait_until(lambda: rid not in coord.engine.admission.active, timeout=60,
                                 what="the request of the client that stopped reading ends")
                try:
                    while (m := await call.read()) is not grpc.aio.EOF:
                        tokens += m.token_ids
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (e.code(), e.details())
                    counts["stalled"] += 1
                    return
                assert tokens == hf_greedy(tiny_hf, p, 400)

        async def watchers() -> None:
            """Watch streams held for the whole run: the bound keeps WATCH_PER_PEER, refuses the rest, and
            Check keeps answering."""
            health = health_pb2_grpc.HealthStub(channel)
            held = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(3 * WATCH_PER_PEER)]
            for w in held:
                try:
                    assert (await w.read()).status == health_pb2.HealthCheckResponse.SERVING
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    counts["watch_refused"] += 1
            while loop.time() < end:
                check = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
                await asyncio.sleep(DURATION_S / 20)     # a probe now and then (a period, not a wait)
            for w in held:
                w.cancel()

        async def bad_grpc(rng: random.Random) -> None:
            if rng.random() < 0.15:
                call, word = raw(os.urandom(rng.randint(1, 64)) + b"\xff\xff", timeout=10), ""
            else:
                fields, word = rng.choice(BAD_GRPC)
                call = stub.Generate(generation_pb2.GenerateRequest(**fields), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            code = err.value.code()
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL) if not word else \
                code == grpc.StatusCode.INVALID_ARGUMENT, (code, err.value.details())
            assert word in (err.value.details() or ""), (word, err.value.details())

        async def bad_http(session: aiohttp.ClientSession, rng: random.Random) -> None:
            body, word = rng.choice(BAD_HTTP)
            if isinstance(body, dict):
                body = dict(body, model=tiny_model.name)
                kw = {"json": body}
            else:
                kw = {"data": body, "headers": {"content-type": "application/json"}}
            async with session.post(url, **kw) as resp:
                text = await resp.text()
                assert resp.status == 400, (resp.status, text)
                assert word.lower() in text.lower(), (word, text)

        async def worker(i: int) -> None:
            rng = random.Random(i)
            async with aiohttp.ClientSession() as session:
                while loop.time() < end:
                    kind = rng.choice(["valid_grpc", "valid_http", "bad_grpc", "bad_http", "bad_grpc", "bad_http",
                                       "long_prompt", "hang_up", "tokenize", "stage_fault", "draft_fault"])
                    if kind == "tokenize":
                        await tokenize(session, rng)
                    elif kind in ("stage_fault", "draft_fault"):
                        await faulty_request(rng, kind.split("_")[0])
                    elif kind == "long_prompt":
                        await long_prompt(rng)
                    elif kind == "hang_up":
                        await hang_up(rng)
                    elif kind == "valid_grpc":
                        await valid_grpc(rng)
                    elif kind == "valid_http":
                        await valid_http(session, rng)
                    elif kind == "bad_grpc":
                        await bad_grpc(rng)
                    else:
                        await bad_http(session, rng)
                    if kind.startswith(("valid", "bad")):
                        counts["valid" if kind.startswith("valid") else "refused"] += 1

        async def sample_memory() -> None:
            while loop.time() < end:
                rss.append(rss_bytes())
                await asyncio.sleep(DURATION_S / 30)        # 30 samples over the run (a period, not a wait)

        try:
            await asyncio.gather(*(worker(i) for i in range(WORKERS)), sample_memory(), watchers(),
                                 *(stalled() for _ in range(3)))
            assert counts["valid"] >= 20 and counts["refused"] >= 40, counts
            assert counts["long"] >= 6 and counts["hung_up"] >= 3 and counts["watch_refused"] == 2 * WATCH_PER_PEER, \
                counts
            assert counts["tokenized"] >= 3 and counts["stalled"] >= 1, counts
            assert counts["stage_fault"] >= sum(spoilt.values()) and spoilt["wrong id"] >= 1, (counts, spoilt)
            assert counts["draft_fault"] == draft_failed["failed"] >= 1, (counts, draft_failed)
            assert failures() == before                     # not one pipeline recovery
            assert coord.recovery is not None and not coord.recovery.running
            # a client that hung up last may still have its cancel on the way through the engine: every
            # request ends, and soon (a leak would hold it past the deadline)
            await wait_until(lambda: coord.engine.active == 0 and not coord.engine.admission.active, timeout=10,
                             what=lambda: f"every request ended (engine {coord.engine.active}, "
                                          f"admission {sorted(coord.engine.admission.active)})")
            # memory flat: after the first third (warm-up: caches, compiled paths) it grows by < 64 MiB
            settled = rss[len(rss) // 3]
            assert max(rss[len(rss) // 3:]) - settled < 64 * 1024 * 1024, [r // 2 ** 20 for r in rss]
            await wait_until(lambda: not any(s.runner.cache.requests or s.runner.cache.nbytes() for s in servicers),
                             timeout=4, what="nothing left on the stages")
            draft = coord.engine.spec.draft
            await wait_until(lambda: not (draft.runner.cache.requests or draft.runner.cache.nbytes() or draft.sampling
                                          or draft._q), timeout=4, what="nothing left in the draft")
        finally:
            await channel.close()
            await http.stop()
            await server.stop(0)
            await coord.close()
