"""specpipe's draft beside the coordinator (coordinator/core/drafts/job.py): a draft job is made, the draft
computes it while results come back, commit, prune, cancel and inject, then its results are applied.

Whatever the order of those events, every request's output is transformers' greedy output (or plain
seeded sampling), and once all have ended no stage, no draft and no scheduler table holds anything."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.core.drafts.chain import Chain
from coordinator.core.drafts.job import DraftJob, DraftResults
from coordinator.core.drafts.model import ModelDraft, quantized_copy
from coordinator.core.schedulers.base import Finish, Request
from coordinator.core.schedulers.specpipe import SpecPipeScheduler
from coordinator.core.sizing import NONE, Choice, Sizer, Sizing
from helpers.drafts import AlwaysWrong, always_right
from helpers.leftovers import assert_nothing_left
from helpers.reference import hf_greedy, prompts, reference_sample
from helpers.shard import make_runners, play
from common.sampling import Sampling

IDS = itertools.count()


@pytest.fixture(scope="module")
def parts(tiny_model):
    drafts = {"quant": ModelDraft(quantized_copy(str(tiny_model)), name="quant"), "right": always_right(tiny_model),
              "wrong": AlwaysWrong(tiny_model)}
    return drafts, make_runners(tiny_model, 2)


class Driver:
    """The scheduler's events in an order the test chooses: results return oldest first (the pipeline keeps
    order), at most one draft job is out at a time (the engine's draft thread), cancels at any point."""

    def __init__(self, sched: SpecPipeScheduler, runners, lazy: bool = False) -> None:
        """`lazy`: a job is computed when it comes back, not when it starts, so the results handled meanwhile
        cut its chained rounds (DraftJob.cut) as on the engine."""
        self.sched, self.runners, self.lazy = sched, runners, lazy
        self.results: list = []
        self.job: tuple[DraftJob, DraftResults] | None = None
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, Finish] = {}

    def drain(self) -> None:
        results, emits, finishes = play(self.sched.poll(), self.runners)
        self.results += results
        for emit in emits:
            self.tokens.setdefault(emit.request_id, []).extend(emit.token_ids)
        for finish in finishes:
            assert finish.request_id not in self.finished, f"{finish.request_id} finished twice"
            self.finished[finish.request_id] = finish

    def _start(self, job: DraftJob | None) -> None:
        if job is not None:                   # the draft sees only what the job carries
            self.job = (job, None if self.lazy else job.run(self.sched.draft))

    def choices(self) -> list[str]:
        out = ["result"] if self.results else []
        if self.job is not None:
            out += ["job done", "job next"]         # draft_done; or draft_next, which starts the next job too
        elif self.sched.has_work:
            out.append("job start")
        return out

    def step(self, choice: str) -> None:
        if choice == "result":
            self.sched.on_result(self.results.pop(0))
        elif choice == "job start":
            self._start(self.sched.draft_job())
        elif choice == "job done":
            job, results = self.job
            self.job = None
            self.sched.draft_done(job, results or job.run(self.sched.draft))
        else:
            job, results = self.job
            self.job = None
            self._start(self.sched.draft_next(job, results or job.run(self.sched.draft)))
        self.drain()


FUZZ = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])


@FUZZ
@given(draft=st.sampled_from(["quant", "right", "wrong"]), policy=st.sampled_from(["hybrid", "best-first", "layer"]),
       width=st.integers(1, 6), sampled=st.booleans(), rounds=st.integers(1, 3), chain=st.booleans(),
       lazy=st.booleans(), data=st.data())
