"""Many requests at once (cb-pp, SpecPipe-DB) in-process: exact outputs under staggered arrivals and
cancellations, micro-batches within the node budget, groups and widths as documented, no state left."""
from __future__ import annotations

import pytest

from coordinator.core.drafts.model import ModelDraft
from coordinator.core.schedulers.base import Inject, Request
from coordinator.core.schedulers.cbpp import CBPPScheduler
from coordinator.core.schedulers.specpipe import SpecPipeScheduler
from coordinator.core.stats import SpecCounters
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.drafts import make_draft
from helpers.leftovers import assert_nothing_left
from helpers.reference import hf_greedy, prompts
from helpers.shard import make_runners


class Recording:
    """Wraps a scheduler's poll() to keep every injected micro-batch."""

    def __init__(self, sched) -> None:
        self.batches = []
        poll = sched.poll

        def recorded():
            actions = poll()
            self.batches += [a.batch for a in actions if isinstance(a, Inject)]
            return actions
        sched.poll = recorded


def quant_draft(model) -> ModelDraft:
    return make_draft("quant", model, None)


def staggered(n: int, seed: int, new: list[int]) -> tuple[list[Request], dict[str, int]]:
    ps = prompts(n, seed=seed, low=3)
    reqs = [Request(f"r{i}", p, new[i % len(new)]) for i, p in enumerate(ps)]
    return reqs, {f"r{i}": 2 * i + (i % 3) for i in range(n)}


@pytest.mark.parametrize("method", ["cb-pp", pytest.param("specpipe", marks=pytest.mark.slow)])
def test_sixteen_staggered_requests_with_cancellations_are_exact(tiny_model8, tiny_hf8, method):
    """16 requests of different lengths arrive over 40 pipeline steps; 4 are cancelled mid-stream.
    Every other request produces exactly its greedy output alone; cancelled ones a prefix of it; then no
    scheduler, stage or draft state is left."""
    S = 4
    runners = make_runners(tiny_model8, S, layers=8)
    draft = quant_draft(tiny_model8) if method == "specpipe" else None
    sched = CBPPScheduler(S, node_budget=12) if method == "cb-pp" else \
        SpecPipeScheduler(S, draft, width=4, node_budget=12)
    rec = Recording(sched)
    reqs, arrive = staggered(16, seed=5, new=[6, 14, 9, 20])
    cancelled = {"r2": 12, "r7": 25, "r11": 30, "r15": arrive["r15"] + 6}
    out = InProcessPipeline(runners).run(sched, reqs, arrive=arrive, cancel=cancelled)
    for r in reqs:
        o, want = out[r.request_id], hf_greedy(tiny_hf8, r.prompt_ids, r.max_new_tokens)
        if r.request_id in cancelled:
            assert o.reason == "cancelled" and o.tokens == want[:len(o.tokens)], r.request_id
        else:
            assert o.reason == "length" and o.tokens == want, r.request_id
    assert sum(out[r].reason == "cancelled" and 0 < len(out[r].tokens) for r in cancelled) >= 2, \
        "some cancellations must land mid-stream"
    assert max(len({s.request_id for s in b.segments}) for b in rec.batches) >= 4, "requests share batches"
    assert_nothing_left(sched, runners, draft)


@pytest.mark.slow
def test_micro_batches_stay_within_the_node_budget_and_the_prefill_chunk(tiny_model8, tiny_hf8):
    """Node budget 6, prefill chunk 4, 5 requests with prompts up to 11 tokens: no micro-batch carries more
    than 6 decode rows or more than 4 prompt rows, yet every output is exact."""
    runners = make_runners(tiny_model8, 2, layers=8)
    draft = quant_draft(tiny_model8)
    sched = SpecPipeScheduler(2, draft, width=4, node_budget=6, prefill_chunk=4)
    rec = Recording(sched)
    reqs = [Request(f"r{i}", p, 10) for i, p in enumerate(prompts(5, seed=9))]
    prompt_len = {r.request_id: len(r.prompt_ids) for r in reqs}
    out = InProcessPipeline(runners).run(sched, reqs)
    for r in reqs:
        assert out[r.request_id].tokens == hf_greedy(tiny_hf8, r.prompt_ids, 10)

    def prompt_rows(b) -> int:              # a request's first node ids are its prompt's
        return sum(n < prompt_len[s.request_id] for s in b.segments for n in s.node_ids)
    assert max(prompt_rows(b) for b in rec.batches) == 4
    assert max(b.rows - prompt_rows(b) for b in rec.batches) <= 6
    assert any(len(r.prompt_ids) > 4 for r in reqs), "a prompt longer than the chunk is prefilled in chunks"
    assert_nothing_left(sched, runners, draft)


