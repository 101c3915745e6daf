"""Multi-layer micro-batches (issue 14): a row may have its parent in the same micro-batch; prunes that name
such a parent drop or free the child with it; the scheduler's run-ahead, warm restarts, width above the node
budget and the step counters."""
from __future__ import annotations

import pytest
import torch

from coordinator.core.drafts.base import DraftNode, Proposals
from coordinator.core.drafts.model import ModelDraft
from coordinator.core.schedulers.base import Request
from coordinator.core.schedulers.specpipe import SpecPipeScheduler
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.drafts import AlwaysWrong, always_right
from helpers.reference import hf_greedy, prompts
from helpers.shard import chain, make_runners
from common.batch import Control, MicroBatch, Segment
from services.model.shard import load_causal_lm

PREFIX = [11, 12, 13, 14, 15]      # nodes 0..4, committed


def prefilled(tiny_model, stages: int = 2):
    runners = make_runners(tiny_model, stages)
    for r in runners:
        r.apply(Control("r", commit=list(range(5))))
    b = MicroBatch(0, [chain("r", PREFIX, want_all=False)])
    for r in runners:
        b = r.step(b)
    return runners


def run(runners, batch: MicroBatch, prune_first_at: frozenset[int] = frozenset(), prune: list[int] = ()):
    for i, r in enumerate(runners):
        if prune and i in prune_first_at:
            r.apply(Control("r", prune=list(prune)))
        batch = r.step(batch)
        if prune and i not in prune_first_at:
            r.apply(Control("r", prune=list(prune)))
    return batch


def test_a_child_in_its_parents_micro_batch_computes_as_in_the_next_one(tiny_model):
    """Tree 4 -> 5 -> 6 and 4 -> 7: one micro-batch [5, 6, 7] (two layers) against [5, 7] then [6]."""
    together = run(prefilled(tiny_model), MicroBatch(1, [Segment("r", [5, 6, 7], [4, 5, 4], [5, 6, 5], [21, 22, 23],
                                                                 [True] * 3)], return_logprobs=True))
    runners = prefilled(tiny_model)
    first = run(runners, MicroBatch(1, [Segment("r", [5, 7], [4, 4], [5, 5], [21, 23], [True, True])],
                                    return_logprobs=True))
    second = run(runners, MicroBatch(2, [Segment("r", [6], [5], [6], [22], [True])], return_logprobs=True))
    assert together.segments[0].node_ids == [5, 6, 7]
    split = {5: first.logprobs[0], 7: first.logprobs[1], 6: second.logprobs[0]}
    for row, node in enumerate([5, 6, 7]):
        assert torch.allclose(together.logprobs[row], split[node], atol=1e-5)
    assert together.argmax == [int(split[n].argmax()) for n in (5, 6, 7)]


def test_a_prune_between_a_parent_and_its_child_in_one_micro_batch(tiny_model):
    """Prune 5 while the micro-batch [5, 6 (child of 5), 7] travels: a stage that hears of the prune first
    drops 5 and 6 together; one that hears of it after computes both and frees both. Either way only 7's
    output comes back from a stage that dropped them, and every stage ends holding the prefix and 7."""
    batch = MicroBatch(1, [Segment("r", [5, 6, 7], [4, 5, 4], [5, 6, 5], [21, 22, 23], [True] * 3)],
                       return_logprobs=True)
    outs = {}
    for name, first in {"after": frozenset(), "before": frozenset({0, 1}), "between": frozenset({1})}.items():
        runners = prefilled(tiny_model)
        out = run(runners, batch, first, prune=[5])
        held = [sorted(r.cache.requests["r"].slot_of) for r in runners]
        assert held == [[0, 1, 2, 3, 4, 7]] * 2, name
        outs[name] = out
    assert outs["after"].segments[0].node_ids == [5, 6, 7]
    assert outs["before"].segments[0].node_ids == [7]
    assert outs["between"].segments[0].node_ids == [7]        # stage 1 dropped 5 and its child 6
    seven = [o.logprobs[o.segments[0].node_ids.index(7)] for o in outs.values()]
    assert all(torch.allclose(s, seven[0], atol=1e-5) for s in seven)
    # the child of a pruned node is a tombstone too: it can never come back
    runners = prefilled(tiny_model, 1)
    runners[0].apply(Control("r", prune=[5]))
    late = runners[0].step(MicroBatch(2, [Segment("r", [5, 6], [4, 5], [5, 6], [21, 22], [True, True])]))
    assert late.segments[0].node_ids == [] and not late.segments[0].error


class Recording:
    """Wraps stage 0 to record the rows of every micro-batch per request."""

    def __init__(self, runner, held=lambda: 0) -> None:
        self.runner, self.batches, self.held, self.count_held = runner, [], [], held
        self.step_fn = runner.step
        runner.step = self.step

    def step(self, batch: MicroBatch) -> MicroBatch:
        self.batches.append({s.request_id: (list(s.node_ids), list(s.parent_ids)) for s in batch.segments})
        self.held.append(self.count_held())
        return self.step_fn(batch)