def test_any_order_of_draft_jobs_results_and_cancels_is_exact(parts, tiny_hf, draft, policy, width, sampled, rounds,
                                                              chain, lazy, data):
    """`chain`: a step's rounds in one job, the draft choosing the later ones (coordinator/core/drafts/chain.py);
    results meanwhile prune what it expands; `lazy`: a job computed when it comes back, so those results cut
    its chains."""
    drafts, runners = parts
    sched = SpecPipeScheduler(2, drafts[draft], width=width, policy=policy, topk=3, node_budget=8, rounds=rounds,
                              chain=chain)
    d = Driver(sched, runners, lazy)
    k = next(IDS)
    ps = prompts(3, seed=data.draw(st.integers(0, 6)))
    sampling = Sampling(temperature=0.8, seed=11) if sampled else Sampling()
    reqs = [Request(f"b{k}-{i}", p, 8, sampling=sampling if i == 1 else Sampling()) for i, p in enumerate(ps)]
    cancel_at = data.draw(st.integers(0, 60))                 # request 2 is cancelled after this many events
    try:
        run(sched, d, reqs, cancel_at, data)
        for r in reqs:
            fin = d.finished[r.request_id]
            if fin.reason == "cancelled":
                continue
            assert fin.reason == "length", fin.error
            want = reference_sample(tiny_hf, r.prompt_ids, 8, r.sampling) if not r.sampling.greedy else \
                hf_greedy(tiny_hf, r.prompt_ids, 8)
            assert d.tokens[r.request_id] == want, (r.request_id, draft, policy)
        assert_nothing_left(sched, runners, drafts[draft])
        assert not sched.draft_ops and not sched.unseen
    finally:                # a failed or aborted example (hypothesis stops one that overruns its data) leaves
        forget(reqs, runners, drafts[draft])       # nothing to the next


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(width=st.integers(1, 2), data=st.data())
def test_chained_jobs_cut_by_results_in_any_order_are_exact(parts, tiny_hf, width, data):
    """Chains of three rounds (the `quant` draft, often right but not always), each computed when it comes
    back, in any order of results: a result commits a node of a chain's frontier before the chain computes it
    (or without it ever doing so: cut), then misses there, so the bonus's parent must reach the draft
    (`unseen`) unless the chain computed it. Every output is the target's own; nothing is left."""
    drafts, runners = parts
    sched = SpecPipeScheduler(2, drafts["quant"], width=width, policy="best-first", topk=2, node_budget=8, rounds=3)
    d = Driver(sched, runners, lazy=True)
    k = next(IDS)
    reqs = [Request(f"c{k}-{i}", p, 10) for i, p in enumerate(prompts(3, seed=data.draw(st.integers(0, 20))))]
    try:
        run(sched, d, reqs, 1000, data)                          # (none cancelled)
        for r in reqs:
            assert d.finished[r.request_id].reason == "length", d.finished[r.request_id].error
            assert d.tokens[r.request_id] == hf_greedy(tiny_hf, r.prompt_ids, 10)
        assert_nothing_left(sched, runners, drafts["quant"])
    finally:
        forget(reqs, runners, drafts["quant"])


@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(["hybrid", "best-first"]), data=st.data())
def test_the_draft_holds_rows_only_of_tree_nodes_whenever_nothing_is_out(parts, tiny_hf, policy, data):
    """Chains of three rounds with a right draft: results in any order commit a chained node and miss right
    after it (its children in the tree are none yet), so the children the chain computed below it never reach
    the tree and no prune of the tree names them. Whenever no job is out and no bookkeeping is queued, every
    row the draft holds (committed ones aside) is a node of the tree: the draft was told to prune them."""
    drafts, runners = parts
    draft = drafts["right"]
    sched = SpecPipeScheduler(2, draft, width=2, policy=policy, topk=2, node_budget=8, rounds=3)
    d = Driver(sched, runners)
    rid = f"h{next(IDS)}"
    prompt = prompts(1, seed=data.draw(st.integers(0, 20)))[0]
    sched.add(Request(rid, prompt, 24))
    d.drain()
    try:
        while rid not in d.finished:
            choices = d.choices()
            assert choices, "the scheduler stalled"
            d.step(data.draw(st.sampled_from(choices)))
            if d.job is None and not sched.draft_ops and rid in sched.trees:
                assert draft_rows(draft, rid) <= set(sched.trees[rid].nodes)
        while d.choices():
            d.step(d.choices()[0])
        assert d.tokens[rid] == hf_greedy(tiny_hf, prompt, 24)
        assert_nothing_left(sched, runners, draft)
    finally:
        forget([Request(rid, prompt, 24)], runners, draft)


class Scripted(Sizer):
    """A cost rule that switches, after every result, to whatever the test draws (none included)."""

    def __init__(self, num_stages: int, draw) -> None:
        super().__init__(num_stages, Sizing.of(0, 0, 0))
        self.choice, self.draw = Choice(4, 3, 2), draw

    def step(self, requests: int = 1) -> Choice:
        self.choice = self.draw()
        return self.choice


CHOICES = [NONE, Choice(1, 2, 1), Choice(3, 3, 2), Choice(6, 3, 1)]


@FUZZ
@given(draft=st.sampled_from(["quant", "right", "wrong"]), policy=st.sampled_from(["hybrid", "best-first", "layer"]),
       sampled=st.booleans(), verify=st.sampled_from(["match", "rejection"]), chain=st.booleans(), lazy=st.booleans(),
       data=st.data())
