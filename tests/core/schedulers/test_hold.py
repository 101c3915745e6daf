"""A finished request's slot is held for the next prompt (coordinator/core/schedulers/batching.py, rule 4):
until the next event, a result that ended a request leaves its slot empty; a request that arrives takes it,
otherwise the next result refills it beside its own; the scheduler holds only while requests have tended to
follow finishes. Outputs stay exact and nothing is left; cb-pp does not hold."""
from __future__ import annotations

import pytest

from common.batch import MicroBatch
from common.sampling import Sampling

from coordinator.core.schedulers.base import Finish, Request
from coordinator.core.schedulers.batching import FollowRate
from coordinator.core.schedulers.cbpp import CBPPScheduler
from coordinator.core.schedulers.specpipe import SpecPipeScheduler
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.by_hand import back, injected, rows_of
from helpers.drafts import make_draft
from helpers.leftovers import assert_nothing_left
from helpers.reference import hf_greedy, prompts, reference_sample
from helpers.shard import make_runners


class Holding(CBPPScheduler):
    """cb-pp's plain rows, so the rule can be followed by hand, with the hold switched on as in specpipe."""
    holds_finished_slot = True


def two_in_flight(sched) -> tuple[MicroBatch, MicroBatch]:
    """S = 2. A (2 new tokens) and B fill the pipeline, C's prompt waits; A's first result carries A's next row
    and C's prompt (m3), B's its next row (m4). Returns (m3, m4): m3 ends A and gives C its first token."""
    sched.add(Request("A", [1, 2, 3], 2))
    sched.add(Request("B", [4, 5, 6], 5))
    sched.add(Request("C", [7, 8], 5))
    m1, m2 = injected(sched)
    (m3,) = back(sched, m1)
    assert rows_of(m3) == {"A": [3], "C": [0, 1]}
    (m4,) = back(sched, m2)
    assert rows_of(m4) == {"B": [3]}
    return m3, m4


def test_a_finished_requests_slot_waits_for_the_next_prompt():
    """m3 ends A (its second token) while m4 is in flight: C's first decode row stays back. D arrives and goes
    in at once with it, into the slot that would otherwise hold C's row alone."""
    sched = Holding(2, node_budget=8, prefill_chunk=8)
    m3, _ = two_in_flight(sched)
    assert back(sched, m3) == [] and sched.holding and sched.in_flight == 1
    sched.add(Request("D", [10, 11, 12], 5))
    (m5,) = injected(sched)
    assert rows_of(m5) == {"C": [2], "D": [0, 1, 2]} and not sched.holding and sched.in_flight == 2
    assert (sched.follow.followed, sched.follow.seen) == (1.0, 1.0), "a finish a request followed"
    assert (sched.holds_taken, sched.holds_lapsed) == (1, 0)


def test_when_no_prompt_comes_the_next_result_refills_both_slots():
    sched = Holding(2, node_budget=8, prefill_chunk=8)
    m3, m4 = two_in_flight(sched)
    assert back(sched, m3) == [] and sched.holding
    m5, m6 = back(sched, m4)        # cb-pp's decode cap: ceil(2 running / 2 stages) = 1 row per micro-batch
    assert sorted(list(rows_of(m)) for m in (m5, m6)) == [["B"], ["C"]]
    assert not sched.holding and sched.in_flight == 2
    assert (sched.follow.followed, sched.follow.seen) == (0.0, 1.0), "a finish no request followed"
    assert (sched.holds_taken, sched.holds_lapsed) == (0, 1)


def test_follow_rate_worked_example():
    rate = FollowRate(decay=0.8)
    assert rate.rate == 0.5 and rate.pays
    rate.observe(False)
    rate.observe(False)
    assert rate.rate == pytest.approx(1 / 3.8) and not rate.pays
    rate.observe(True)
    rate.observe(True)
    assert (rate.followed, rate.seen) == (pytest.approx(1.8), pytest.approx(2.952))
    assert rate.rate == pytest.approx(2.8 / 4.952) and rate.pays


def test_finishes_that_no_request_follows_stop_the_hold_and_followed_ones_count_while_not_holding():
    """After two unfollowed finishes the slot is refilled at once (C's row goes in), but the scheduler still
    watches: D arriving before the next result counts as followed."""
    sched = Holding(2, node_budget=8, prefill_chunk=8)
    sched.follow.observe(False)
    sched.follow.observe(False)
    m3, _ = two_in_flight(sched)
    (m5,) = back(sched, m3)
    assert rows_of(m5) == {"C": [2]} and not sched.holding
    sched.add(Request("D", [10, 11, 12], 5))
    assert (sched.follow.followed, sched.follow.seen) == (1.0, pytest.approx(2.44))


def test_cb_pp_does_not_hold():
    sched = CBPPScheduler(2, node_budget=8, prefill_chunk=8)
    m3, _ = two_in_flight(sched)
    (m5,) = back(sched, m3)
    assert rows_of(m5) == {"C": [2]} and not sched.holding


def test_a_waiting_prompt_takes_the_slot_at_once():
    """A prompt already waiting is what the slot is held for: it goes in with the result that ended A."""
    sched = Holding(2, node_budget=8, prefill_chunk=8)
    sched.add(Request("A", [1, 2, 3], 1))
    sched.add(Request("B", [4, 5, 6], 5))
    sched.add(Request("C", [7, 8], 5))
    m1, _ = injected(sched)
    (m3,) = back(sched, m1)                    # A's one token: A ends
    assert rows_of(m3) == {"C": [0, 1]} and sched.in_flight == 2


