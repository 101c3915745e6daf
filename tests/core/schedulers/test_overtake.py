"""A prompt overtakes a full pipeline of speculation (coordinator/core/schedulers/batching.py, rule 3): its
first chunk goes in at once as micro-batch S + 1, one such micro-batch at a time, and outputs stay exact;
cb-pp does not overtake."""
from __future__ import annotations

import pytest

from common.sampling import Sampling

from coordinator.core.schedulers.base import Inject, Request
from coordinator.core.schedulers.cbpp import CBPPScheduler
from coordinator.core.schedulers.specpipe import SpecPipeScheduler
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.by_hand import back, injected, rows_of
from helpers.drafts import make_draft
from helpers.leftovers import assert_nothing_left
from helpers.reference import hf_greedy, prompts, reference_sample
from helpers.shard import make_runners


class Overtaking(CBPPScheduler):
    """cb-pp's plain rows, so the rule can be followed by hand, with overtaking switched on as in specpipe."""
    overtakes = True


def test_a_fresh_prompt_overtakes_a_full_pipeline_and_one_overtaker_is_in_flight_at_a_time():
    """S = 2, prefill chunk 6. A and B fill the pipeline; C (10 tokens) goes in at once, alone, with
    its first 6 rows; D waits while C's micro-batch is in flight; A's result is not refilled (the pipeline is
    full again); B's result frees a slot for one decode row, C's last 4 rows and D's 2 rows."""
    sched = Overtaking(2, node_budget=8, prefill_chunk=6)
    sched.add(Request("A", [1, 2, 3], 5))
    sched.add(Request("B", [4, 5, 6], 5))
    a, b = injected(sched)
    assert (rows_of(a), rows_of(b)) == ({"A": [0, 1, 2]}, {"B": [0, 1, 2]})
    sched.add(Request("C", list(range(20, 30)), 5))
    (c,) = injected(sched)
    assert rows_of(c) == {"C": [0, 1, 2, 3, 4, 5]} and sched.in_flight == 3
    sched.add(Request("D", [7, 8], 5))
    assert injected(sched) == [] and sched.in_flight == 3, "one overtaking micro-batch at a time"
    assert back(sched, a) == [] and sched.in_flight == 2, "the pipeline is full again: no refill"
    (d,) = back(sched, b)
    assert {k: v for k, v in rows_of(d).items() if k in "CD"} == {"C": [6, 7, 8, 9], "D": [0, 1]}
    assert sum(k in "AB" for k in rows_of(d)) == 1, "cb-pp's decode cap: ceil(2 running / 2 stages) = 1"
    assert sched.in_flight == 2
    (first,) = [k for k in rows_of(d) if k in "AB"]
    (e,) = back(sched, c)          # C's first chunk had no output row; its slot goes to the other decode row
    assert list(rows_of(e)) == ["B" if first == "A" else "A"]


def test_only_a_prompt_that_has_not_started_overtakes():
    """A prompt whose first chunk is in flight continues through ordinary slots, not by overtaking."""
    sched = Overtaking(1, node_budget=8, prefill_chunk=4)
    sched.add(Request("A", list(range(1, 11)), 3))     # 10 tokens: chunks 0..3, 4..7, 8..9
    (a1,) = injected(sched)
    assert rows_of(a1) == {"A": [0, 1, 2, 3]}
    assert injected(sched) == [] and sched.in_flight == 1, "A's second chunk waits for the slot"
    (a2,) = back(sched, a1)
    assert rows_of(a2) == {"A": [4, 5, 6, 7]}


def test_cb_pp_does_not_overtake():
    sched = CBPPScheduler(1, node_budget=8, prefill_chunk=4)
    sched.add(Request("A", [1, 2, 3], 3))
    sched.add(Request("B", [4, 5, 6], 3))
    assert len(injected(sched)) == 1 and sched.in_flight == 1


@pytest.mark.parametrize("method", ["specpipe", pytest.param("cb-pp", marks=pytest.mark.slow)])
def test_overtaking_prompts_under_staggered_arrivals_and_cancellations_are_exact(tiny_model8, tiny_hf8, method):
    """12 requests arrive into a full pipeline (S = 4), prompts up to 3 chunks, every third one sampled with
    its own seed. specpipe: some micro-batch overtook (S + 1 in flight, never more), a sampled request's among
    them, and two requests are cancelled one tick after they arrive, while their overtaking micro-batch is in
    the pipeline; cb-pp (the same arrivals): never more than S. Every other output is its greedy output alone,
    or exactly plain seeded sampling from the target; no state is left. (The arrivals were chosen for a draft
    job per round, `chain=False`: which first chunks overtake depends on when the draft's jobs come back;
    chained rounds under cancellations: tests/core/schedulers/test_draft_beside.py.)"""
    S = 4
    runners = make_runners(tiny_model8, S, layers=8)
    draft = make_draft("quant", tiny_model8, None) if method == "specpipe" else None
    sched = CBPPScheduler(S, node_budget=12, prefill_chunk=5) if method == "cb-pp" else \
        SpecPipeScheduler(S, draft, width=4, node_budget=12, prefill_chunk=5, chain=False)
    depth: list[int] = []             # micro-batches in flight whenever the driver takes the actions
    overtook: set[str] = set()        # requests whose first chunk went in as micro-batch S + 1
    poll = sched.poll

    def recorded():
        actions = poll()
        depth.append(sched.in_flight)
        for a in actions:
            if isinstance(a, Inject) and sched.in_flight == S + 1 and a.batch.batch_id == sched._overtaker:
                overtook.update(seg.request_id for seg in a.batch.segments)
        return actions
    sched.poll = recorded
    sampling = {f"r{i}": Sampling(0.8, top_p=0.9, top_k=30, seed=700 + i) for i in range(1, 12, 3)}
    reqs = [Request(f"r{i}", p, 8 + 3 * (i % 4), sampling=sampling.get(f"r{i}", Sampling()))
            for i, p in enumerate(prompts(12, seed=3, low=3))]
    arrive = {f"r{i}": 3 * i for i in range(12)}
    cancel = {rid: arrive[rid] + 1 for rid in ("r5", "r9")}   # requests whose first chunk overtakes (specpipe)
    out = InProcessPipeline(runners).run(sched, reqs, arrive=arrive, cancel=cancel)
    for r in reqs:
        o = out[r.request_id]
        if r.request_id in cancel:
            assert o.reason == "cancelled" and o.tokens == [], r.request_id
        else:
            want = reference_sample(tiny_hf8, r.prompt_ids, r.max_new_tokens, r.sampling) \
                if r.request_id in sampling else hf_greedy(tiny_hf8, r.prompt_ids, r.max_new_tokens)
            assert o.reason == "length" and o.tokens == want, r.request_id
    if method == "specpipe":
        assert max(depth) == S + 1, "a prompt overtook a full pipeline, and never more than one"
        assert set(cancel) <= overtook, "the cancelled requests were cancelled with their overtaking batch in flight"
        assert overtook & (set(sampling) - set(cancel)), "a sampled request overtook and ran to the end"
    else:
        assert max(depth) == S and not overtook
    assert any(len(r.prompt_ids) > 5 for r in reqs), "a prompt longer than a chunk"
    assert_nothing_left(sched, runners, draft)