def test_the_cost_rule_switching_at_any_result_is_exact(parts, tiny_hf, draft, policy, sampled, verify, chain, lazy,
                                                       data):
    """Width, topk, rounds or none changing after any result (requests going plain with micro-batches of
    speculation in flight, plain requests rejoining, the draft catching up on what it never computed), in any
    order of results and draft jobs: greedy and seeded `match` output stay the target's own, `rejection` ends
    every request, and nothing is left."""
    drafts, runners = parts
    sizer = Scripted(2, lambda: data.draw(st.sampled_from(CHOICES)))
    sched = SpecPipeScheduler(2, drafts[draft], width=6, policy=policy, topk=3, node_budget=8, rounds=2,
                              verify=verify, sizer=sizer, chain=chain)
    d = Driver(sched, runners, lazy)
    k = next(IDS)
    ps = prompts(3, seed=data.draw(st.integers(0, 6)))
    sampling = Sampling(temperature=0.8, seed=11) if sampled else Sampling()
    reqs = [Request(f"z{k}-{i}", p, 8, sampling=sampling if i == 1 else Sampling()) for i, p in enumerate(ps)]
    try:
        run(sched, d, reqs, data.draw(st.integers(0, 60)), data)
        for r in reqs:
            fin = d.finished[r.request_id]
            if fin.reason == "cancelled":
                continue
            assert fin.reason == "length", fin.error
            if r.sampling.greedy:
                assert d.tokens[r.request_id] == hf_greedy(tiny_hf, r.prompt_ids, 8)
            elif verify == "match":
                assert d.tokens[r.request_id] == reference_sample(tiny_hf, r.prompt_ids, 8, r.sampling)
            else:
                assert len(d.tokens[r.request_id]) == 8
        assert_nothing_left(sched, runners, drafts[draft])
        assert not sched.draft_ops and not sched.unseen and not sched.plain
    finally:
        forget(reqs, runners, drafts[draft])


def forget(reqs: list[Request], runners, draft: ModelDraft) -> None:
    for r in reqs:
        for runner in runners:
            runner.cache.release(r.request_id)
        draft.release(r.request_id)          # its KV, sampling state and kept q


def run(sched: SpecPipeScheduler, d: Driver, reqs: list[Request], cancel_at: int, data) -> None:
    """Requests 0 and 1 at once, 2 after three events (cancelled after `cancel_at`), then events in the
    order `data` draws until all have ended and the draft's last bookkeeping (the releases) is done."""
    sched.add(reqs[0])
    sched.add(reqs[1])
    d.drain()
    events = 0
    while len(d.finished) < len(reqs):
        if events == 3:
            sched.add(reqs[2])
            d.drain()
        if events == cancel_at and reqs[2].request_id in sched.requests:
            sched.cancel(reqs[2].request_id)
            d.drain()
        choices = d.choices()
        assert choices, "the scheduler stalled: nothing in flight, no draft work"
        d.step(data.draw(st.sampled_from(choices)))
        events += 1
    while d.choices():
        d.step(d.choices()[0])


def test_a_prune_while_a_job_computes_drops_its_proposals_and_frees_its_rows(parts, tiny_hf):
    """By hand: a job asks the draft for the children of nodes that a result prunes before the job comes
    back. Their proposals are not added, the prune reached the draft behind the job (so the rows it computed
    are freed), and the output stays exact."""
    drafts, runners = parts
    draft = drafts["wrong"]                   # every proposal misses: each result prunes what was proposed
    sched = SpecPipeScheduler(2, draft, width=2, policy="best-first", topk=2, rounds=1)
    d = Driver(sched, runners)
    prompt = prompts(1, seed=3)[0]
    sched.add(Request("p", prompt, 6))
    d.drain()
    d.step("job start")                       # prefill + the root's children
    d.step("job done")
    d.step("job start")                       # the next round: children of the injected candidates
    asked = [n for rid, nodes in d.job[0].expand for n in (x.node_id for x in nodes)]
    assert asked, "the job expands nodes"
    while d.results:                          # results come back meanwhile: misses prune the asked nodes
        d.step("result")
    tree = sched.trees.get("p")
    gone = [n for n in asked if tree is None or n not in tree.nodes]
    assert gone, "a result pruned nodes of the job in flight"
    prune_ops = [op for op in sched.draft_ops if op.kind.value == "prune"]
    assert any(set(op.node_ids) & set(gone) for op in prune_ops), "the prune names the asked nodes"
    d.step("job done")                        # their proposals are dropped
    if tree is not None:
        assert all(n not in tree.nodes for n in gone)
    while len(d.finished) < 1:
        d.step(d.choices()[0])
    while d.choices():
        d.step(d.choices()[0])
    assert d.tokens["p"] == hf_greedy(tiny_hf, prompt, 6)
    assert_nothing_left(sched, runners, draft)


