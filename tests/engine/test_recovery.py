"""Stage failure: SIGKILL real stage processes mid-generation; streams pause and go on, exact, exactly once.

The stages are processes as `specpipe local` starts them (coordinator/engine/local.py), supervised (a dead one is
restarted on its port, as Kubernetes restarts a pod); the coordinator serves the public gRPC API.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal

import grpc
import pytest

from coordinator.engine.local import LocalStages
from coordinator.config import CoordinatorConfig
from coordinator.engine.state import EngineState
from coordinator.frontends.server import start
from helpers.reference import hf_greedy
from helpers.wait import wait_until
from protos import generation_pb2, generation_pb2_grpc, stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.grpc

# stage kills in the SIGKILL test (each costs a stage process start and a recovery)
KILLS = int(os.environ.get("SPECPIPE_KILLS", "6"))
PROMPTS = [[5, 6, 7], [40, 41], [100, 3, 9, 27, 60], [200]]


async def _stream(stub, prompt: list[int], n: int, method: str) -> tuple[list[int], object]:
    ids, last = [], None
    async for m in stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n,
                                                                method=method, ignore_eos=True), timeout=120):
        ids += m.token_ids
        last = m
    return ids, last


async def _stages_hold_nothing(addresses: list[str]) -> bool:
    for a in addresses:
        async with grpc.aio.insecure_channel(a) as ch:
            info = await stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=30, wait_for_ready=True)
            if info.active_requests:
                return False
    return True


@pytest.fixture
async def supervised(tiny_model):
    stages = LocalStages(3, model=str(tiny_model), stage_time_ms="15")
    stages.start()
    supervisor = asyncio.create_task(stages.supervise(poll_s=0.1))
    try:
        await stages.wait_ready(timeout_s=180)
        yield stages
    finally:
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
        stages.stop()


async def test_sigkilled_stages_are_recovered_and_every_stream_is_exact(supervised, tiny_model, tiny_hf):
    """SIGKILLs (KILLS) of a random stage at a random moment, half under pp and half under specpipe, 3 streams
    each (6; `SPECPIPE_KILLS=10` for a longer run: each costs a stage process start and a recovery)."""
    stages = supervised
    server, coord = await start(CoordinatorConfig(stages=tuple(stages.addresses), model=str(tiny_model), port=0,
                                                  recovery_timeout_s=90, probe_interval_s=0.5,
                                                  draft="ngram", max_new_tokens_cap=128))
    rng = random.Random(8)
    want = {tuple(p): hf_greedy(tiny_hf, p, 48) for p in PROMPTS}
    recovered_rounds = 0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            for round_ in range(KILLS):
                method = "pp" if round_ < KILLS // 2 else "specpipe"
                prompts = rng.sample(PROMPTS, 3)
                streams = [asyncio.create_task(_stream(stub, p, 48, method)) for p in prompts]
                await asyncio.sleep(rng.uniform(0.05, 0.5))    # kill at a random moment (the test, not a wait)
                victim = rng.randrange(3)
                os.kill(stages.procs[victim].pid, signal.SIGKILL)
                results = await asyncio.wait_for(asyncio.gather(*streams), timeout=150)
                for p, (ids, last) in zip(prompts, results):
                    assert ids == want[tuple(p)], f"round {round_} ({method}, stage {victim} killed): not exact"
                    assert last.finish_reason == "length"
                    assert last.stats.completion_tokens == 48
                if any(last.stats.counters["recoveries"] for _, last in results):
                    recovered_rounds += 1
        assert sum(stages.restarts) == KILLS
        assert recovered_rounds >= KILLS * 2 // 3, "most kills should land while the streams run"
        # releases of the last round travel on the control streams
        await wait_until(lambda: _stages_hold_nothing(stages.addresses), timeout=10,
                         what="no request state left on any stage")
        assert coord.engine.active == 0
    finally:
        await server.stop(0)
        await coord.close()


async def test_a_stage_that_does_not_come_back_ends_streams_with_unavailable(tiny_model, tiny_hf):
    """No supervisor: the stream ends with UNAVAILABLE after the recovery timeout, what it streamed is a
    prefix of the exact output, new requests are refused; once the stage is back, the coordinator serves."""
    stages = LocalStages(2, model=str(tiny_model), stage_time_ms="30")
    stages.start()
    try:
        await stages.wait_ready(timeout_s=180)
        server, coord = await start(CoordinatorConfig(stages=tuple(stages.addresses), model=str(tiny_model),
                                                      port=0, recovery_timeout_s=2, probe_interval_s=0.5))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                got: list[int] = []

                async def consume():
                    async for m in stub.Generate(generation_pb2.GenerateRequest(
                            prompt_token_ids=[9, 8, 7], max_new_tokens=100, method="pp", ignore_eos=True)):
                        got.extend(m.token_ids)
                task = asyncio.create_task(consume())
                await wait_until(lambda: len(got) >= 3, what="3 tokens streamed")
                os.kill(stages.procs[1].pid, signal.SIGKILL)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asyncio.wait_for(task, timeout=60)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "did not come back" in err.value.details()
                assert 3 <= len(got) < 100 and got == hf_greedy(tiny_hf, [9, 8, 7], len(got))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _stream(stub, [1, 2], 4, "pp")
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

                stages.procs[1] = stages._launch(1, "a")          # the stage comes back late
                await wait_until(lambda: coord.engine.serving and not coord.recovery.running, timeout=30,
                                 interval=0.1, what="serving again")
                ids, last = await _stream(stub, [1, 2], 6, "specpipe")
                assert ids == hf_greedy(tiny_hf, [1, 2], 6) and last.finish_reason == "length"
        finally:
            await server.stop(0)
            await coord.close()
    finally:
        stages.stop()


async def test_a_new_coordinator_releases_what_a_dead_one_left_on_the_stages(tiny_model, tiny_hf):
    """A coordinator that vanishes mid-request leaves KV on the stages; the next one to connect frees it."""
    from coordinator.frontends.service import Coordinator, GenerateInput
    from helpers.stage_servers import stage_servers
    async with stage_servers(str(tiny_model), 2, stage_time_ms="20") as (addrs, servicers):
        config = CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), recovery_timeout_s=0)
        first = await Coordinator.connect(config)
        stream = first.generate(GenerateInput(prompt_token_ids=[3, 4, 5], max_new_tokens=50, method="pp",
                                              ignore_eos=True))
        await stream.__anext__()
        await first.pipeline.abort()                  # gone without a word: no release reaches the stages
        held = [len(s.runner.cache.requests) for s in servicers]
        assert held == [1, 1]
        second = await Coordinator.connect(config)
        try:
            await wait_until(lambda: not any(s.runner.cache.requests for s in servicers), timeout=5,
                             what="the stages freed")
            out = [t async for c in second.generate(GenerateInput(prompt_token_ids=[3, 4, 5], max_new_tokens=8,
                                                                  method="specpipe", ignore_eos=True))
                   for t in c.token_ids]
            assert out == hf_greedy(tiny_hf, [3, 4, 5], 8)
        finally:
            await stream.aclose()
            await second.close()
            await first.close()                         # closing its aborted pipeline is harmless


async def _break_when_streaming(coord, got: list[int], at: int, why: str) -> None:
    """Wait until `at` tokens have streamed and no recovery runs, then break the current pipeline (as its
    failure detection would: coordinator/engine/transports/grpc.py)."""
    await wait_until(lambda: len(got) >= at and not coord.recovery.running and coord.pipeline is not None
                     and coord.engine.state is not EngineState.SUSPENDED, interval=0.005,
                     what=f"{at} tokens streamed, no recovery")
    broken = coord.pipeline
    broken._broken(why)
    await wait_until(lambda: coord.pipeline is not broken, interval=0.005, what="the recovery took it down")


async def test_a_pipeline_that_fails_again_while_recovering_is_recovered_again(tiny_model, tiny_hf):
    """The pipeline opened by a recovery breaks at once (a flapping stage): the recovery runs again and the
    stream still ends exact, exactly once."""
    from coordinator.frontends.service import Coordinator, GenerateInput
    from helpers.stage_servers import stage_servers
    async with stage_servers(str(tiny_model), 2, stage_time_ms="15") as (addrs, servicers):
        coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model),
                                                            recovery_timeout_s=30, probe_interval_s=0))
        opened = 0
        plain_open = coord.open_pipeline

        async def flaky_open(addresses):
            nonlocal opened
            pipeline = await plain_open(addresses)
            opened += 1
            if opened == 1:
                pipeline._broken("test: the new pipeline fails at once")
            return pipeline
        coord.open_pipeline = flaky_open
        try:
            got: list[int] = []
            last = None

            async def consume():
                nonlocal last
                async for c in coord.generate(GenerateInput(prompt_token_ids=[7, 8, 9], max_new_tokens=40,
                                                            method="specpipe", ignore_eos=True)):
                    got.extend(c.token_ids)
                    last = c
            task = asyncio.create_task(consume())
            await _break_when_streaming(coord, got, 3, "test: a stage failed")
            await asyncio.wait_for(task, timeout=60)
            assert got == hf_greedy(tiny_hf, [7, 8, 9], 40)
            assert opened == 2 and last.stats.recoveries == 2 and last.stats.tokens == 40
            await wait_until(lambda: not any(s.runner.cache.requests for s in servicers), timeout=5,
                             what="the stages freed")
        finally:
            await coord.close()


async def test_failures_between_which_a_request_progresses_are_survived_but_a_poison_request_fails(tiny_model,
                                                                                                   tiny_hf):
    """A rolling restart (a failure after every few tokens) is survived however often it happens; a request
    that makes no progress through MAX_FRUITLESS failures in a row (its prefill may be what kills a stage)
    ends with INTERNAL; what it streamed is exact; the coordinator serves on."""
    from coordinator.engine.live import MAX_FRUITLESS
    from coordinator.frontends.service import Coordinator, GenerateInput, GenerationFailed
    from helpers.stage_servers import stage_servers
    async with stage_servers(str(tiny_model), 2, stage_time_ms="150") as (addrs, _):
        coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model),
                                                            recovery_timeout_s=30, probe_interval_s=0))
        try:
            async def run(got: list[int], last: list) -> None:
                async for c in coord.generate(GenerateInput(prompt_token_ids=[11, 12], max_new_tokens=9,
                                                            method="pp", ignore_eos=True)):
                    got.extend(c.token_ids)
                    last[:] = [c]

            got, last = [], []
            task = asyncio.create_task(run(got, last))
            for k in range(MAX_FRUITLESS + 1):                      # progress before every failure
                await _break_when_streaming(coord, got, 2 * (k + 1), f"test: rolling restart {k + 1}")
            await asyncio.wait_for(task, timeout=60)
            assert got == hf_greedy(tiny_hf, [11, 12], 9) and last[0].stats.recoveries == MAX_FRUITLESS + 1

            got, last = [], []
            task = asyncio.create_task(run(got, last))
            await _break_when_streaming(coord, got, 1, "test: first failure")
            for k in range(MAX_FRUITLESS):                          # at once: no token in between
                await _break_when_streaming(coord, got, 0, f"test: fruitless failure {k + 1}")
            with pytest.raises(GenerationFailed) as err:
                await asyncio.wait_for(task, timeout=60)
            assert err.value.code == grpc.StatusCode.INTERNAL.value[0] and "no progress" in str(err.value)
            assert 1 <= len(got) < 9 and got == hf_greedy(tiny_hf, [11, 12], len(got))
            out = [t async for c in coord.generate(GenerateInput(prompt_token_ids=[11, 12], max_new_tokens=3,
                                                                 method="pp", ignore_eos=True)) for t in c.token_ids]
            assert out == hf_greedy(tiny_hf, [11, 12], 3)
        finally:
            await coord.close()


async def test_a_stage_failure_while_a_repartition_drains_is_carried_onto_the_new_pipeline(tiny_model8, tiny_hf8):
    """kubectl scale 3 -> 2 removes a pod that still serves: its streams break during the drain. The running
    and the queued requests go on, exact, on the new 2-stage pipeline; nothing is left on the stages."""
    from coordinator.engine.scaling import Repartitioner
    from coordinator.frontends.service import Coordinator, GenerateInput
    from helpers.stage_servers import stage_servers
    async with stage_servers(str(tiny_model8), 3, stage_time_ms="30") as (addrs, servicers):
        coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model8),
                                                            recovery_timeout_s=30, probe_interval_s=0))
        rep = Repartitioner(coord, lambda i: addrs[i])
        try:
            async def run(prompt: list[int], got: list[int]) -> None:
                async for c in coord.generate(GenerateInput(prompt_token_ids=prompt, max_new_tokens=30,
                                                            method="pp", ignore_eos=True)):
                    got.extend(c.token_ids)

            first: list[int] = []
            running = asyncio.create_task(run([4, 5, 6], first))
            await wait_until(lambda: len(first) >= 2, what="2 tokens streamed")
            scaling = asyncio.create_task(rep.scale(2))
            await wait_until(lambda: coord.draining is not None, interval=0.005, what="the drain begun")
            second: list[int] = []
            queued = asyncio.create_task(run([9, 9], second))
            await wait_until(lambda: coord.engine.admission.queue, what="the second request queued")
            coord.pipeline._broken("test: stage 2 was deleted before the drain ended")
            await asyncio.wait_for(asyncio.gather(running, queued, scaling), timeout=90)
            assert first == hf_greedy(tiny_hf8, [4, 5, 6], 30) and second == hf_greedy(tiny_hf8, [9, 9], 30)
            assert coord.pipeline.num_stages == 2 and rep.current == 2
            await wait_until(lambda: not any(s.runner.cache.requests for s in servicers[:2]), timeout=5,
                             what="the 2 stages freed")
            # the stage left out may still hold what the broken pipeline sent it (in a cluster its pod is
            # gone); when it rejoins, the re-partition releases it first
            await rep.scale(3)
            assert [len(s.runner.cache.requests) for s in servicers] == [0, 0, 0]
            again: list[int] = []
            await run([4, 5, 6], again)
            assert again == first
        finally:
            await coord.close()


async def test_a_hung_stage_is_noticed_by_the_health_probe(tiny_model, tiny_hf):
    """SIGSTOP (no connection breaks): the probe times out, the coordinator waits; after SIGCONT the stream
    goes on, exact."""
    stages = LocalStages(2, model=str(tiny_model), stage_time_ms="20")
    stages.start()
    try:
        await stages.wait_ready(timeout_s=180)
        server, coord = await start(CoordinatorConfig(stages=tuple(stages.addresses), model=str(tiny_model),
                                                      port=0, recovery_timeout_s=60, probe_interval_s=0.3,
                                                      probe_timeout_s=1.0))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                got: list[int] = []
                last = []

                async def consume():
                    async for m in stub.Generate(generation_pb2.GenerateRequest(
                            prompt_token_ids=[21, 22, 23], max_new_tokens=60, method="specpipe", ignore_eos=True)):
                        got.extend(m.token_ids)
                        last[:] = [m]
                task = asyncio.create_task(consume())
                await wait_until(lambda: len(got) >= 3, what="3 tokens streamed")
                os.kill(stages.procs[1].pid, signal.SIGSTOP)
                await wait_until(lambda: coord.recovery.running, interval=0.05, what="the hang noticed")
                await asyncio.sleep(1.0)                  # the stage stays stopped a while (the test, not a wait)
                os.kill(stages.procs[1].pid, signal.SIGCONT)
                await asyncio.wait_for(task, timeout=90)
                assert got == hf_greedy(tiny_hf, [21, 22, 23], 60)
                assert last[0].stats.counters["recoveries"] >= 1
        finally:
            await server.stop(0)
            await coord.close()
    finally:
        for p in stages.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        stages.stop()


@pytest.mark.parametrize("slow", ["open", "suspend"])
async def test_the_recovery_timeout_holds_even_when_a_step_of_the_recovery_is_slow(slow, tiny_model, tiny_hf):
    """A recovery step that hangs past --recovery-timeout-s (`open`: a stage slow to answer its Results stream;
    `suspend`: taking the failed pipeline down, its first step): the held streams end with UNAVAILABLE while it
    still hangs; once it ends, serving resumes."""
    from coordinator.frontends.service import Coordinator, GenerateInput, GenerationFailed
    from helpers.stage_servers import stage_servers
    async with stage_servers(str(tiny_model), 2, stage_time_ms="20") as (addrs, _):
        coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model),
                                                            recovery_timeout_s=1, probe_interval_s=0))
        step_may_end = asyncio.Event()
        owner, name = (coord, "open_pipeline") if slow == "open" else (coord.engine, "suspend")
        plain_step = getattr(owner, name)

        async def slow_step(*args):              # ends only when the test says so
            await step_may_end.wait()
            return await plain_step(*args)
        setattr(owner, name, slow_step)
        try:
            got: list[int] = []

            async def consume():
                async for c in coord.generate(GenerateInput(prompt_token_ids=[5, 5], max_new_tokens=100,
                                                            method="pp", ignore_eos=True)):
                    got.extend(c.token_ids)
            task = asyncio.create_task(consume())
            await wait_until(lambda: len(got) >= 2, what="2 tokens streamed")
            coord.pipeline._broken("test: a stage failed")
            with pytest.raises(GenerationFailed) as err:      # while the step still hangs
                await asyncio.wait_for(task, timeout=30)
            assert coord.recovery.running
            step_may_end.set()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE.value[0] and "did not come back" in str(err.value)
            await coord.recovery.wait()
            out = [t async for c in coord.generate(GenerateInput(prompt_token_ids=[5, 5], max_new_tokens=4,
                                                                 method="pp", ignore_eos=True)) for t in c.token_ids]
            assert out == hf_greedy(tiny_hf, [5, 5], 4)
        finally:
            await coord.close()
