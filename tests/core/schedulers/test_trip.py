"""The baselines `sps` (chain per trip), `tree` (EAGLE-2-style tree per trip) and `pipeinfer` (continuous
asynchronous speculation with early cancellation) are lossless."""
from __future__ import annotations

import pytest

from coordinator.core.schedulers.base import Request
from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.drafts import make_draft
from helpers.reference import hf_greedy, prompts
from helpers.shard import make_runners
from helpers.tiers import matrix

NEW = 16


@pytest.mark.parametrize("draft, method, num_stages", matrix(
    ["quant", "ngram", "right", "wrong"], ["sps", "tree", "pipeinfer"], [1, 2, 4, 8],
    fast=[("wrong", "pipeinfer", 1), ("right", "tree", 2), ("ngram", "sps", 4), ("quant", "sps", 8)]))
def test_trip_methods_match_transformers(tiny_model8, tiny_hf8, tiny_draft_model, num_stages, method, draft):
    runners = make_runners(tiny_model8, num_stages, layers=8)
    spec = SpecOptions(make_draft(draft, tiny_model8, tiny_draft_model), sps_k=3, tree_nodes=12, tree_depth=4,
                       topk=4)
    sched = make_scheduler(method, num_stages, spec)
    ps = prompts(2, seed=100 + num_stages)
    out = InProcessPipeline(runners).run(sched, [Request(f"r{i}", p, NEW) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        o = out[f"r{i}"]
        assert o.tokens == hf_greedy(tiny_hf8, p, NEW), (method, draft, num_stages, i)
        if draft == "wrong":
            assert o.stats.spec.hits == 0
    assert all(not r.cache.requests for r in runners)


def test_sps_with_a_perfect_draft_accepts_whole_chains(tiny_model8):
    spec = SpecOptions(make_draft("right", tiny_model8, None), sps_k=4)
    sched = make_scheduler("sps", 4, spec)
    out = InProcessPipeline(make_runners(tiny_model8, 4, layers=8)).run(sched, [Request("r", [3, 4, 5], 20)])
    s = out["r"].stats
    # every trip commits its k=4 draft tokens plus the target's bonus token: 20 tokens in 4 trips
    assert s.spec.hits == 16 and s.spec.misses == 4 and s.spec.trips == 4
    assert s.steps == 4 * (1 + 4)           # prompt trip + 4 speculation trips, S=4 steps each


def test_one_trip_in_flight_per_request(tiny_model8):
    spec = SpecOptions(make_draft("quant", tiny_model8, None), tree_nodes=8, tree_depth=3, topk=4)
    sched = make_scheduler("tree", 4, spec)
    seen = []
    InProcessPipeline(make_runners(tiny_model8, 4, layers=8)).run(
        sched, [Request("r", [3, 4, 5], 12)], on_tick=lambda: seen.append(sched.requests.get("r") and
                                                                          sched.requests["r"].in_flight))
    assert max(x for x in seen if x is not None) == 1


def test_pipeinfer_keeps_the_pipeline_full_and_cancels_on_a_miss(tiny_model8):
    spec = SpecOptions(make_draft("wrong", tiny_model8, None), pipeinfer_run=2, pipeinfer_min_prob=0.0)
    sched = make_scheduler("pipeinfer", 4, spec)
    runners = make_runners(tiny_model8, 4, layers=8)
    seen = []
    InProcessPipeline(runners).run(sched, [Request("r", [3, 4, 5], 10)],
                                   on_tick=lambda: seen.append(sched.requests["r"].in_flight
                                                               if "r" in sched.requests else 0))
    assert max(seen) == 4                                   # up to S runs in flight, not one
    dropped = sum(r.counters.rows_dropped for r in runners)
    assert dropped > 0                                      # cancelled runs skipped before compute
