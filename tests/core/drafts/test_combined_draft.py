"""CombinedDraft (coordinator/core/drafts/combined.py, `--draft quant+ngram`): the model draft's children merged
with the n-gram's; `rejection` requests get the model's alone; commits, prunes and releases reach both
parts; `specpipe` with it is lossless.

The merge cases run the real ModelDraft proposal code over a hand-written log-prob row (the draft's
runner is replaced by a table), so the expected children are worked out by hand from the module docstring."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from coordinator.core.drafts.base import DraftNode, DraftSource
from coordinator.core.drafts.combined import CombinedDraft
from coordinator.core.drafts.factory import DRAFTS, build_draft
from coordinator.core.drafts.model import ModelDraft, quantized_copy
from coordinator.core.drafts.ngram import NgramDraft
from coordinator.core.schedulers.base import Request
from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
from coordinator.core.schedulers.specpipe import SpecPipeScheduler
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.reference import hf_greedy, prompts
from helpers.reference import reference_sample
from helpers.shard import make_runners
from common.batch import Control, MicroBatch
from services.model.shard import load_causal_lm
from common.sampling import Sampling, warp

VOCAB = 256                                   # the tiny models' vocabulary
PROBS = {7: 0.5, 3: 0.25, 9: 0.15, 4: 0.05}   # the module docstring's model row; the rest share 0.05
# the n-gram proposes 4 (2/3) then 7 (1/3) at the last node: [1, 2] was followed by 4, 4 and 7
DOC_PROMPT = [1, 2, 4, 1, 2, 4, 1, 2, 7, 1, 2]


def row(probs: dict[int, float]) -> torch.Tensor:
    rest = (1.0 - sum(probs.values())) / (VOCAB - len(probs))
    p = torch.full((VOCAB,), rest, dtype=torch.float64)
    for t, v in probs.items():
        p[t] = v
    return p.log().float()


class TableRunner:
    """Stands in for the draft's StageRunner: every row's log-probs are the same hand-written table."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        self.logprobs, self.controls = logprobs, []

    def apply(self, msg: Control) -> None:
        self.controls.append(msg)

    def step(self, batch: MicroBatch) -> MicroBatch:
        return MicroBatch(batch.batch_id, batch.segments, logprobs=self.logprobs.expand(batch.rows, -1).clone())


class RecordingRunner:
    """The real runner, with the control messages it was sent recorded."""

    def __init__(self, runner) -> None:
        self.runner, self.controls = runner, []
        self.cache = runner.cache

    def apply(self, msg: Control) -> None:
        self.controls.append(msg)
        self.runner.apply(msg)

    def step(self, batch: MicroBatch) -> MicroBatch:
        return self.runner.step(batch)


@pytest.fixture(scope="module")
def tiny_lm(tiny_model):
    return load_causal_lm(str(tiny_model), torch.float32, "cpu")


def table_model(tiny_lm, probs: dict[int, float] = PROBS) -> ModelDraft:
    d = ModelDraft(tiny_lm, name="quant")
    d.runner = TableRunner(row(probs))
    return d


def last_node(prompt: list[int]) -> DraftNode:
    n = len(prompt) - 1
    return DraftNode(n, n - 1, n, prompt[n])


