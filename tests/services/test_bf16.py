"""bf16 said honestly (issue 17): in fp32 a request's output does not depend on what it is batched with; in
bf16 a row's bits may depend on the batch shape (floating-point reassociation), so greedy output can flip at
near-ties. This test measures how often, on CPU: each of 16 requests alone against all 16 in one pipeline
(cb-pp: their rows share every micro-batch). The rate is reported as the test's property
`bf16_divergence_rate` (pytest --junitxml) and printed."""
from __future__ import annotations

import torch

from coordinator.core.schedulers.base import Request
from coordinator.core.schedulers.cbpp import CBPPScheduler
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.reference import prompts
from services.model.shard import even_split, load_shard
from services.runner import StageRunner


def outputs(model, dtype: torch.dtype, reqs: list[Request], together: bool) -> dict[str, list[int]]:
    runners = [StageRunner(load_shard(str(model), a, b, dtype, "cpu"), i) for i, (a, b) in enumerate(even_split(8, 2))]
    if together:
        out = InProcessPipeline(runners).run(CBPPScheduler(2, node_budget=64), reqs)
        return {rid: o.tokens for rid, o in out.items()}
    got = {}
    for r in reqs:
        got.update({rid: o.tokens for rid, o in InProcessPipeline(runners).run(CBPPScheduler(2), [r]).items()})
    return got


def test_bf16_output_at_concurrency_1_and_16(tiny_model8, record_property):
    reqs = [Request(f"r{i}", p, 16) for i, p in enumerate(prompts(16, seed=11))]
    fp32 = (outputs(tiny_model8, torch.float32, reqs, False), outputs(tiny_model8, torch.float32, reqs, True))
    assert fp32[0] == fp32[1]                                     # fp32: exact whatever the batch
    alone, batched = outputs(tiny_model8, torch.bfloat16, reqs, False), outputs(tiny_model8, torch.bfloat16, reqs, True)
    assert all(len(alone[r.request_id]) == len(batched[r.request_id]) == 16 for r in reqs)
    diverged = [r.request_id for r in reqs if alone[r.request_id] != batched[r.request_id]]
    rate = len(diverged) / len(reqs)
    record_property("bf16_divergence_rate", rate)
    print(f"bf16 greedy, 16 requests x 16 tokens, concurrency 1 vs 16: {len(diverged)} of 16 diverge ({rate:.0%})")
    # a divergence starts at a near-tie and the rest follows; most requests never meet one
    assert rate <= 0.5, diverged
    agree_first = sum(alone[r.request_id][0] == batched[r.request_id][0] for r in reqs)
    assert agree_first >= 12                                      # the first token comes from one prefill row
