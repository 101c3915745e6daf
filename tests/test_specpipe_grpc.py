"""`specpipe` over real stage processes: exact output, and no stage keeps anything afterwards."""
from __future__ import annotations

import asyncio

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.local import LocalStages
from coordinator.service import Coordinator, GenerateInput
from reference import hf_greedy, prompts

NEW = 20


@pytest.fixture(scope="module")
def pipeline4(tiny_model8):
    stages = LocalStages(4, model=str(tiny_model8))
    stages.start()
    try:
        asyncio.run(stages.wait_ready(timeout_s=180))
        yield stages
    finally:
        stages.stop()


@pytest.mark.parametrize("draft, policy", [("quant", "best-first"), ("ngram", "layer")])
async def test_specpipe_over_grpc_matches_transformers(pipeline4, tiny_model8, tiny_hf8, draft, policy):
    coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(pipeline4.addresses), model=str(tiny_model8),
                                                        draft=draft, tree_policy=policy, width=4))
    try:
        ps = prompts(3, seed=42)

        async def one(p):
            chunks = [c async for c in coord.generate(GenerateInput(prompt_token_ids=p, max_new_tokens=NEW,
                                                                    method="specpipe", ignore_eos=True))]
            return [t for c in chunks for t in c.token_ids], chunks[-1]

        for p, (ids, last) in zip(ps, await asyncio.gather(*(one(p) for p in ps))):
            assert ids == hf_greedy(tiny_hf8, p, NEW)
            assert last.finish_reason == "length"
            assert last.stats.get("hits", 0) + last.stats.get("misses", 0) == NEW
            assert last.stats["stage0_rows_computed"] >= NEW
        await asyncio.sleep(0.3)
        for i in range(4):
            info = await coord.pipeline.info(i)
            assert info.active_requests == 0 and info.kv_bytes == 0, f"stage {i} kept state"
    finally:
        await coord.close()