def tokens_scores(props: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    return [t for t, _ in props], [s for _, s in props]


def assert_contract(props: list[tuple[int, float]]) -> None:
    toks, scores = tokens_scores(props)
    assert len(set(toks)) == len(toks), f"a token is two children: {props}"
    assert all(a >= b for a, b in zip(scores, scores[1:])), f"scores increase: {props}"


def combined_children(tiny_lm, prompt, k, probs=PROBS, sampling=Sampling(), keep_q=False, **kw):
    d = CombinedDraft(table_model(tiny_lm, probs), NgramDraft(), **kw)
    d.begin("r", prompt, sampling, keep_q)
    (props,) = d.expand("r", [last_node(prompt)], k)
    return props


# -- merge rules ------------------------------------------------------------------------------------

def test_is_a_draft_source(tiny_lm):
    d = CombinedDraft(table_model(tiny_lm))
    assert isinstance(d, DraftSource) and d.name == "quant+ngram" and isinstance(d.ngram, NgramDraft)
    assert (d.compute_s, d.calls, d.rows) == (0.0, 0, 0)
    with pytest.raises(ValueError):
        CombinedDraft(table_model(tiny_lm), max_extra=-1)


def test_docstring_example(tiny_lm):
    ng = NgramDraft()
    ng.begin("r", DOC_PROMPT)
    (alone,) = ng.expand("r", [last_node(DOC_PROMPT)], 2)
    assert [t for t, _ in alone] == [4, 7], "the example's n-gram proposals"
    props = combined_children(tiny_lm, DOC_PROMPT, k=2)
    toks, scores = tokens_scores(props)
    # 7 (both) once with the model's log .5; 3 the model's; 4 (n-gram only) with the model's log .05
    assert toks == [7, 3, 4]
    assert scores == pytest.approx([math.log(0.5), math.log(0.25), math.log(0.05)], rel=1e-5)


def test_a_prefill_in_pieces_proposes_what_one_begin_does(tiny_lm):
    """The baselines' in-line prefill comes in pieces of rows (DraftSource.begin_many): the n-gram table
    begins with the first, the model computes every piece; the proposals are those after one `begin`."""
    d = CombinedDraft(table_model(tiny_lm, PROBS), NgramDraft())
    job = [("r", DOC_PROMPT, Sampling(), False)]
    last = len(DOC_PROMPT) - 1
    assert d.begin_many(job, {"r": (0, 1)}) == [None] and "r" in d.merged
    assert d.begin_many(job, {"r": (1, last)}) == [None] and d.ngram.committed["r"] == list(DOC_PROMPT)
    (props,) = d.expand("r", [last_node(DOC_PROMPT)], 2)
    assert tokens_scores(props) == tokens_scores(combined_children(tiny_lm, DOC_PROMPT, k=2))


def test_token_both_propose_is_one_child_with_the_models_score(tiny_lm):
    # [5, 6] was followed by 7: the n-gram proposes 7 alone, with log 1 = 0
    props = combined_children(tiny_lm, [5, 6, 7, 5, 6], k=2)
    assert tokens_scores(props)[0] == [7, 3]
    assert props[0][1] == pytest.approx(math.log(0.5), rel=1e-5)
    # 7 is the model's second child: still one child, in the model's place
    props = combined_children(tiny_lm, [5, 6, 7, 5, 6], k=2, probs={3: 0.5, 7: 0.25})
    assert tokens_scores(props) == ([3, 7], pytest.approx([math.log(0.5), math.log(0.25)], rel=1e-5))


# [1] was followed by 5 three times, 6 twice, 8 once (no longer match): n-gram order 5, 6, 8
FREQ_PROMPT = [1, 5, 1, 5, 1, 5, 1, 6, 1, 6, 1, 8, 1]
FREQ_PROBS = {7: 0.5, 3: 0.25, 6: 0.1, 5: 0.05, 8: 0.04}


def test_ngram_only_tokens_rank_by_the_models_log_prob_not_their_frequency(tiny_lm):
    props = combined_children(tiny_lm, FREQ_PROMPT, k=2, probs=FREQ_PROBS)
    toks, scores = tokens_scores(props)
    # the n-gram's first two (5 then 6) join; 6 ranks above 5 because the model gives it 0.1 > 0.05
    assert toks == [7, 3, 6, 5]
    assert scores == pytest.approx([math.log(p) for p in (0.5, 0.25, 0.1, 0.05)], rel=1e-5)
    assert_contract(props)


def test_at_most_max_extra_ngram_tokens(tiny_lm):
    assert tokens_scores(combined_children(tiny_lm, FREQ_PROMPT, 2, FREQ_PROBS, max_extra=0))[0] == [7, 3]
    assert tokens_scores(combined_children(tiny_lm, FREQ_PROMPT, 2, FREQ_PROBS, max_extra=1))[0] == [7, 3, 5]
    assert tokens_scores(combined_children(tiny_lm, FREQ_PROMPT, 2, FREQ_PROBS, max_extra=3))[0] == [7, 3, 6, 5, 8]
    # no n-gram match: the model's children alone
    assert tokens_scores(combined_children(tiny_lm, [1, 2, 3], 2))[0] == [7, 3]


def test_sampling_match_keeps_the_models_children_and_sorts_the_extras_in(tiny_lm):
    """When sampling (match), the model's children come in log q + noise order with running-min scores;
    the n-gram token 4 gets its warped log q and is sorted in, so it may land between them."""
    landed_between = 0
    for seed in range(1, 21):
        s = Sampling(1.0, seed=seed)
        model = table_model(tiny_lm)
        model.begin("r", DOC_PROMPT, s)
        (alone,) = model.expand("r", [last_node(DOC_PROMPT)], 2)
        props = combined_children(tiny_lm, DOC_PROMPT, 2, sampling=s)
        assert_contract(props)
        assert [p for p in props if p in alone] == alone, "the model's children, order and scores"
        extra = [p for p in props if p not in alone]
        q = warp(row(PROBS)[None], s)[0]
        expected = [(t, float(q[t])) for t in (4, 7) if t not in {a for a, _ in alone}]
        assert sorted(extra) == sorted(expected), "n-gram-only tokens, scored by the model's warped log-prob"
        if any(props.index(e) < props.index(alone[-1]) for e in extra):
            landed_between += 1
    assert landed_between, "some seed must place an n-gram token before a model child (the sort matters)"


def test_outside_the_warped_support_is_dropped(tiny_lm):
    # top_k = 2 keeps 7 and 3 only: the n-gram's 4 has log q = -inf and is no child
    props = combined_children(tiny_lm, DOC_PROMPT, 4, sampling=Sampling(1.0, top_k=2, seed=1))
    assert sorted(t for t, _ in props) == [3, 7]


def test_rejection_requests_get_the_models_proposals_only(tiny_lm):
    s = Sampling(1.0, seed=5)
    model = table_model(tiny_lm)
    model.begin("r", DOC_PROMPT, s, keep_q=True)
    (alone,) = model.expand("r", [last_node(DOC_PROMPT)], 1)
    d = CombinedDraft(table_model(tiny_lm), NgramDraft())
    d.begin("r", DOC_PROMPT, s, keep_q=True)
    (props,) = d.expand("r", [last_node(DOC_PROMPT)], 1)
    assert props == alone and len(props) == 1
    assert "r" not in d.ngram.tokens and "r" not in d.merged, "the n-gram never sees a rejection request"
    q = d.take_q("r", last_node(DOC_PROMPT).node_id)
    assert q is not None and torch.equal(q, model.take_q("r", last_node(DOC_PROMPT).node_id))
    # control: the same request verified by `match` does get the n-gram's tokens
    assert len(combined_children(tiny_lm, DOC_PROMPT, 1, sampling=s)) >= 2


def test_counters_are_the_parts_sums(tiny_lm):
    d = CombinedDraft(table_model(tiny_lm), NgramDraft())
    d.begin("a", DOC_PROMPT)
    d.begin("b", [5, 6, 7, 5, 6])
    calls, rows = d.model.calls, d.model.rows
    assert (d.calls, d.rows) == (calls, rows) and calls >= 2, "the prefills are model calls"
    out = d.expand_many([("a", [last_node(DOC_PROMPT)]), ("b", [last_node([5, 6, 7, 5, 6])])], 2)
    assert [[t for t, _ in p[0]] for p in out] == [[7, 3, 4], [7, 3]]
    assert (d.calls, d.rows) == (calls + 1, rows + 2), "one model call for both requests"
    assert d.ngram.compute_s > 0 and d.ngram.calls == 0 and d.ngram.rows == 0
    assert d.compute_s == pytest.approx(d.model.compute_s + d.ngram.compute_s + d._own_compute_s)
    assert d.compute_s > d.model.compute_s


def test_a_failing_request_fails_alone(tiny_lm):
    d = CombinedDraft(table_model(tiny_lm), NgramDraft())
    d.begin("a", DOC_PROMPT)
    d.begin("b", DOC_PROMPT)
    d.ngram.release("b")                       # the n-gram part has lost request b
    out = d.expand_many([("a", [last_node(DOC_PROMPT)]), ("b", [last_node(DOC_PROMPT)])], 2)
    assert [t for t, _ in out[0][0]] == [7, 3, 4]
    assert isinstance(out[1], KeyError)


# -- state: commit, prune, release reach both parts -------------------------------------------------

def test_commit_prune_release_reach_both_parts(tiny_lm):
    model = ModelDraft(tiny_lm, name="quant")
    runner = model.runner = RecordingRunner(model.runner)
    d = CombinedDraft(model, NgramDraft())
    prompt = [5, 6, 7, 5, 6]
    d.begin("r", prompt)
    d.begin("other", prompt)
    (root,) = d.expand("r", [last_node(prompt)], 2)
    a, b = root[0][0], root[1][0]
    d.expand("r", [DraftNode(100, 4, 5, a), DraftNode(101, 4, 5, b), DraftNode(102, 100, 6, 9)], 2)
    assert {100, 101, 102} <= set(d.ngram.tokens["r"])

    d.prune("r", [101])
    assert runner.controls[-1] == Control("r", prune=[101])
    assert 101 not in d.ngram.tokens["r"]
    d.commit("r", [100], [a])
    assert runner.controls[-1] == Control("r", commit=[100])
    assert d.ngram.committed["r"] == prompt + [a] and 100 in d.ngram.committed_ids["r"]

    d.release("r")
    assert runner.controls[-1] == Control("r", release=True)
    assert "r" not in runner.cache.requests and "r" not in model.sampling
    assert not [key for key in model._q if key[0] == "r"]
    for table in (d.ngram.tokens, d.ngram.committed, d.ngram.committed_ids):
        assert "r" not in table
    assert d.merged == {"other"}
    d.release("other")
    assert not runner.cache.requests and not d.merged and not d.ngram.tokens
    d.release("never-begun")                   # harmless


def test_rejection_request_commits_and_releases_without_the_ngram(tiny_lm):
    model = ModelDraft(tiny_lm, name="quant")
    d = CombinedDraft(model, NgramDraft())
    prompt = [5, 6, 7, 5, 6]
    d.begin("r", prompt, Sampling(1.0, seed=1), keep_q=True)
    (root,) = d.expand("r", [last_node(prompt)], 2)
    d.expand("r", [DraftNode(100, 4, 5, root[0][0]), DraftNode(101, 4, 5, root[1][0])], 2)
    d.prune("r", [101])                         # no KeyError from the n-gram part
    d.commit("r", [100], [root[0][0]])
    d.release("r")
    assert not model.runner.cache.requests and not model._q and not model.sampling and not d.ngram.tokens


# -- the factory and the places the choices are listed ----------------------------------------------

def test_factory_builds_it(tiny_model):
    assert "quant+ngram" in DRAFTS
    d = build_draft("quant+ngram", str(tiny_model))
    assert isinstance(d, CombinedDraft) and d.name == "quant+ngram" and d.model.name == "quant"
    d.begin("r", DOC_PROMPT)
    (props,) = d.expand("r", [last_node(DOC_PROMPT)], 2)
    assert_contract(props)
    assert {4, 7} <= {t for t, _ in props}, "the n-gram's two tokens are children"


def test_the_choice_is_offered_everywhere():
    from coordinator.bench.run import main_args
    from coordinator.config import add_spec_arguments
    for add in (add_spec_arguments, main_args):
        p = argparse.ArgumentParser()
        add(p)
        assert p.parse_known_args(["--draft", "quant+ngram"])[0].draft == "quant+ngram"
    schema = json.loads((Path(__file__).resolve().parents[3] / "helm/specpipe/values.schema.json").read_text())
    assert "quant+ngram" in schema["properties"]["coordinator"]["properties"]["draft"]["enum"]


# -- lossless end to end ----------------------------------------------------------------------------

REPEATING = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]   # prompt lookup has something to propose


