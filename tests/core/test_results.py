"""Results checked against the micro-batch they answer (coordinator/core/results.py), and what a scheduler
does with one that cannot answer it: its requests fail, nothing of it is applied, nothing hangs."""
from __future__ import annotations

import pytest
import torch

from common.batch import MicroBatch, Segment
from coordinator.core.results import Sent, check
from coordinator.core.schedulers.base import Emit, Finish, Inject, Request
from coordinator.core.schedulers.cbpp import CBPPScheduler
from coordinator.core.schedulers.pp import PPScheduler
from coordinator.core.status import Status
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.by_hand import injected
from helpers.leftovers import assert_nothing_left
from helpers.reference import hf_greedy, prompts
from helpers.shard import make_runners


def seg(rid: str, nodes: list[int], want: list[bool]) -> Segment:
    return Segment(rid, nodes, [n - 1 for n in nodes], nodes, [7] * len(nodes), want)


SENT = Sent.of(MicroBatch(4, [seg("a", [1, 2, 3], [False, True, True]), seg("b", [10], [True])]))


def result(segments: list[Segment], argmax: list[int], logprobs: torch.Tensor | None = None) -> MicroBatch:
    return MicroBatch(4, segments, argmax=argmax, logprobs=logprobs)


def test_a_result_with_every_row_or_with_dead_rows_dropped_answers_its_batch():
    assert check(SENT, result([seg("a", [1, 2, 3], [False, True, True]), seg("b", [10], [True])], [5, 6, 7])) == ""
    assert check(SENT, result([seg("a", [1, 3], [False, True]), seg("b", [], [])], [5])) == ""
    failed = Segment.failed("b", "out of memory", Status.INTERNAL, 3)
    assert check(SENT, result([seg("a", [2], [True]), failed], [1])) == ""


@pytest.mark.parametrize("segments, argmax, fault", [
    ([seg("a", [1, 2, 3], [False, True, True])], [5, 6], "1 segments came back for 2 sent"),
    ([seg("b", [10], [True]), seg("a", [1, 2, 3], [False, True, True])], [5, 6, 7], "segment 0 is of request 'b'"),
    ([seg("a", [1, 2, 4], [False, True, True]), seg("b", [10], [True])], [5, 6, 7], "node 4 of request 'a'"),
    ([seg("a", [3, 2], [True, True]), seg("b", [10], [True])], [5, 6, 7], "out of order"),
    ([seg("a", [1, 2, 3], [True, True, True]), seg("b", [10], [True])], [5, 6, 7, 8], "want_output True, sent False"),
    ([seg("a", [1, 2, 3], [False, True, True]), seg("b", [10], [True])], [5, 6], "3 output rows came back with 2"),
    ([seg("a", [1, 2, 3], [False, True, True]), seg("b", [10], [True])], [5, 6, 7, 8], "with 4 tokens"),
    ([seg("a", [2], [True]), seg("b", [10], [True])], [5, -1], "a negative token id"),
    ([Segment("a", [2], [1], [2, 3], [7], [True]), seg("b", [], [])], [5], "fields of different lengths"),
    ([seg("a", [2], [True]), Segment("b", [10], [9], [10], [7], [True], error="x")], [5], "failed segment"),
])
def test_a_result_that_cannot_answer_its_batch_is_named(segments, argmax, fault):
    assert fault in check(SENT, result(segments, argmax))


def test_log_probabilities_must_come_back_as_asked_and_finite():
    asked = Sent.of(MicroBatch(1, [seg("a", [1, 2], [True, True])], return_logprobs=True))
    back = [seg("a", [1, 2], [True, True])]
    assert check(asked, MicroBatch(1, back, argmax=[3, 4], logprobs=torch.zeros(2, 5))) == ""
    assert "did not come back" in check(asked, MicroBatch(1, back, argmax=[3, 4]))
    assert "shape [1, 5]" in check(asked, MicroBatch(1, back, argmax=[3, 4], logprobs=torch.zeros(1, 5)))
    nan = torch.zeros(2, 5)
    nan[1, 3] = float("nan")
    assert "NaN" in check(asked, MicroBatch(1, back, argmax=[3, 4], logprobs=nan))
    unasked = Sent.of(MicroBatch(1, [seg("a", [1, 2], [True, True])]))
    assert "unasked" in check(unasked, MicroBatch(1, back, argmax=[3, 4], logprobs=torch.zeros(2, 5)))


