"""A result checked against the micro-batch it answers, before any of it is applied.

The last stage hands back, for every segment it was sent and in the same order, either that segment with the
rows that survived (a subsequence of the rows sent: a stage drops rows that are dead, never adds or reorders
any) or a failed segment of the same request with no rows; then one token per surviving output row, and the
rows' log-probabilities when the micro-batch asked. Anything else is the stage's fault — a segment of another
request, a row that was not sent, a token per output row too few or too many, a NaN — and nothing of that
result may reach a request's state: `check` names the first fault, the scheduler then fails the batch's
requests (coordinator/core/schedulers/base.py).

    sent = Sent.of(MicroBatch(7, [Segment("a", [1, 2], [0, 1], [4, 5], [9, 8], [False, True])]))
    check(sent, <the same segment back, argmax [3]>)             -> ""
    check(sent, <the segment of request "b" back>)                -> "segment 0 is of request 'b', 'a' was sent"
    check(sent, <segment "a" with node 2 back, argmax []>)        -> "1 output rows came back with 0 tokens"
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.batch import MicroBatch


@dataclass(frozen=True)
class SentSegment:
    request_id: str
    node_ids: tuple[int, ...]       # [rows] in the order sent
    want_output: tuple[bool, ...]   # [rows]


@dataclass(frozen=True)
class Sent:
    """What one micro-batch carried: its segments' rows, and whether it asked for log-probabilities."""
    segments: tuple[SentSegment, ...]
    logprobs: bool

    @classmethod
    def of(cls, batch: MicroBatch) -> "Sent":
        return cls(tuple(SentSegment(s.request_id, tuple(s.node_ids), tuple(s.want_output))
                         for s in batch.segments), batch.return_logprobs)


def check(sent: Sent, result: MicroBatch) -> str:
    """'' when `result` can answer `sent`, else the first fault found (a sentence for the error message)."""
    if len(result.segments) != len(sent.segments):
        return f"{len(result.segments)} segments came back for {len(sent.segments)} sent"
    outputs = 0
    for i, (want, seg) in enumerate(zip(sent.segments, result.segments)):
        if seg.request_id != want.request_id:
            return f"segment {i} is of request {seg.request_id!r}, {want.request_id!r} was sent"
        if seg.error:
            if seg.rows:
                return f"the failed segment of request {want.request_id!r} has {seg.rows} rows"
            continue
        fault = _rows_fault(want, seg.node_ids, seg.want_output,
                            (len(seg.parent_ids), len(seg.positions), len(seg.token_ids)))
        if fault:
            return fault
        outputs += sum(seg.want_output)
    if len(result.argmax) != outputs:
        return f"{outputs} output rows came back with {len(result.argmax)} tokens"
    if len(result.argmax) and min(result.argmax) < 0:
        return "a negative token id came back"
    return _logprobs_fault(sent.logprobs, result.logprobs, outputs)


def _rows_fault(want: SentSegment, node_ids: list[int], want_output: list[bool], lengths: tuple[int, ...]) -> str:
    """The rows of one segment: the same count in every field, each row one that was sent (in order) with the
    same want_output."""
    request_id = want.request_id
    if len(want_output) != len(node_ids) or any(n != len(node_ids) for n in lengths):
        return f"the segment of request {request_id!r} has fields of different lengths"
    if tuple(node_ids) == want.node_ids and tuple(want_output) == want.want_output:
        return ""                                   # every row came back (the usual case: one comparison)
    j = 0
    for node, wants in zip(node_ids, want_output):
        while j < len(want.node_ids) and want.node_ids[j] != node:
            j += 1
        if j == len(want.node_ids):
            return f"node {node} of request {request_id!r} came back but was not sent (or came back out of order)"
        if want.want_output[j] != wants:
            return (f"node {node} of request {request_id!r} came back with want_output {wants}, "
                    f"sent {want.want_output[j]}")
        j += 1
    return ""


def _logprobs_fault(asked: bool, logprobs: torch.Tensor | None, outputs: int) -> str:
    if logprobs is None:
        return "the log-probabilities asked for did not come back" if asked and outputs else ""
    if not asked:
        return "log-probabilities came back unasked"
    if logprobs.dim() != 2 or logprobs.shape[0] != outputs:
        return f"log-probabilities of shape {list(logprobs.shape)} came back for {outputs} output rows"
    if logprobs.is_floating_point() and bool(torch.isnan(logprobs).any()):
        return "log-probabilities with NaN came back"
    return ""
