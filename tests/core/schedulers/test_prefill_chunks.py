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
from helpers.shard import make_runners

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