def test_no_hold_without_a_result_in_flight_to_end_it():
    """S = 1: the result that ends A is the only micro-batch; holding would leave C's row with nothing to wake
    it, so it goes in."""
    sched = Holding(1, node_budget=8, prefill_chunk=8)
    sched.add(Request("A", [1, 2, 3], 2))
    sched.add(Request("C", [7, 8], 5))
    (m1,) = injected(sched)
    (m2,) = back(sched, m1)
    assert rows_of(m2) == {"A": [3], "C": [0, 1]}
    (m3,) = back(sched, m2)                    # A's second token ends it; C's first token
    assert rows_of(m3) == {"C": [2]} and not sched.holding


def test_a_cancelled_request_does_not_hold():
    """A cancel is the client leaving, not a turn ending: when A's micro-batch comes back, C's row goes in."""
    sched = Holding(2, node_budget=8, prefill_chunk=8)
    m3, _ = two_in_flight(sched)
    sched.cancel("A")
    assert not sched.holding
    (m5,) = back(sched, m3)
    assert rows_of(m5) == {"C": [2]} and not sched.holding


@pytest.mark.parametrize("method", ["specpipe", pytest.param("cb-pp", marks=pytest.mark.slow)])
def test_a_closed_loop_through_held_slots_is_exact(tiny_model8, tiny_hf8, method):
    """Three clients (S = 4), each sending its next request the moment its last one ends, 12 requests in all,
    prompts up to 3 chunks, every third one sampled with its own seed, one cancelled mid-stream. specpipe: a
    slot was held, and every prompt that arrived while one was took it (the hold ended as it went in);
    cb-pp never holds. Every output is its greedy output alone, or exactly plain seeded sampling from the
    target; no state is left."""
    S, clients = 4, 3
    runners = make_runners(tiny_model8, S, layers=8)
    draft = make_draft("quant", tiny_model8, None) if method == "specpipe" else None
    sched = CBPPScheduler(S, node_budget=12, prefill_chunk=5) if method == "cb-pp" else \
        SpecPipeScheduler(S, draft, width=4, node_budget=12, prefill_chunk=5)
    sampling = {f"r{i}": Sampling(0.8, top_p=0.9, top_k=30, seed=900 + i) for i in range(1, 12, 3)}
    reqs = [Request(f"r{i}", p, 6 + 3 * (i % 4), sampling=sampling.get(f"r{i}", Sampling()))
            for i, p in enumerate(prompts(12, seed=5, low=3))]
    later = list(reqs[clients:])
    into_held: list[str] = []         # requests that arrived while a slot was held
    ended: list[str] = []
    poll = sched.poll

    def recorded():
        actions = poll()
        ended.extend(a.request_id for a in actions if isinstance(a, Finish))
        return actions
    sched.poll = recorded

    def closed_loop() -> None:        # after every pipeline step: each request that ended is followed at once
        while len(sched.requests) < clients and later:
            r = later.pop(0)
            held, before = sched.holding, sched.in_flight
            sched.add(r)
            if held:
                into_held.append(r.request_id)
                assert not sched.holding and sched.in_flight == before + 1, "the prompt took the held slot"
            if r.request_id == "r7":
                sched.cancel("r6")   # a request cancelled mid-stream when another arrives
    out = InProcessPipeline(runners).run(sched, reqs, on_tick=closed_loop,
                                         arrive={r.request_id: 0 if i < clients else 10 ** 9
                                                 for i, r in enumerate(reqs)})
    for r in reqs:
        o = out[r.request_id]
        if r.request_id == "r6" and o.reason == "cancelled":
            continue
        want = reference_sample(tiny_hf8, r.prompt_ids, r.max_new_tokens, r.sampling) \
            if r.request_id in sampling else hf_greedy(tiny_hf8, r.prompt_ids, r.max_new_tokens)
        assert o.reason == "length" and o.tokens == want, r.request_id
    assert not later and len(ended) == len(reqs)
    if method == "specpipe":
        assert len(into_held) >= 3, "prompts arrived into held slots"
    else:
        assert into_held == []
    assert any(len(r.prompt_ids) > 5 for r in reqs), "a prompt longer than a chunk"
    assert_nothing_left(sched, runners, draft)


class HoldingOvertaking(Holding):
    overtakes = True        # as specpipe: a new prompt's first chunk may go in beyond a full pipeline


def test_no_hold_while_an_overtaker_fills_the_pipeline():
    """S = 2, A and B fill the pipeline, C's prompt overtakes (3 in flight). A's result ends A, leaving 2 in
    flight: no slot is free, so none is held (a hold would count a lapse or a take that never was)."""
    sched = HoldingOvertaking(2, node_budget=8, prefill_chunk=8)
    sched.add(Request("A", [1, 2, 3], 1))
    sched.add(Request("B", [4, 5, 6], 5))
    m1, _ = injected(sched)
    sched.add(Request("C", [7, 8], 5))
    (m3,) = injected(sched)
    assert rows_of(m3) == {"C": [0, 1]} and sched.in_flight == 3
    assert back(sched, m1) == [] and sched.in_flight == 2   # A's one token ends it; the pipeline is full
    assert not sched.holding
    sched.add(Request("D", [10, 11, 12], 5))
    assert injected(sched) == [] and (sched.holds_taken, sched.holds_lapsed) == (0, 0)