@pytest.mark.parametrize("policy", ["hybrid", "best-first"])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_chained_job_expands_the_nodes_that_rounds_made_one_by_one_would(parts, policy, sampled, monkeypatch):
    """With no result in between (and no injection: dispatch is off), one job chaining three rounds grows the
    same tree as three jobs of a round each: the same nodes, by their paths of tokens, with the same scores,
    expanded or not alike; the coordinator made two jobs instead of four (the first, the root's, is alone).
    Chains cut after every round (`DraftJob.cut`, as a result arriving would) grow it too, in four jobs: the
    rounds not run are due again, and a cut chain chooses no round in vain."""
    drafts, runners = parts
    grown, jobs, chose = {}, {}, {"chain": 0, "cut": 0, "rounds": 0}
    choose = Chain.choose

    def counted(chain):
        chose[mode] += 1
        return choose(chain)
    monkeypatch.setattr(Chain, "choose", counted)
    draft = drafts["right"]              # (not `quant`: its int8 activations are scaled per batch, so a node's
    for mode in ("chain", "cut", "rounds"):    # proposals depend on which rows share its call)
        sched = SpecPipeScheduler(4, draft, width=3, policy=policy, topk=3, rounds=4, chain=mode != "rounds")
        sched._dispatch = lambda: None
        rid = f"eq-{policy}-{sampled}-{mode}"
        sampling = Sampling(temperature=0.8, seed=5) if sampled else Sampling()
        sched.add(Request(rid, prompts(1, seed=4)[0], 20, sampling=sampling))
        jobs[mode] = 0
        while (job := sched.draft_job()) is not None:
            jobs[mode] += 1
            assert bool(job.chains) == (mode == "chain" and jobs[mode] == 2 or mode == "cut" and jobs[mode] in (2, 3))
            job.cut = mode == "cut"
            results = job.run(sched.draft)
            assert results.cut == (mode == "cut" and bool(job.chains)) and results.rounds == (3 if mode == "chain"
                                                                                             and job.chains else 1)
            sched.draft_done(job, results)
        tree = sched.trees[rid]
        grown[mode] = {tuple(tree.path_tokens(i)): (bool(tree.nodes[i].expanded), round(tree.nodes[i].score, 4))
                       for i in tree.nodes}
        draft.release(rid)
    assert jobs == {"chain": 2, "cut": 4, "rounds": 4}
    assert chose == {"chain": 2, "cut": 0, "rounds": 0}, "a chain of 3 rounds chooses 2; a cut one none"
    assert sum(e for e, _ in grown["rounds"].values()) == 1 + 3 * 3, "the root, then 3 rounds of width 3"
    assert grown["chain"] == grown["rounds"] and grown["cut"] == grown["rounds"]


def draft_rows(draft: ModelDraft, request_id: str) -> set[int]:
    """The nodes the draft holds rows of, committed ones aside."""
    kv = draft.runner.cache.get(request_id, create=False)
    return {i for i, n in kv.table.nodes.items() if not n.committed} if kv is not None else set()


def test_a_prune_while_a_chained_job_computes_leaves_the_draft_no_row_outside_the_tree(parts, tiny_hf):
    """A chained job is out while results come back and prune what its first round expands (the draft proposes
    only misses), so its later rounds expand nodes below pruned ones, which the tree never gets. Once the prune
    has reached the draft (behind the job), the draft holds rows only of nodes in the tree; the output is
    exact and nothing is left."""
    drafts, runners = parts
    draft = drafts["wrong"]
    sched = SpecPipeScheduler(2, draft, width=2, policy="best-first", topk=2, rounds=3)
    d = Driver(sched, runners)
    prompt = prompts(1, seed=3)[0]
    sched.add(Request("ch", prompt, 8))
    d.drain()
    d.step("job start")                       # prefill + the root's children (the root was not expanded)
    d.step("job done")
    d.step("job start")                       # the injection's three rounds, chained
    job = d.job[0]
    assert "ch" in job.chains and len(d.job[1].chained["ch"]) == 3
    while d.results:
        d.step("result")
    later = {i for done in d.job[1].chained["ch"][1:] for i in done.node_ids.tolist()}
    d.step("job done")
    tree = sched.trees["ch"]
    assert later and not later & set(tree.nodes), "the later rounds' nodes hung below pruned ones"
    assert later & draft_rows(draft, "ch"), "the draft computed them"
    d.step("job start")                       # the queued prune goes to the draft ahead of the next job
    d.step("job done")
    tree = sched.trees["ch"]
    assert draft_rows(draft, "ch") <= set(tree.nodes), "every row the draft holds is a node of the tree"
    while d.choices():
        d.step(d.choices()[0])
    assert d.tokens["ch"] == hf_greedy(tiny_hf, prompt, 8)
    assert_nothing_left(sched, runners, draft)