@pytest.mark.slow
def test_micro_batches_span_several_layers_and_stay_lossless(tiny_model8, tiny_hf8):
    runners = make_runners(tiny_model8, 4, layers=8)
    rec = Recording(runners[0])
    sched = SpecPipeScheduler(4, always_right(tiny_model8), width=6, policy="hybrid", rounds=2)
    p = prompts(1, seed=5)[0]
    out = InProcessPipeline(runners).run(sched, [Request("r", p, 24)])
    assert out["r"].tokens == hf_greedy(tiny_hf8, p, 24)
    multi = [ids for b in rec.batches if "r" in b for ids, parents in [b["r"]] if set(parents) & set(ids)]
    assert multi, "some micro-batch carries a node together with its parent"
    # the run-ahead keeps a perfect draft at one token per decode step at S = 4; one layer per step lags
    assert out["r"].stats.decode_tokens_per_step >= 1.0
    layer = SpecPipeScheduler(4, always_right(tiny_model8), width=6, policy="layer")
    one = InProcessPipeline(make_runners(tiny_model8, 4, layers=8)).run(layer, [Request("r", p, 24)])["r"]
    assert one.tokens == out["r"].tokens
    assert one.stats.decode_tokens_per_step < out["r"].stats.decode_tokens_per_step
    assert one.stats.spec.lag_steps > out["r"].stats.spec.lag_steps
    assert out["r"].stats.spec.lag_steps <= 4


@pytest.mark.slow
def test_width_above_the_node_budget_for_one_request_and_shared_between_several(tiny_model8, tiny_hf8):
    runners = make_runners(tiny_model8, 2, layers=8)
    rec = Recording(runners[0])
    p = prompts(1, seed=7)[0]
    sched = SpecPipeScheduler(2, always_right(tiny_model8), width=8, policy="best-first", node_budget=3)
    out = InProcessPipeline(runners).run(sched, [Request("r", p, 16)])
    assert out["r"].tokens == hf_greedy(tiny_hf8, p, 16)
    decode = [len(b["r"][0]) for b in rec.batches[1:] if "r" in b]      # after the prompt
    assert max(decode) > 3, "a lone request uses its width, not the budget"
    assert max(decode) <= 8
    runners = make_runners(tiny_model8, 2, layers=8)
    ps = prompts(3, seed=8)
    sched = SpecPipeScheduler(2, always_right(tiny_model8), width=8, policy="best-first", node_budget=3)
    rec = Recording(runners[0], held=lambda: len(sched.requests))
    out = InProcessPipeline(runners).run(sched, [Request(f"r{i}", q, 12) for i, q in enumerate(ps)])
    for i, q in enumerate(ps):
        assert out[f"r{i}"].tokens == hf_greedy(tiny_hf8, q, 12)
    shared = [(rid, ids) for b, held in zip(rec.batches, rec.held) if held == 3 for rid, (ids, _) in b.items()
              if min(ids, default=0) >= len(ps[int(rid[1:])])]            # decode rows while all three are held
    assert shared and all(len(ids) <= 1 for _, ids in shared), "3 requests share a budget of 3: 1 row each"


class SecondRight(ModelDraft):
    """The target as draft with its two best tokens swapped: the right token is always the second child."""

    def __init__(self, model_path) -> None:
        super().__init__(load_causal_lm(str(model_path), torch.float32, "cpu"), name="second")

    def expand_many(self, jobs: list[tuple[str, list[DraftNode]]], k: int) -> list[Proposals | Exception]:
        out = super().expand_many(jobs, max(k, 2))
        return [r if isinstance(r, Exception) else [_swap(p)[:k] for p in r] for r in out]


def _swap(props: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The two best tokens trade places; the scores stay in order (the wrong token looks best)."""
    if len(props) < 2:
        return props
    (t0, s0), (t1, s1) = props[:2]
    return [(t1, s0), (t0, s1)] + props[2:]


def test_warm_restart_re_roots_into_the_proposed_child(tiny_model8, tiny_hf8):
    """One stage, width 1: only the draft's first child goes in, and it is always wrong, but the right token
    is its second child: every miss re-roots into a proposed node (warm) and the output stays exact. (With
    more stages the sibling would go in a step later and hit.)"""
    p = prompts(1, seed=9)[0]
    for policy, warm in (("best-first", True), ("layer", False)):
        sched = SpecPipeScheduler(1, SecondRight(tiny_model8), width=1, topk=2, policy=policy)
        out = InProcessPipeline(make_runners(tiny_model8, 1, layers=8)).run(sched, [Request("r", p, 12)])
        assert out["r"].tokens == hf_greedy(tiny_hf8, p, 12), policy
        stats = out["r"].stats
        assert stats.spec.hits == 0 and stats.spec.misses == 12
        assert (stats.spec.warm_restarts == 12) == warm and (stats.spec.warm_restarts == 0) == (not warm), policy
        assert not sched.trees and not sched.requests


@pytest.mark.slow
def test_counters_split_steps_into_refill_and_lag(tiny_model8, tiny_hf8):
    """An always-wrong draft misses every token: after each miss the micro-batches already in flight are dead
    (refill steps). decode_tokens_per_step is (tokens - 1) / decode_steps."""
    p = prompts(1, seed=3)[0]
    sched = SpecPipeScheduler(4, AlwaysWrong(tiny_model8), width=2, policy="hybrid")
    out = InProcessPipeline(make_runners(tiny_model8, 4, layers=8)).run(sched, [Request("r", p, 10)])
    s = out["r"].stats
    assert out["r"].tokens == hf_greedy(tiny_hf8, p, 10)
    assert s.spec.misses == 10 and s.spec.refill_steps > 0
    assert s.decode_tokens_per_step == (s.tokens - 1) / s.decode_steps
    assert s.decode_steps < s.steps
    right = SpecPipeScheduler(4, always_right(tiny_model8), width=2, policy="hybrid")
    ok = InProcessPipeline(make_runners(tiny_model8, 4, layers=8)).run(right, [Request("r", p, 10)])["r"].stats
    assert ok.spec.refill_steps == 0 and ok.spec.misses <= 1