def quant_ngram(target) -> tuple[CombinedDraft, list[int]]:
    """The combined draft over the target's int8 copy, counting n-gram proposals that were not empty."""
    d = CombinedDraft(ModelDraft(quantized_copy(str(target)), name="quant"), NgramDraft())
    proposed = [0]
    expand = d.ngram.expand

    def counting(rid, nodes, k):
        out = expand(rid, nodes, k)
        proposed[0] += sum(1 for p in out if p)
        return out

    d.ngram.expand = counting
    return d, proposed


@pytest.mark.parametrize("num_stages", [1, 4])
def test_specpipe_greedy_matches_transformers(tiny_model8, tiny_hf8, num_stages):
    runners = make_runners(tiny_model8, num_stages, layers=8)
    ps = prompts(2, seed=num_stages) + [REPEATING]
    d, proposed = quant_ngram(tiny_model8)
    sched = SpecPipeScheduler(num_stages, d, width=4, policy="layer" if num_stages % 2 else "best-first")
    out = InProcessPipeline(runners).run(sched, [Request(f"r{i}", p, 16) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert out[f"r{i}"].tokens == hf_greedy(tiny_hf8, p, 16), (num_stages, i)
    assert proposed[0] > 0, "the n-gram part took part"
    assert all(not r.cache.requests for r in runners) and not sched.trees and not sched.requests
    assert not d.model.runner.cache.requests and not d.model.sampling and not d.merged and not d.ngram.tokens


def test_tree_method_greedy_matches_transformers(tiny_model8, tiny_hf8):
    d, proposed = quant_ngram(tiny_model8)
    sched = make_scheduler("tree", 2, SpecOptions(d, width=4, tree_nodes=8, tree_depth=3))
    ps = prompts(1, seed=9) + [REPEATING]
    out = InProcessPipeline(make_runners(tiny_model8, 2, layers=8)).run(
        sched, [Request(f"r{i}", p, 12) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert out[f"r{i}"].tokens == hf_greedy(tiny_hf8, p, 12), i
    assert proposed[0] > 0


def test_specpipe_match_sampling_is_plain_seeded_sampling(tiny_model8, tiny_hf8):
    d, proposed = quant_ngram(tiny_model8)
    sched = SpecPipeScheduler(2, d, width=4)
    reqs = [Request(f"r{i}", p, 12, sampling=Sampling(0.9, top_p=0.95, top_k=40, seed=100 + i))
            for i, p in enumerate([[3, 40, 1], REPEATING])]
    out = InProcessPipeline(make_runners(tiny_model8, 2, layers=8)).run(sched, reqs)
    for r in reqs:
        assert out[r.request_id].tokens == reference_sample(tiny_hf8, r.prompt_ids, 12, r.sampling), r.request_id
    assert proposed[0] > 0