class FailingDraft(ModelDraft):
    """A draft whose whole model call fails on the n-th expansion (e.g. out of memory)."""

    def __init__(self, model_path, fail_at: int) -> None:
        from services.model.shard import load_causal_lm
        import torch
        super().__init__(load_causal_lm(str(model_path), torch.float32, "cpu"), name="failing")
        self.fail_at, self.calls_seen = fail_at, 0

    def expand_many(self, jobs, k, extra=None):
        self.calls_seen += 1
        if self.calls_seen == self.fail_at:
            raise RuntimeError("CUDA out of memory (simulated)")
        return super().expand_many(jobs, k, extra)


class FailingPrefill(FailingDraft):
    """A draft whose prefill call fails as a whole, after it has begun computing (its KV half written)."""

    def begin_many(self, jobs, rows=None):
        self.calls_seen += 1
        if self.calls_seen == self.fail_at:
            super().begin_many(jobs, rows)       # the KV and sampling state are there: the failure must free them
            raise RuntimeError("CUDA out of memory (simulated) in the prefill")
        return super().begin_many(jobs, rows)


def test_a_draft_call_failing_as_a_whole_fails_its_requests_and_leaves_nothing(tiny_model, tiny_hf):
    runners = make_runners(tiny_model, 2)
    draft = FailingDraft(tiny_model, fail_at=3)
    sched = SpecPipeScheduler(2, draft, width=3, policy="hybrid", topk=2, rounds=2)
    d = Driver(sched, runners)
    ps = prompts(2, seed=5)
    for i, p in enumerate(ps):
        sched.add(Request(f"f{i}", p, 10))
    d.drain()
    while len(d.finished) < 2:
        d.step(d.choices()[-1])               # draft work first: the third call fails while both run
    while d.choices():
        d.step(d.choices()[0])
    errors = [f for f in d.finished.values() if f.reason == "error"]
    assert errors and all("draft failed" in f.error and "out of memory" in f.error for f in errors)
    for f in d.finished.values():
        if f.reason == "length":
            assert d.tokens[f.request_id] == hf_greedy(tiny_hf, ps[int(f.request_id[1:])], 10)
    assert_nothing_left(sched, runners, draft)


def test_a_prefill_call_failing_as_a_whole_fails_its_requests_once_and_leaves_nothing(tiny_model, tiny_hf):
    """Two prompts in one draft prefill call that fails after computing: both requests end with the draft's
    error, each exactly once (the driver refuses a second finish); nothing is left on the stages or in the
    draft's KV; a request admitted after it runs exact."""
    runners = make_runners(tiny_model, 2)
    draft = FailingPrefill(tiny_model, fail_at=1)
    sched = SpecPipeScheduler(2, draft, width=3, policy="hybrid", topk=2, rounds=2)
    d = Driver(sched, runners)
    ps = prompts(3, seed=6)
    for i, p in enumerate(ps[:2]):
        sched.add(Request(f"p{i}", p, 10))
    d.drain()
    while d.choices():
        d.step(d.choices()[-1])
    assert sorted(d.finished) == ["p0", "p1"]
    assert all(f.reason == "error" and "draft failed" in f.error and "in the prefill" in f.error
               for f in d.finished.values())
    assert_nothing_left(sched, runners, draft)
    sched.add(Request("after", ps[2], 10))
    d.drain()
    while d.choices():
        d.step(d.choices()[0])
    assert d.finished["after"].reason == "length" and d.tokens["after"] == hf_greedy(tiny_hf, ps[2], 10)
    assert_nothing_left(sched, runners, draft)
