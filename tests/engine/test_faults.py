"""A request's fault stays the request's; a lost micro-batch never hangs; a re-partition pauses for a bounded
time — over real gRPC stages on 127.0.0.1 (issue 15, items 1, 2, 4 and 6)."""
from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
import torch
from prometheus_client import REGISTRY

from coordinator.config import CoordinatorConfig
from coordinator.core.schedulers.base import Finish
from coordinator.core.status import FinishReason, Status
from coordinator.engine.live import Tokens
from coordinator.engine.scaling import Repartitioner
from coordinator.engine.transports.grpc import GrpcPipeline, encode
from coordinator.frontends.server import start, start_http
from coordinator.frontends.service import Coordinator, GenerateInput
from helpers.reference import hf_greedy
from helpers.stage_servers import stage_servers
from helpers.wait import wait_until, wait_until_empty
from common.batch import Control, MicroBatch, Segment
from common.sampling import Sampling


def failures(outcome: str) -> float:
    return REGISTRY.get_sample_value("specpipe_stage_failures_total", {"outcome": outcome}) or 0.0


async def collect(coord: Coordinator, prompt: list[int], n: int, method: str = "pp") -> list[int]:
    out: list[int] = []
    async for chunk in coord.generate(GenerateInput(prompt_token_ids=prompt, max_new_tokens=n, method=method,
                                                    ignore_eos=True)):
        out += chunk.token_ids
    return out


def test_a_segment_that_cannot_be_encoded_travels_as_a_failed_segment():
    ok = Segment("r1", [0], [-1], [0], [5], [True])
    bad = Segment("r2", [0], [-1], [0], [5], [True], sampling=Sampling(1.0, 1.0, 2 ** 32, 7))
    msg = encode(MicroBatch(3, [ok, bad]))
    assert [s.request_id for s in msg.segments] == ["r1", "r2"]
    assert list(msg.segments[0].token_ids) == [5] and not msg.segments[0].error
    assert not msg.segments[1].node_ids and msg.segments[1].error_code == 3
    assert "cannot be sent to the stages" in msg.segments[1].error and msg.segments[1].error_stage == -1


@pytest.mark.grpc
async def test_writes_under_way_when_a_just_opened_pipeline_is_aborted_end_at_once(tiny_model):
    """A failure right after a recovery opened a pipeline (a stage that flaps): the engine's first injection and
    broadcast are being written while the pipeline is aborted. They end with an error at once; before, a write
    that waited for its stream's metadata never woke, and the engine's suspend waited for it for ever."""
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        for attempt in range(3):
            pipeline = GrpcPipeline(list(addrs), probe_interval_s=0)
            await pipeline.start()
            writes = [asyncio.create_task(pipeline.inject(MicroBatch(attempt, [Segment("r", [0], [-1], [0], [5],
                                                                                         [True])]))),
                      asyncio.create_task(pipeline.broadcast(Control("r", release=True)))]
            await asyncio.sleep(0)              # both writes start before the abort
            await pipeline.abort()
            done, _ = await asyncio.wait(writes, timeout=10)
            assert len(done) == 2, f"a write still waits after the abort (attempt {attempt})"