@pytest.mark.parametrize("method", ["cb-pp", pytest.param("specpipe", marks=pytest.mark.slow)])
def test_a_long_prompt_goes_in_prefill_chunks_not_node_budget_slices(tiny_model8, tiny_hf8, method):
    """A 100-token prompt with node budget 8 and prefill chunk 40: 3 prefill micro-batches (40, 40, 20), not 13."""
    from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
    sched = make_scheduler(method, 2, SpecOptions(quant_draft(tiny_model8), width=4, node_budget=8,
                                                  prefill_chunk=40))
    rec = Recording(sched)
    prompt = [(7 * i + 3) % 250 + 1 for i in range(100)]
    out = InProcessPipeline(make_runners(tiny_model8, 2, layers=8)).run(sched, [Request("r", prompt, 6)])
    assert out["r"].tokens == hf_greedy(tiny_hf8, prompt, 6)
    chunks = [sum(n < 100 for s in b.segments for n in s.node_ids) for b in rec.batches]
    assert [c for c in chunks if c] == [40, 40, 20]


@pytest.mark.slow
def test_width_adapts_to_the_number_of_requests(tiny_model8):
    """Alone a request gets its full width (4); while 4 requests share a budget of 8, each gets 2 rows."""
    def tree_rows(n: int) -> list[list[int]]:
        """Per micro-batch, each request's tree rows (prompt rows left out)."""
        sched = SpecPipeScheduler(4, quant_draft(tiny_model8), width=4, node_budget=8)
        rec = Recording(sched)
        reqs = [Request(f"r{i}", [5 + i, 6, 7], 12) for i in range(n)]
        InProcessPipeline(make_runners(tiny_model8, 4, layers=8)).run(sched, reqs)
        return [[sum(nid >= 3 for nid in s.node_ids) for s in b.segments] for b in rec.batches]
    assert max(max(rows) for rows in tree_rows(1)) == 4
    shared = [rows for rows in tree_rows(4) if len(rows) == 4]
    assert len(shared) > 5 and max(max(rows) for rows in shared) == 2


@pytest.mark.slow
def test_cb_pp_rotates_groups_through_the_stages(tiny_model8, tiny_hf8):
    """8 requests over 4 stages: the pipeline holds 4 micro-batches of 2 requests' next tokens."""
    runners = make_runners(tiny_model8, 4, layers=8)
    sched = CBPPScheduler(4, node_budget=32)
    rec = Recording(sched)
    reqs = [Request(f"r{i}", p, 12) for i, p in enumerate(prompts(8, seed=3))]
    out = InProcessPipeline(runners).run(sched, reqs)
    for r in reqs:
        assert out[r.request_id].tokens == hf_greedy(tiny_hf8, r.prompt_ids, 12)
    decode = [b for b in rec.batches if all(len(s.node_ids) == 1 and s.positions[0] > 0 for s in b.segments)]
    assert decode and max(len(b.segments) for b in decode) == 2
    assert sum(len(b.segments) == 2 for b in decode) > len(decode) // 2
    # each request still commits one token per trip: about S steps per token, as pp
    assert all(out[r.request_id].stats.tokens_per_step <= 1 / 4 + 0.05 for r in reqs)
    assert_nothing_left(sched, runners)


@pytest.mark.parametrize("method", ["pp", "cb-pp", "specpipe", "sps", *(pytest.param(m, marks=pytest.mark.slow)
                                                                   for m in ["tree", "pipeinfer"])])
def test_a_one_token_prompt_works_for_every_method(tiny_model8, tiny_hf8, method):
    """The root of a one-token prompt has no parent (a regression: it was looked up as committed[-2])."""
    from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
    sched = make_scheduler(method, 2, SpecOptions(quant_draft(tiny_model8), width=4))
    out = InProcessPipeline(make_runners(tiny_model8, 2, layers=8)).run(sched, [Request("r", [11], 8)])
    assert out["r"].tokens == hf_greedy(tiny_hf8, [11], 8)


def test_row_value_ranks_shallow_and_reliable_speculation_first():
    """Hand-computed: (hits + 1) / (hits + misses + 2) to the power of the batches in flight."""
    from types import SimpleNamespace
    value = SpecPipeScheduler._row_value
    state = lambda hits, misses, in_flight: SimpleNamespace(  # noqa: E731
        spec=SpecCounters(hits=hits, misses=misses), in_flight=in_flight)
    assert value(None, state(8, 2, 3)) == pytest.approx((9 / 12) ** 3)
    assert value(None, state(8, 2, 0)) == 1.0                       # nothing in flight: sure to count
    assert value(None, state(0, 0, 2)) == pytest.approx(0.25)      # no history: even odds per layer
    ranked = sorted([("deep", state(20, 0, 7)), ("missing", state(2, 8, 1)), ("fresh", state(0, 0, 0))],
                    key=lambda kv: -value(None, kv[1]))
    assert [name for name, _ in ranked] == ["fresh", "deep", "missing"]     # 1.0, (21/22)^7 = 0.72, 0.25


