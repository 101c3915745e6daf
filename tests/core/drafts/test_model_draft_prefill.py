"""The draft's prefill goes in calls of at most `prefill_chunk` rows, long prompts in order over several, short
ones together; the proposals after it are those of one unchunked prefill; a failing call fails only its
requests."""
from __future__ import annotations

import torch

from common.batch import MicroBatch

from coordinator.core.drafts.base import DraftNode
from coordinator.core.drafts.model import ModelDraft, quantized_copy
from services.model.shard import load_causal_lm
from common.sampling import GREEDY


def proposals_after(draft: ModelDraft, prompts: dict[str, list[int]]) -> dict[str, list]:
    errors = draft.begin_many([(rid, p, GREEDY, False) for rid, p in prompts.items()])
    assert errors == [None] * len(prompts)
    jobs = [(rid, [DraftNode(len(p) - 1, len(p) - 2, len(p) - 1, p[-1])]) for rid, p in prompts.items()]
    return {rid: list(rows[0]) for (rid, _), rows in zip(jobs, draft.expand_many(jobs, 4))}


def test_a_chunked_prefill_proposes_what_one_call_does(tiny_model):
    prompts = {"a": [5, 9, 13, 2, 7, 7, 30, 4, 11], "b": [3, 8, 1]}
    # fp32 (the int8 `quant` copy quantizes activations per call, so its numbers depend on the batch)
    whole = proposals_after(ModelDraft(load_causal_lm(str(tiny_model), torch.float32, "cpu"), prefill_chunk=1000),
                            prompts)
    chunked_draft = ModelDraft(load_causal_lm(str(tiny_model), torch.float32, "cpu"), prefill_chunk=6)
    calls: list[list[tuple[str, int]]] = []
    step = chunked_draft.runner.step

    def recorded(batch: MicroBatch) -> MicroBatch:
        calls.append([(s.request_id, s.rows) for s in batch.segments])
        return step(batch)
    chunked_draft.runner.step = recorded
    chunked = proposals_after(chunked_draft, prompts)
    assert calls[:2] == [[("a", 6)], [("b", 2), ("a", 2)]], calls          # 8 + 2 prompt rows, 6 per call
    assert [[(t, round(s, 4)) for t, s in chunked[r]] for r in "ab"] == \
        [[(t, round(s, 4)) for t, s in whole[r]] for r in "ab"]


def test_a_prefill_in_pieces_of_rows_proposes_what_one_call_does(tiny_model):
    """`rows` {request: (a, b)}: the baselines' in-line draft prefills a long prompt one piece per call (the
    first piece begins the request). Pieces (0, 3), (3, 8) of a 9-id prompt, then its expansion: the
    proposals of one unpieced prefill; the first piece alone computed 3 rows."""
    prompt = [5, 9, 13, 2, 7, 7, 30, 4, 11]
    whole = proposals_after(ModelDraft(load_causal_lm(str(tiny_model), torch.float32, "cpu")), {"a": prompt})
    draft = ModelDraft(load_causal_lm(str(tiny_model), torch.float32, "cpu"))
    job = [("a", prompt, GREEDY, False)]
    assert draft.begin_many(job, {"a": (0, 3)}) == [None] and draft.rows == 3 and "a" in draft.sampling
    assert draft.begin_many(job, {"a": (3, 8)}) == [None] and draft.rows == 8
    nodes = [DraftNode(len(prompt) - 1, len(prompt) - 2, len(prompt) - 1, prompt[-1])]
    pieced = list(draft.expand_many([("a", nodes)], 4)[0][0])
    assert [(t, round(s, 4)) for t, s in pieced] == [(t, round(s, 4)) for t, s in whole["a"]]


def test_a_failing_prefill_call_fails_only_its_requests(tiny_model):
    """`ok`'s 4 rows fill the first call; `bad`'s first chunk fails: `bad` fails, its later chunks are never
    sent, `ok` is prefilled."""
    draft = ModelDraft(quantized_copy(str(tiny_model)), prefill_chunk=4)
    step, sent = draft.runner.step, []

    def failing(batch: MicroBatch) -> MicroBatch:
        sent.append([s.request_id for s in batch.segments])
        if any(s.request_id == "bad" for s in batch.segments):
            raise RuntimeError("out of memory")
        return step(batch)
    draft.runner.step = failing
    errors = draft.begin_many([("ok", [4, 5, 6, 7, 8], GREEDY, False), ("bad", list(range(3, 15)), GREEDY, False)])
    assert errors[0] is None and isinstance(errors[1], RuntimeError)
    assert sent == [["ok"], ["bad"]], "bad's later chunks were not sent"
