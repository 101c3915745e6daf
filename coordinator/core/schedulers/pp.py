"""`pp`: plain pipeline parallelism, the baseline. One node per request in flight; every token takes a
full trip through all S stages.

Request "a b c" -> inject chain [a, b, c] (output on c) -> target says x -> commit x, inject [x] -> ...
"""
from __future__ import annotations

from services.batch import Control, Segment

from coordinator.core.schedulers.base import RequestState, Scheduler


class PPScheduler(Scheduler):
    name = "pp"

    def _start(self, state: RequestState) -> None:
        prompt = state.request.prompt_ids
        nodes = [state.new_node() for _ in prompt]
        state.committed.extend(nodes)
        rid = state.request.request_id
        self._broadcast(Control(rid, commit=nodes))
        n = len(prompt)
        self._inject([Segment(rid, nodes, [-1] + nodes[:-1], list(range(n)), list(prompt),
                              [False] * (n - 1) + [True])])

    def _on_segment(self, state: RequestState, seg: Segment, outputs: list[int], logprobs=None) -> None:
        row = self._commit_next(state, outputs)
        if row is not None:
            self._inject([row])