@pytest.mark.slow
def test_under_a_scarce_budget_requests_with_nothing_in_flight_go_first(tiny_model8, tiny_hf8):
    """Budget 4 rows, 6 requests: outputs stay exact, and in every micro-batch the requests' decode rows come
    in the order of their value (a request with nothing in flight first)."""
    runners = make_runners(tiny_model8, 4, layers=8)
    draft = quant_draft(tiny_model8)
    sched = SpecPipeScheduler(4, draft, width=4, node_budget=4, prefill_chunk=64)
    order: list[list[float]] = []
    gather = sched._gather

    def recorded():
        values = {r: sched._row_value(s) for r, s in sched.requests.items()}
        prefilling = set(sched.prefill_next)
        segs = gather()
        order.append([values[s.request_id] for s in segs if s.request_id not in prefilling])   # decode rows
        return segs
    sched._gather = recorded
    reqs = [Request(f"r{i}", p, 10) for i, p in enumerate(prompts(6, seed=13))]
    out = InProcessPipeline(runners).run(sched, reqs)
    for r in reqs:
        assert out[r.request_id].tokens == hf_greedy(tiny_hf8, r.prompt_ids, 10)
    assert all(vals == sorted(vals, reverse=True) for vals in order)     # highest value first
    assert_nothing_left(sched, runners, draft)


@pytest.mark.parametrize("method", ["cb-pp", pytest.param("specpipe", marks=pytest.mark.slow)])
def test_mixed_greedy_and_seeded_requests_under_a_binding_budget_are_exact(tiny_model8, tiny_hf8, method):
    """10 requests, every other one sampled with its own seed, arriving over 20 steps under a budget of 6
    rows (binding: fewer rows than requests) and prefill chunks of 4 (most prompts need two or three);
    2 are cancelled. Greedy requests give transformers' greedy output, sampled ones exactly plain seeded
    sampling from the target, cancelled ones a prefix; then nothing is left."""
    from helpers.reference import reference_sample
    from common.sampling import Sampling

    S = 4
    runners = make_runners(tiny_model8, S, layers=8)
    draft = quant_draft(tiny_model8) if method == "specpipe" else None
    sched = CBPPScheduler(S, node_budget=6, prefill_chunk=4) if method == "cb-pp" else \
        SpecPipeScheduler(S, draft, width=4, node_budget=6, prefill_chunk=4)
    rec = Recording(sched)
    ps = prompts(10, seed=21, low=3)
    sampling = {f"r{i}": Sampling(0.8, top_p=0.9, top_k=30, seed=500 + i) for i in range(1, 10, 2)}
    reqs = [Request(f"r{i}", p, 10, sampling=sampling.get(f"r{i}", Sampling())) for i, p in enumerate(ps)]
    arrive = {f"r{i}": 2 * i for i in range(10)}
    cancelled = {"r4": arrive["r4"] + 7, "r5": arrive["r5"] + 6}
    out = InProcessPipeline(runners).run(sched, reqs, arrive=arrive, cancel=cancelled)
    assert sum(len(p) > 4 for p in ps) >= 5, "prompts longer than a chunk"
    for r in reqs:
        want = reference_sample(tiny_hf8, r.prompt_ids, 10, r.sampling) if r.request_id in sampling else \
            hf_greedy(tiny_hf8, r.prompt_ids, 10)
        o = out[r.request_id]
        if r.request_id in cancelled:
            assert o.reason == "cancelled" and o.tokens == want[:len(o.tokens)], r.request_id
        else:
            assert o.reason == "length" and o.tokens == want, r.request_id
    prompt_len = {r.request_id: len(r.prompt_ids) for r in reqs}
    decode = [sum(s.rows for s in b.segments if not any(p < prompt_len[s.request_id] for p in s.positions))
              for b in rec.batches]
    assert max(decode) <= 6, "decode rows stay within the budget"
    assert max(len({s.request_id for s in b.segments}) for b in rec.batches) >= 3, "requests share batches"
    assert_nothing_left(sched, runners, draft)


def test_a_micro_batch_carrying_a_prompt_keeps_specpipe_rows_to_one_per_request(tiny_model8, tiny_hf8):
    """Staggered arrivals, budget 12, width 4: every micro-batch that carries prompt rows holds at most one
    row of each running request (a prompt's trip is not slowed by deep speculation), others may hold more;
    outputs stay exact."""
    S = 4
    runners = make_runners(tiny_model8, S, layers=8)
    draft = quant_draft(tiny_model8)
    sched = SpecPipeScheduler(S, draft, width=4, node_budget=12)
    rec = Recording(sched)
    reqs, arrive = staggered(8, seed=9, new=[12, 16])
    prompt_of = {r.request_id: r.prompt_ids for r in reqs}
    out = InProcessPipeline(runners).run(sched, reqs, arrive=arrive)
    for r in reqs:
        assert out[r.request_id].tokens == hf_greedy(tiny_hf8, r.prompt_ids, r.max_new_tokens), r.request_id

    def is_prompt(seg) -> bool:
        return min(seg.positions) < len(prompt_of[seg.request_id]) - 1

    with_prompt = [b for b in rec.batches if any(is_prompt(s) for s in b.segments)]
    decode_rows = [[s.rows for s in b.segments if not is_prompt(s)] for b in with_prompt]
    assert with_prompt and any(decode_rows), "prompts travelled beside running requests"
    assert all(rows <= 1 for batch in decode_rows for rows in batch)
    assert any(s.rows > 1 for b in rec.batches if b not in with_prompt for s in b.segments), \
        "without a prompt a request takes more than one row"
    assert_nothing_left(sched, runners, draft)
