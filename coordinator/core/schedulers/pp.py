"""`pp`: plain pipeline parallelism, the baseline. One node per request in flight; every token takes a
full trip through all S stages.

Request "a b c" -> inject chain [a, b, c] (output on c) -> target says x -> commit x, inject [x] -> ...
"""
from __future__ import annotations

from common.batch import Control, Segment

from coordinator.core.schedulers.base import RequestState, Scheduler


class PPScheduler(Scheduler):
    name = "pp"

    def __init__(self, num_stages: int, prefill_chunk: int = 256) -> None:
        super().__init__(num_stages)
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        self.prefill_chunk = prefill_chunk

    def _start(self, state: RequestState) -> None:
        """The prompt goes in as micro-batches of up to `prefill_chunk` rows, back to back (each stage keeps
        their order); the last row of the last one asks for the target's token."""
        prompt = state.request.prompt_ids
        nodes = [state.new_node() for _ in prompt]
        state.committed.extend(nodes)
        request_id = state.request.request_id
        self._broadcast(Control(request_id, commit=nodes))
        n = len(prompt)
        parents = [-1] + nodes[:-1]
        for a in range(0, n, self.prefill_chunk):
            b = min(n, a + self.prefill_chunk)
            self._inject([Segment(request_id, nodes[a:b], parents[a:b], list(range(a, b)), list(prompt[a:b]),
                                  [i == n - 1 for i in range(a, b)])])

    def _on_segment(self, state: RequestState, seg: Segment, outputs: list[int], logprobs=None) -> None:
        if not any(seg.want_output):
            return                            # a prompt chunk before the last
        row = self._commit_next(state, outputs)
        if row is not None:
            self._inject([row])
