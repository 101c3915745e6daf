"""`cb-pp`: continuous batching over the pipeline (what vLLM does with pipeline parallelism), the
multi-request baseline. Each request has one row in flight at a time, as in `pp`; micro-batches carry the
next token of a group of requests, and the groups rotate through the stages.

Groups form by themselves: the rows of running requests per micro-batch are capped at
ceil(running / S), so with 16 running requests and S = 8 the pipeline holds 8 micro-batches of 2
requests each, and a returning micro-batch's requests make up the next one. New requests' prompts go
in as prefill chunks beside them (coordinator/core/schedulers/batching.py).
"""
from __future__ import annotations

import math

from common.batch import Segment

from coordinator.core.schedulers.base import RequestState
from coordinator.core.schedulers.batching import BatchingScheduler
from coordinator.core.status import FinishReason


class CBPPScheduler(BatchingScheduler):
    name = "cb-pp"

    def __init__(self, num_stages: int, node_budget: int = 32, prefill_chunk: int = 256) -> None:
        super().__init__(num_stages, node_budget, prefill_chunk)
        self.next_row: dict[str, Segment] = {}     # request -> its committed token waiting to go in

    def _ready(self, state: RequestState) -> bool:
        return state.request.request_id in self.next_row

    def _next_rows(self, state: RequestState, share: int) -> Segment | None:
        return self.next_row.pop(state.request.request_id, None)

    def _decode_cap(self) -> int:
        running = sum(1 for r in self.requests if r not in self.prefill_next)
        return min(self.node_budget, max(1, math.ceil(running / self.num_stages)))

    def _on_segment(self, state: RequestState, seg: Segment, outputs: list[int], logprobs=None) -> None:
        row = self._commit_next(state, outputs)
        if row is not None:
            self.next_row[state.request.request_id] = row

    def _finish(self, state: RequestState, reason: FinishReason, error: str = "", error_code: int = 0) -> None:
        self.next_row.pop(state.request.request_id, None)
        super()._finish(state, reason, error, error_code)