def test_a_wrong_result_fails_the_requests_of_its_batch_and_applies_nothing():
    """cb-pp (S = 1) batches A's next row with B's prompt; the result swaps their segments. Both fail with
    INTERNAL naming the fault, no token is emitted, nothing stays in flight."""
    sched = CBPPScheduler(1, node_budget=16, prefill_chunk=8)
    sched.add(Request("A", [1, 2, 3], 4))
    sched.add(Request("B", [4, 5], 4))
    (first,) = injected(sched)
    sched.on_result(MicroBatch(first.batch_id, first.segments, argmax=[7]))       # A's first token
    actions = sched.poll()
    assert [a.token_ids for a in actions if isinstance(a, Emit)] == [[7]]
    (batch,) = [a.batch for a in actions if isinstance(a, Inject)]
    assert [s.request_id for s in batch.segments] == ["A", "B"]
    sched.on_result(MicroBatch(batch.batch_id, batch.segments[::-1], argmax=[9, 9]))
    actions = sched.poll()
    assert not [a for a in actions if isinstance(a, (Emit, Inject))]
    finished = {a.request_id: a for a in actions if isinstance(a, Finish)}
    assert set(finished) == {"A", "B"} and sched.invalid_results == 1
    for f in finished.values():
        assert f.reason == "error" and f.error_code == Status.INTERNAL
        assert "segment 0 is of request 'B', 'A' was sent" in f.error
    assert not sched.requests and sched.in_flight == 0


def test_pp_with_a_token_missing_fails_instead_of_hanging():
    """Before the check a short `argmax` left pp's request with nothing in flight and no timeout."""
    sched = PPScheduler(2)
    sched.add(Request("A", [1, 2, 3], 4))
    (batch,) = injected(sched)
    sched.on_result(MicroBatch(batch.batch_id, batch.segments, argmax=[]))
    (fin,) = [a for a in sched.poll() if isinstance(a, Finish)]
    assert fin.reason == "error" and "1 output rows came back with 0 tokens" in fin.error
    assert not sched.requests and sched.in_flight == 0


def test_a_result_for_no_batch_in_flight_is_dropped():
    sched = PPScheduler(2)
    sched.add(Request("A", [1, 2, 3], 4))
    (batch,) = injected(sched)
    sched.on_result(MicroBatch(batch.batch_id + 7, batch.segments, argmax=[9]))
    assert sched.stray_results == 1 and not sched.poll() and sched.in_flight == 1
    sched.on_result(MicroBatch(batch.batch_id, batch.segments, argmax=[9]))
    assert [a.token_ids for a in sched.poll() if isinstance(a, Emit)] == [[9]]


def test_a_last_stage_answering_wrongly_fails_that_batch_only_and_the_rest_is_exact(tiny_model, tiny_hf):
    """Four requests through pp in process; the last stage answers its 5th micro-batch with another request's
    id. That batch's request fails with INTERNAL; the other three are token-identical to transformers; no
    stage keeps anything."""
    runners = make_runners(tiny_model, 2)
    last = runners[-1]
    step, seen = last.step, []

    def corrupt(batch: MicroBatch) -> MicroBatch:
        out = step(batch)
        seen.append(batch.batch_id)
        if len(seen) == 5:
            out.segments = [Segment("someone-else", s.node_ids, s.parent_ids, s.positions, s.token_ids,
                                    s.want_output) for s in out.segments]
        return out
    last.step = corrupt
    sched = PPScheduler(2)
    ps = prompts(4, seed=11)
    out = InProcessPipeline(runners).run(sched, [Request(f"r{i}", p, 6) for i, p in enumerate(ps)])
    failed = [rid for rid, o in out.items() if o.reason == "error"]
    assert len(failed) == 1 and "someone-else" in out[failed[0]].error
    for i, p in enumerate(ps):
        if f"r{i}" not in failed:
            assert out[f"r{i}"].tokens == hf_greedy(tiny_hf, p, 6)
    assert_nothing_left(sched, runners)
