"""Many concurrent Generate streams over real gRPC stages: exact outputs under staggered arrivals and
client cancellations, nothing left anywhere afterwards, admission queue and KV limits answered with
RESOURCE_EXHAUSTED."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.core.schedulers.base import Request
from coordinator.core.schedulers.pp import PPScheduler
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.reference import hf_greedy, prompts
from helpers.stage_servers import served_coordinator
from helpers.wait import wait_until, wait_until_empty
from protos import generation_pb2, generation_pb2_grpc
from services.model.shard import load_shard
from services.runner import StageRunner


class Client:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = generation_pb2_grpc.GenerationStub(channel)

    async def generate(self, stop_after: int | None = None, **fields) -> list[int]:
        """Token ids streamed; with stop_after, the client hangs up after that many tokens."""
        call = self.stub.Generate(generation_pb2.GenerateRequest(ignore_eos=True, **fields), timeout=120)
        ids: list[int] = []
        async for msg in call:
            ids += msg.token_ids
            if stop_after is not None and len(ids) >= stop_after:
                call.cancel()
                break
        return ids


@pytest.mark.grpc
@pytest.mark.parametrize("method", ["specpipe", "cb-pp"])
async def test_sixteen_concurrent_streams_are_exact_and_leave_nothing(tiny_model, tiny_hf, method):
    lengths = [5, 17, 9, 24, 12, 7, 20, 3]
    ps = prompts(16, seed=11)
    cancel_after = {3: 4, 8: 2, 13: 6}          # request index -> tokens before the client hangs up
    async with served_coordinator(str(tiny_model), 4, method=method, node_budget=16, max_new_tokens_cap=64,
                                  default_max_new_tokens=16) as served:
        coord, client = served.coord, Client(served.channel)

        async def one(i: int) -> list[int]:
            await asyncio.sleep(0.03 * i)       # staggered arrivals (the test, not a wait)
            return await client.generate(prompt_token_ids=ps[i], max_new_tokens=lengths[i % 8],
                                         stop_after=cancel_after.get(i))
        outs = await asyncio.gather(*(one(i) for i in range(16)))
        for i, ids in enumerate(outs):
            want = hf_greedy(tiny_hf, ps[i], lengths[i % 8])
            assert ids == (want[:len(ids)] if i in cancel_after else want), i
            if i in cancel_after:
                assert len(ids) >= cancel_after[i]
        await wait_until_empty(served.stages, coord)
        sched = coord.engine.scheduler(method)
        assert not sched.requests and not sched.prefill_next and not sched._batches
        if method == "specpipe":
            assert not sched.trees and not sched.pending and not sched.begun
            assert not coord.engine.spec.draft.runner.cache.requests, "the draft keeps KV"


@pytest.mark.grpc
async def test_closed_loop_clients_take_the_slots_held_for_them_over_grpc(tiny_model, tiny_hf):
    """Two clients each send four requests one after another over the gRPC API (S = 4, 100 ms stages, so the
    next result comes a stage time after a finish): a request that follows a finish arrives while its slot is
    held and takes it (batching.py rule 4) in the real engine, and every output is exact."""
    ps = prompts(8, seed=13)
    async with served_coordinator(str(tiny_model), 4, stage_time_ms="100", method="specpipe", width=4) as served:
        client = Client(served.channel)

        async def one_client(k: int) -> list[list[int]]:
            return [await client.generate(prompt_token_ids=ps[i], max_new_tokens=3) for i in range(k, 8, 2)]
        outs = await asyncio.gather(one_client(0), one_client(1))
        for k, ids in enumerate(outs):
            assert ids == [hf_greedy(tiny_hf, ps[i], 3) for i in range(k, 8, 2)], k
        sched = served.coord.engine.scheduler("specpipe")
        assert sched.holds_taken >= 1 and sched.follow.followed > 0, (sched.holds_taken, sched.holds_lapsed)
        await wait_until_empty(served.stages, served.coord)


@pytest.mark.grpc
async def test_a_full_queue_is_refused_with_resource_exhausted(tiny_model, tiny_hf):
    async with served_coordinator(str(tiny_model), 2, stage_time_ms="20", method="cb-pp", max_active=1,
                                  max_queue=1) as served:
        coord, client = served.coord, Client(served.channel)
        first = asyncio.create_task(client.generate(prompt_token_ids=[4, 5, 6], max_new_tokens=40))
        await wait_until(lambda: coord.engine.admission.active, what="the first request running")
        second = asyncio.create_task(client.generate(prompt_token_ids=[7, 8], max_new_tokens=6))
        await wait_until(lambda: coord.engine.admission.queue, what="the second request queued")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(prompt_token_ids=[9], max_new_tokens=4)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "busy" in err.value.details() and "1 waiting" in err.value.details()
        assert await first == hf_greedy(tiny_hf, [4, 5, 6], 40)
        assert await second == hf_greedy(tiny_hf, [7, 8], 6), "the queued request runs when one ends"
        assert await client.generate(prompt_token_ids=[9], max_new_tokens=4) == hf_greedy(tiny_hf, [9], 4)


@pytest.mark.grpc
async def test_kv_limit_of_the_stages_bounds_admission(tiny_model, tiny_hf):
    """Stages of 2 layers x 2 KV heads x 16 dims in fp32 hold 512 bytes per node; 0.125 MiB = 256 nodes.
    A request that could never fit is refused at once; ones that fit run (exactly)."""
    async with served_coordinator(str(tiny_model), 2, kv_limit_mb=0.125, method="specpipe", width=4,
                                  max_new_tokens_cap=64, default_max_new_tokens=16) as served:
        coord, client = served.coord, Client(served.channel)
        assert coord.engine.admission.kv_slots == 256
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.generate(prompt_token_ids=[5] * 200, max_new_tokens=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV slots" in err.value.details()
        ps = prompts(3, seed=2)
        outs = await asyncio.gather(*(client.generate(prompt_token_ids=p, max_new_tokens=30) for p in ps))
        assert outs == [hf_greedy(tiny_hf, p, 30) for p in ps]


def test_a_stage_refuses_growth_past_its_kv_limit_and_others_go_on(tiny_model, tiny_hf):
    """The stage's own check (for coordinators that do not reserve): the request that outgrows the limit
    fails with RESOURCE_EXHAUSTED from that stage and frees its KV; the other request is exact."""
    runners = [StageRunner(load_shard(str(tiny_model), a, b, __import__("torch").float32, "cpu"), i,
                           kv_limit_bytes=128 * 512)                # 128 nodes
               for i, (a, b) in enumerate([(0, 2), (2, 4)])]
    sched = PPScheduler(2)
    out = InProcessPipeline(runners).run(sched, [Request("small", [3, 4], 20), Request("big", [5] * 100, 40)])
    assert out["small"].tokens == hf_greedy(tiny_hf, [3, 4], 20)
    assert out["big"].reason == "error" and "KV cache limit" in out["big"].error
    assert all(not r.cache.requests and r.cache.nbytes() == 0 for r in runners)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.grpc
async def test_a_hundred_cancelled_or_expired_streams_leave_nothing(tiny_model):
    """Clients that hang up (before or after the first token) or whose deadline passes: within a bounded
    time no stage holds request state or KV, the coordinator holds nothing, memory is back near baseline."""
    async with served_coordinator(str(tiny_model), 3, stage_time_ms="3", method="specpipe", max_new_tokens_cap=256,
                                  default_max_new_tokens=16) as served:
        addrs, coord, client = served.stages, served.coord, Client(served.channel)
        await client.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=8)         # warm-up
        await wait_until_empty(addrs, coord)
        baseline = rss_mb()

        async def doomed(i: int) -> None:
            req = generation_pb2.GenerateRequest(prompt_token_ids=[5 + i % 50, 7, 9], max_new_tokens=200,
                                                 ignore_eos=True, method=("specpipe", "pp", "cb-pp")[i % 3])
            if i % 3 == 2:                                   # the deadline passes mid-stream
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in client.stub.Generate(req, timeout=0.15):
                        pass
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                return
            call = client.stub.Generate(req, timeout=60)
            if i % 3 == 1:
                await asyncio.sleep(0.01 * (i % 5))  # hang up early, maybe before any token (the test)
            else:
                await call.read()                            # hang up after the first token
            call.cancel()
        for start_at in range(0, 100, 20):                    # 5 waves of 20 at once
            await asyncio.gather(*(doomed(i) for i in range(start_at, start_at + 20)))
        await wait_until_empty(addrs, coord)
        for method in ("specpipe", "pp", "cb-pp"):
            sched = coord.engine.scheduler(method)
            assert not sched.requests and not sched._batches
        assert not coord.engine.spec.draft.runner.cache.requests
        assert not coord.engine.admission.active and not coord.engine.admission.queue
        assert rss_mb() < baseline + 150, "memory is back near its baseline"


@pytest.mark.grpc
async def test_a_baselines_long_draft_prefill_holds_back_no_other_stream(tiny_model, tiny_hf):
    """`sps` runs its draft in line, the prompt's prefill first: a test double holds that prefill (a long
    prompt's, as a big draft on a long prompt would) until the test lets it go. Meanwhile a `pp` stream runs
    to the end, exact: the in-line draft holds its own scheduler only, not the engine."""
    import threading
    async with served_coordinator(str(tiny_model), 2, max_new_tokens_cap=64, default_max_new_tokens=8) as served:
        draft = served.coord.engine.spec.draft
        begin_many, held, go = draft.begin_many, threading.Event(), threading.Event()

        def slow_begin(jobs, *args, **kwargs):
            if any(len(prompt) > 100 for _, prompt, *_ in jobs):
                held.set()
                assert go.wait(timeout=60), "the test never let the prefill go"
            return begin_many(jobs, *args, **kwargs)
        draft.begin_many = slow_begin
        client = Client(served.channel)
        long_prompt = [3 + (7 * i) % 250 for i in range(300)]
        baseline = asyncio.create_task(client.generate(prompt_token_ids=long_prompt, max_new_tokens=6,
                                                       method="sps"))
        try:
            await wait_until(held.is_set, timeout=30, what="the sps prefill to start")
            quick = await asyncio.wait_for(client.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=12,
                                                           method="pp"), timeout=30)
            assert quick == hf_greedy(tiny_hf, [5, 6, 7], 12)
            assert not baseline.done()            # still in its prefill
        finally:
            go.set()
        assert await baseline == hf_greedy(tiny_hf, long_prompt, 6)
        await wait_until_empty(served.stages, served.coord)
