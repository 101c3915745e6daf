"""Every method sends a prompt in micro-batches of at most `--prefill-chunk` rows (one prefill rule), and stays
token-identical to transformers. Before, pp, sps, tree and pipeinfer sent the whole prompt in one micro-batch."""
from __future__ import annotations

import pytest

from common.batch import MicroBatch

from coordinator.core.schedulers.base import Request
from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
from coordinator.core.vocabulary import METHODS
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.drafts import make_draft
from helpers.leftovers import assert_nothing_left
from helpers.reference import hf_greedy
from helpers.shard import make_runners, play

CHUNK = 3


@pytest.mark.parametrize("method", METHODS)
def test_a_long_prompt_goes_in_chunks_with_every_method(tiny_model, tiny_hf, method):
    runners = make_runners(tiny_model, 2)
    first = runners[0]
    step, sent = first.step, []

    def recorded(batch: MicroBatch) -> MicroBatch:
        sent.append(batch)
        return step(batch)
    first.step = recorded
    draft = None if method in ("pp", "cb-pp") else make_draft("quant", tiny_model, None)
    sched = make_scheduler(method, 2, SpecOptions(draft=draft, prefill_chunk=CHUNK, width=4, topk=4, draft_rounds=1))
    prompt = [17, 90, 4, 133, 61, 8, 200, 45, 72, 19]
    out = InProcessPipeline(runners).run(sched, [Request("r", prompt, 5)])
    assert out["r"].tokens == hf_greedy(tiny_hf, prompt, 5)
    prompt_rows = [[p for s in b.segments for p in s.positions if p < len(prompt)] for b in sent]
    prompt_rows = [r for r in prompt_rows if r]
    assert [len(r) for r in prompt_rows] == [3, 3, 3, 1], prompt_rows      # 10 rows in chunks of 3
    assert sorted(p for r in prompt_rows for p in r) == list(range(10))
    assert_nothing_left(sched, runners)


@pytest.mark.parametrize("method", ["sps", "tree", "pipeinfer"])
def test_a_baselines_draft_prefill_goes_one_chunk_per_work_call_with_results_between(tiny_model, tiny_hf, method):
    """The baselines run their draft in line, in `work()`, which the engine calls under the scheduler's lock.
    A long prompt's draft prefill takes one chunk per call, so another request's results are handled (and
    its tokens sent) between the chunks; before, the whole prefill went in one call and `a` waited for it."""
    runners = make_runners(tiny_model, 2)
    draft = make_draft("quant", tiny_model, None)
    begin_many, pieces = draft.begin_many, []

    def recorded(jobs, rows=None):
        pieces.extend((rid, (rows or {}).get(rid)) for rid, *_ in jobs)
        return begin_many(jobs, rows)
    draft.begin_many = recorded
    sched = make_scheduler(method, 2, SpecOptions(draft=draft, prefill_chunk=CHUNK, width=4, topk=4, draft_rounds=1))
    long_prompt = [17, 90, 4, 133, 61, 8, 200, 45, 72, 19]           # 9 rows for the draft: 3 chunks
    sched.add(Request("a", [5, 6, 7], 6))
    sched.add(Request("b", long_prompt, 6))
    results: list[MicroBatch] = []
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    a_between: list[int] = []                 # b's draft rows done when a token of a was sent
    finished: set[str] = set()

    def drain() -> None:
        new, emits, finishes = play(sched.poll(), runners)
        results.extend(new)
        for emit in emits:
            tokens[emit.request_id] += emit.token_ids
            if emit.request_id == "a" and "b" not in sched.begun:
                a_between.append(sched.draft_prefilled.get("b", 0))
        finished.update(f.request_id for f in finishes)
    drain()
    while len(finished) < 2 or sched.has_work:
        if sched.has_work:
            sched.work()
            drain()
        if results:
            sched.on_result(results.pop(0))
            drain()
    assert tokens == {"a": hf_greedy(tiny_hf, [5, 6, 7], 6), "b": hf_greedy(tiny_hf, long_prompt, 6)}
    assert [p for rid, p in pieces if rid == "b"] == [(0, 3), (3, 6), (6, 9)]
    assert any(0 < done < 9 for done in a_between), f"a's tokens went out between b's draft chunks: {a_between}"
    assert_nothing_left(sched, runners, draft)