@pytest.mark.grpc
async def test_a_bad_field_fails_only_its_request_and_never_the_pipeline(tiny_model, tiny_hf):
    """The reported bug: top_k 2**32 passed validation, failed serialisation, and made the pipeline recover
    twice. Now the door refuses it (HTTP 400 naming the field), and a value that slips past the door anyway
    (submitted to the engine directly) fails only its own request, next to a valid one in the same batches."""
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        cfg = CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), port=0, recovery_timeout_s=30,
                                probe_interval_s=0, max_new_tokens_cap=64, default_max_new_tokens=8)
        server, coord = await start(cfg)
        http = await start_http(cfg, coord, port=0)
        before = failures("recovered") + failures("gave_up") + failures("failed")
        try:
            url = f"http://127.0.0.1:{http.port}/v1/completions"
            async with aiohttp.ClientSession() as session:
                for field, value in (("top_k", 2 ** 32), ("seed", 2 ** 64), ("temperature", 1e39),
                                     ("max_tokens", 2 ** 40), ("prompt", [3, 10 ** 9])):
                    body = {"model": tiny_model.name, "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0.5, field: value}
                    async with session.post(url, json=body) as resp:
                        text = await resp.text()
                        assert resp.status == 400, (field, text)
                        assert field.replace("max_tokens", "max_new_tokens").replace("prompt", "token id") in text

            engine = coord.engine
            good = asyncio.create_task(collect(coord, [7, 8, 9], 12, method="cb-pp"))
            rid, events = await engine.submit([3, 4, 5], 12, "cb-pp", sampling=Sampling(1.0, 1.0, 2 ** 32, 7))
            fin = await events.get()
            while isinstance(fin, Tokens):
                fin = await events.get()
            assert isinstance(fin, Finish) and fin.reason is FinishReason.ERROR
            assert fin.error_code is Status.INVALID_ARGUMENT and "cannot be sent to the stages" in fin.error
            assert await good == hf_greedy(tiny_hf, [7, 8, 9], 12)
            assert await collect(coord, [1, 2], 6) == hf_greedy(tiny_hf, [1, 2], 6)
            assert failures("recovered") + failures("gave_up") + failures("failed") == before
            assert coord.recovery is not None and not coord.recovery.running
        finally:
            await http.stop()
            await server.stop(0)
            await coord.close()


class DroppingPipeline(GrpcPipeline):
    """Loses the 4th micro-batch of the first pipeline opened (a stage that dropped it, or a stream that
    reset after accepting it): the coordinator is never told."""
    opened = 0

    async def start(self) -> None:
        DroppingPipeline.opened += 1
        self._drop_at = 4 if DroppingPipeline.opened == 1 else 0
        self._sent = 0
        await super().start()

    async def inject(self, batch: MicroBatch) -> None:
        self._sent += 1
        if self._sent != self._drop_at:
            await super().inject(batch)


@pytest.mark.grpc
async def test_a_lost_micro_batch_is_recovered_within_the_bound(tiny_model, tiny_hf, monkeypatch):
    monkeypatch.setattr("coordinator.frontends.service.GrpcPipeline", DroppingPipeline)
    DroppingPipeline.opened = 0
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model),
                                                            recovery_timeout_s=30, probe_interval_s=0,
                                                            batch_timeout_s=1.0))
        recovered = failures("recovered")
        try:
            out = await asyncio.wait_for(collect(coord, [4, 5, 6], 10), timeout=60)
            assert out == hf_greedy(tiny_hf, [4, 5, 6], 10)
            assert DroppingPipeline.opened == 2 and failures("recovered") == recovered + 1
        finally:
            await coord.close()


@pytest.mark.grpc
async def test_a_stage_whose_compute_hangs_is_found_while_its_health_still_answers(tiny_model, tiny_hf):
    async with stage_servers(str(tiny_model), 2) as (addrs, servicers):
        coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model),
                                                            recovery_timeout_s=30, probe_interval_s=0.2,
                                                            batch_timeout_s=1.0))
        runner = servicers[1].runner
        step, hang, calls = runner.step, threading.Event(), [0]

        def hanging_step(batch):
            calls[0] += 1
            if calls[0] == 3:
                hang.wait(60)                   # the stage's compute hangs; its health servicer answers
            return step(batch)

        runner.step = hanging_step
        recovered = failures("recovered")
        try:
            task = asyncio.create_task(collect(coord, [4, 5, 6], 10))
            await wait_until(lambda: coord.recovery.running or failures("recovered") > recovered, what="recovery")
            hang.set()                          # the stage is well again: the recovery reconnects
            assert await asyncio.wait_for(task, timeout=60) == hf_greedy(tiny_hf, [4, 5, 6], 10)
            assert failures("recovered") == recovered + 1
        finally:
            hang.set()
            await coord.close()


@pytest.mark.grpc
async def test_a_repartition_drains_for_at_most_the_drain_timeout(tiny_model8, tiny_hf8):
    """A long request does not pause a re-partition for its whole length: after --drain-timeout-s it moves onto
    the new pipeline (prompt + what it streamed) and its output stays exact; nothing is left on the stages."""
    async with stage_servers(str(tiny_model8), 3, stage_time_ms="30") as (addrs, servicers):
        coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model8),
                                                            recovery_timeout_s=30, probe_interval_s=0,
                                                            drain_timeout_s=0.5, max_new_tokens_cap=128))
        rep = Repartitioner(coord, lambda i: addrs[i])
        try:
            got: list[int] = []

            async def run() -> None:
                async for c in coord.generate(GenerateInput(prompt_token_ids=[4, 5, 6], max_new_tokens=80,
                                                            method="pp", ignore_eos=True)):
                    got.extend(c.token_ids)

            running = asyncio.create_task(run())
            await wait_until(lambda: len(got) >= 2, what="first tokens")
            await asyncio.wait_for(rep.scale(2), timeout=30)
            assert not running.done()           # moved, not drained: 80 tokens take ~7 s at 3 x 30 ms
            assert coord.pipeline.num_stages == 2
            await asyncio.wait_for(running, timeout=90)
            assert got == hf_greedy(tiny_hf8, [4, 5, 6], 80)
            await wait_until(lambda: not any(s.runner.cache.requests for s in servicers[:2]), what="stages empty")
        finally:
            await coord.close()


