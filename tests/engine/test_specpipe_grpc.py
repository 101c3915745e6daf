"""Speculative methods over real stage processes: exact output, and no stage keeps anything afterwards."""
from __future__ import annotations

import asyncio

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.frontends.service import Coordinator, GenerateInput
from helpers.reference import hf_greedy, prompts
from helpers.stage_servers import local_processes
from helpers.wait import wait_until_released

pytestmark = pytest.mark.grpc

NEW = 20


@pytest.fixture(scope="module")
def pipeline4(tiny_model8):
    with local_processes(str(tiny_model8), 4) as stages:
        yield stages


@pytest.mark.parametrize("method, draft, policy", [("specpipe", "quant", "best-first"), ("specpipe", "ngram", "layer"),
                                                   ("specpipe", "quant", "hybrid"), ("sps", "quant", ""),
                                                   ("tree", "quant", ""), ("pipeinfer", "quant", "")])
async def test_speculative_methods_over_grpc_match_transformers(pipeline4, tiny_model8, tiny_hf8, method, draft,
                                                                policy):
    coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(pipeline4.addresses), model=str(tiny_model8),
                                                        draft=draft, tree_policy=policy or "hybrid", width=4,
                                                        tree_nodes=8, tree_depth=3, topk=4))
    try:
        ps = prompts(3, seed=42)

        async def one(p):
            chunks = [c async for c in coord.generate(GenerateInput(prompt_token_ids=p, max_new_tokens=NEW,
                                                                    method=method, ignore_eos=True))]
            return [t for c in chunks for t in c.token_ids], chunks[-1]

        for p, (ids, last) in zip(ps, await asyncio.gather(*(one(p) for p in ps))):
            assert ids == hf_greedy(tiny_hf8, p, NEW)
            assert last.finish_reason == "length"
            assert last.stats.spec.hits + last.stats.spec.misses == NEW
            assert last.stats.stages[0].rows_computed >= NEW
        await wait_until_released(coord.pipeline, 4)
    finally:
        await coord.close()
