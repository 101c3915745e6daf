"""`pp` greedy output equals transformers' greedy decoding: in-process and over gRPC stage processes."""
from __future__ import annotations

import asyncio

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.schedulers.base import Request
from coordinator.core.schedulers.pp import PPScheduler
from coordinator.engine.loops.inprocess import InProcessPipeline
from coordinator.frontends.service import Coordinator, GenerateInput
from helpers.reference import hf_greedy, prompts
from helpers.shard import make_runners
from helpers.stage_servers import local_processes
from helpers.wait import wait_until_released

NEW = 24


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_pp_in_process_matches_transformers(tiny_model, tiny_hf, num_stages):
    runners = make_runners(tiny_model, num_stages)
    ps = prompts(4, seed=num_stages)
    reqs = [Request(f"r{i}", p, NEW) for i, p in enumerate(ps)]
    out = InProcessPipeline(runners).run(PPScheduler(num_stages), reqs)
    for r in reqs:
        assert out[r.request_id].tokens == hf_greedy(tiny_hf, r.prompt_ids, NEW)
        assert out[r.request_id].reason == "length"
    assert all(not r.cache.requests for r in runners), "released requests must leave no state"


def test_pp_steps_per_token_is_num_stages(tiny_model):
    runners = make_runners(tiny_model, 4)
    out = InProcessPipeline(runners).run(PPScheduler(4), [Request("r", [5, 6, 7], 10)])
    assert out["r"].stats.steps == 4 * 10
    assert out["r"].stats.tokens_per_step == pytest.approx(0.25)


def test_pp_stops_at_eos(tiny_model, tiny_hf):
    prompt = [9, 8, 7, 6]
    ref = hf_greedy(tiny_hf, prompt, 8)
    eos = ref[3]
    first = ref.index(eos)
    out = InProcessPipeline(make_runners(tiny_model, 2)).run(
        PPScheduler(2), [Request("r", prompt, 8, frozenset({eos}))])
    assert out["r"].tokens == ref[:first + 1]
    assert out["r"].reason == "eos"


@pytest.fixture(scope="module", params=[1, 2, 4])
def local_pipeline(request, tiny_model):
    with local_processes(str(tiny_model), request.param) as stages:
        yield stages


@pytest.mark.grpc
async def test_pp_over_grpc_matches_transformers(local_pipeline, tiny_model, tiny_hf):
    coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(local_pipeline.addresses),
                                                        model=str(tiny_model)))
    try:
        ps = prompts(3, seed=10 + local_pipeline.num_stages)

        async def one(p):
            ids, last = [], None
            async for chunk in coord.generate(GenerateInput(prompt_token_ids=p, max_new_tokens=NEW,
                                                            method="pp", ignore_eos=True)):
                ids.extend(chunk.token_ids)
                last = chunk
            return ids, last

        results = await asyncio.gather(*(one(p) for p in ps))      # concurrent requests
        for p, (ids, last) in zip(ps, results):
            assert ids == hf_greedy(tiny_hf, p, NEW)
            assert last.finish_reason == "length"
            assert last.stats.steps >= NEW * local_pipeline.num_stages
        await wait_until_released(coord.pipeline, local_pipeline.num_stages)
    finally:
        await coord.close()