@pytest.mark.grpc
async def test_a_last_stage_answering_wrongly_over_grpc_fails_those_requests_only(tiny_model, tiny_hf):
    """A stage double over real gRPC: the last stage's runner answers one micro-batch of request `wrong-id`
    with another request's id, one of `few-rows` with a token too few, and one of `nan` (speculating, sampled,
    verified by rejection: its micro-batches ship log-probabilities) with NaN log-probabilities. Each of the
    three fails with INTERNAL naming the fault; two requests beside them are token-identical to transformers;
    no recovery runs and no stage keeps anything."""
    async with stage_servers(str(tiny_model), 2) as (addrs, servicers):
        runner = servicers[-1].runner
        step, spoilt = runner.step, set()

        def answer_wrongly(batch: MicroBatch) -> MicroBatch:
            out = step(batch)
            rids = [s.request_id for s in out.segments]
            victim = next((r for r in ("wrong-id", "few-rows", "nan") if r in rids and r not in spoilt), None)
            if victim == "wrong-id":
                out.segments = [Segment("someone-else", s.node_ids, s.parent_ids, s.positions, s.token_ids,
                                        s.want_output) if s.request_id == victim else s for s in out.segments]
            elif victim == "few-rows" and out.argmax:
                out.argmax = list(out.argmax)[:-1]
            elif victim == "nan" and out.logprobs is not None and out.logprobs.numel():
                out.logprobs = torch.full_like(out.logprobs, float("nan"))
            else:
                return out
            spoilt.add(victim)
            return out
        runner.step = answer_wrongly
        cfg = CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), port=0, recovery_timeout_s=30,
                                probe_interval_s=0, verify="rejection")
        coord = await Coordinator.connect(cfg)
        before = failures("recovered") + failures("gave_up") + failures("failed")
        pinned = {"width": 4, "topk": 2, "draft_rounds": 1}      # speculating whatever the cost rule would say

        async def run(rid: str, prompt: list[int], **kw) -> tuple[list[int], FinishReason | None, str]:
            tokens, reason, error = [], None, ""
            try:
                async for chunk in coord.generate(GenerateInput(prompt_token_ids=prompt, max_new_tokens=10,
                                                                ignore_eos=True, request_id=rid, **kw)):
                    tokens += chunk.token_ids
                    reason = chunk.finish_reason or reason
            except Exception as e:                      # the API's error for a failed request
                reason, error = FinishReason.ERROR, str(e)
            return tokens, reason, error
        try:
            runs = await asyncio.wait_for(asyncio.gather(
                run("wrong-id", [3, 4, 5], method="pp"), run("few-rows", [6, 7], method="cb-pp"),
                run("nan", [8, 9, 10], method="specpipe", temperature=0.8, seed=5, spec_overrides=pinned),
                run("good-pp", [11, 12], method="pp"),
                run("good-spec", [13, 14, 15], method="specpipe", spec_overrides=pinned)), timeout=120)
            out = dict(zip(["wrong-id", "few-rows", "nan", "good-pp", "good-spec"], runs))
            assert spoilt == {"wrong-id", "few-rows", "nan"}
            for rid, fault in (("wrong-id", "someone-else"), ("few-rows", "tokens"), ("nan", "NaN")):
                assert out[rid][1] is FinishReason.ERROR and fault in out[rid][2], (rid, out[rid])
            assert out["good-pp"][0] == hf_greedy(tiny_hf, [11, 12], 10)
            assert out["good-spec"][0] == hf_greedy(tiny_hf, [13, 14, 15], 10)
            assert failures("recovered") + failures("gave_up") + failures("failed") == before
            await wait_until_empty(addrs, coord)
        finally:
            await coord.close()
