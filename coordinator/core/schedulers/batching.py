"""Schedulers whose micro-batches carry rows of several requests (`cb-pp`, `specpipe` = SpecPipe-DB).

The pipeline has S slots: S micro-batches in flight fill it, one per stage. Whenever a slot is free,
`_dispatch` builds the next micro-batch from every *ready* request (its previous rows came back, its draft
work is done) under a shared row budget (`node_budget`):

1. Running requests first, the most valuable rows first (`_row_value`: specpipe ranks a request by the
   chance that its next rows are used, so under load the budget goes to shallow rows and deep speculation
   is what gives way), round-robin among equals. Each gets an equal share of the budget,
   `share = max(1, node_budget // requests)` rows, counting every request the scheduler holds (running,
   prefilling, or waiting for its rows to come back); the subclass may take fewer (`_next_rows`). A request
   held alone is not capped by the budget (`_solo_share`: specpipe's width may exceed it).
   In a micro-batch that carries prompt rows each request takes at most `_share_beside_prompts` rows
   (specpipe: 1, its best node), so the prompt's trip through the stages is not slowed by deep speculation.
2. Prefill chunks then take up to `prefill_chunk` prompt rows, oldest request first — a budget of their own,
   beside the decode rows (a long prompt is not cut into node-budget slices; on a GPU a step of 32 rows
   and of 512 costs about the same). A prompt longer than that continues in the next micro-batch; the
   pipeline keeps a request's micro-batches in order, so a chunk always finds the KV of the chunk before
   it. Only the last prompt row asks for output.
3. **A prompt overtakes a full pipeline of speculation** (`overtakes`: specpipe only). When all S slots are
   taken and a request arrives whose prompt has not started, its first chunk goes in at once, alone, as
   micro-batch S + 1. It queues at stage 0 behind the micro-batch there instead of waiting for the next
   result to come back and for the coordinator to handle it (its draft round included). The result that comes
   back next is not refilled, so the pipeline is S deep again one step later: the prompt took the slot it
   would have taken anyway, only sooner, and only the decode rows that would have gone beside it wait that
   step. One such micro-batch is in flight at a time (at most 1 in S slots overtakes; under a stream of
   arrivals the others take ordinary slots, beside decode rows). A prompt longer than a chunk continues
   through ordinary slots. `cb-pp` does not overtake: its full pipeline holds one sure token per request, and
   a prompt going first holds a whole group of them back a step and unsettles the groups' rotation (on the
   simulated clock, S = 8, its time to first token p50 rose from 2138 to 2470 ms at 32 clients).
4. **A finished request's slot is held for the next prompt** (`holds_finished_slot`: specpipe only). When a
   result ends a request (its length or an end-of-sequence token), another micro-batch is still in flight
   and no prompt rows wait, one slot stays empty until the next event. A request that arrives meanwhile
   takes it at once and finds stage 0 free, as in a pipeline that is not full; otherwise the next result
   refills it beside its own slot. A client that sends its next request the moment its last one ends (an
   agent, a harness with a fixed number of clients) thus no longer waits a whole stage time behind the
   speculation that refilled the slot an instant before. When nobody comes, every micro-batch behind the
   empty slot goes one stage time later, so the scheduler holds only while it pays: it watches whether a
   request arrives between each finish and the next result (held or not) and holds while that happened
   at least half the time lately (`FollowRate`; random arrivals rarely land in that window). There is
   no timer: the next result ends the hold, so one must be in flight (S = 1 never holds); and a slot must
   be free (an overtaker of rule 3 may keep S in flight after the result: nothing to hold). `cb-pp` does
   not hold: the micro-batch it would refill carries the next sure token of each request in it.

       S = 8, A ends in a result while 7 micro-batches are in flight: none goes in (holding). B arrives ->
       B's first chunk and one row per running request go in now, 8 in flight. Or no one arrives -> the
       next result refills two slots, and stage 0 takes them one stage time apart.

Decode rows never exceed `node_budget` except when a single request's rows alone do (a bonus node is never
split, a lone request may use its whole width). Worked example, node_budget 8, prefill_chunk 6, S = 2,
requests A (running), B (running), C (new, 10-token prompt): share = 8 // 3 = 2 -> A 2 rows, B 2 rows, C's
first 6 prompt rows; the next free slot carries C's other 4 prompt rows beside whatever A and B have ready.
"""
from __future__ import annotations

from abc import abstractmethod

from common.batch import Control, MicroBatch, Segment

from coordinator.core.schedulers.base import RequestState, Scheduler
from coordinator.core.status import FinishReason


class FollowRate:
    """How often a request arrives between a result that ended a request and the next result (rule 4):
    counts that fade by `decay` per finish, Laplace-smoothed. Holding a slot pays while that is at least
    even: a followed finish saves the prompt a stage time, an unfollowed one delays the running requests.

        new: rate (0 + 1) / (0 + 2) = 0.5 -> holds.  Two finishes with no request after them (decay 0.8):
        followed 0, seen 1.8, rate 1 / 3.8 = 0.26 -> does not hold.  Then two followed ones: followed 1.8,
        seen 2.952, rate 2.8 / 4.952 = 0.57 -> holds again.
    """

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.followed = 0.0
        self.seen = 0.0

    def observe(self, followed: bool) -> None:
        self.followed = self.decay * self.followed + followed
        self.seen = self.decay * self.seen + 1

    @property
    def rate(self) -> float:
        return (self.followed + 1) / (self.seen + 2)

    @property
    def pays(self) -> bool:
        return self.rate >= 0.5


class BatchingScheduler(Scheduler):
    overtakes = False              # a fresh prompt may go in beyond a full pipeline (rule 3)
    holds_finished_slot = False    # a request finished in a result: its slot waits for the next event (rule 4)

    def __init__(self, num_stages: int, node_budget: int = 32, prefill_chunk: int = 256) -> None:
        super().__init__(num_stages)
        if node_budget < 1 or prefill_chunk < 1:
            raise ValueError("node_budget and prefill_chunk must be at least 1")
        self.node_budget = node_budget
        self.prefill_chunk = prefill_chunk
        self.prefill_next: dict[str, int] = {}     # request -> index of its next prompt row to inject
        self._turn = 0                             # round-robin offset over running requests
        self._overtaker: int | None = None         # id of the micro-batch that last overtook a full pipeline
        self._in_result = False                    # on_result is running (a finish there may hold a slot)
        self.holding = False                       # one slot kept free for a prompt until the next event
        self.follow = FollowRate()                 # how often a request arrives right after a finish
        self._watching = False                     # a finish in the last result: does a request follow?
        self.holds_taken = 0                       # holds a request arrived into
        self.holds_lapsed = 0                      # holds the next result ended

    # -- hooks for subclasses -----------------------------------------------------------------------
    @abstractmethod
    def _ready(self, state: RequestState) -> bool:
        """The request (prefill fully injected) may put rows into the next micro-batch."""

    @abstractmethod
    def _next_rows(self, state: RequestState, share: int) -> Segment | None:
        """The request's rows for the next micro-batch (at most `share`, unless one indivisible row set
        is larger), marked as injected; None when it has nothing to send."""

    def _admitted(self, state: RequestState) -> None:
        """The request's prompt nodes exist (state.committed) and are about to be prefilled."""

    def _solo_share(self) -> int:
        """Rows a request may take when it is the only one held (the budget shares rows between requests;
        it does not cap a lone request)."""
        return self.node_budget

    def _share(self) -> int:
        n = len(self.requests)
        return self._solo_share() if n <= 1 else max(1, self.node_budget // n)

    def _share_beside_prompts(self) -> int:
        """Rows a running request may take in a micro-batch that carries prompt rows (the prompt's time to
        first token is that micro-batch's trip through every stage)."""
        return self.node_budget

    def _decode_cap(self) -> int:
        """At most this many rows of running requests per micro-batch."""
        return self.node_budget

    def _row_value(self, state: RequestState) -> float:
        """Expected worth of the request's next rows, for the order in which ready requests take the budget
        (highest first; equal values keep the round-robin order). Every row of a plain method is worth the
        same."""
        return 1.0

    # -- scheduler hooks ----------------------------------------------------------------------------
    def _start(self, state: RequestState) -> None:
        request_id, prompt = state.request.request_id, state.request.prompt_ids
        nodes = [state.new_node() for _ in prompt]
        state.committed.extend(nodes)
        self._broadcast(Control(request_id, commit=nodes))
        self.prefill_next[request_id] = 0
        self._admitted(state)
        if self._watching:            # a request followed the last finish
            self.follow.observe(True)
            self._watching = False
        self.holds_taken += self.holding
        self.holding = False          # the slot held for a prompt is this one's
        self._dispatch()

    def on_result(self, batch: MicroBatch) -> None:
        if self._watching:            # no request followed the last finish
            self.follow.observe(False)
            self._watching = False
        self.holds_lapsed += self.holding
        self.holding = False          # a hold lasts until the next result at most
        self._in_result = True
        try:
            super().on_result(batch)
        finally:
            self._in_result = False
        self._dispatch()

    def _finish(self, state: RequestState, reason: FinishReason, error: str = "", error_code: int = 0) -> None:
        self.prefill_next.pop(state.request.request_id, None)
        super()._finish(state, reason, error, error_code)
        if self.holds_finished_slot and self._in_result and 0 < self.in_flight < self.num_stages and \
                self.requests and reason in (FinishReason.LENGTH, FinishReason.EOS):
            self._watching = True     # rule 4: the next result (one is in flight) ends the hold at the latest
            self.holding = self.follow.pays

    # -- batching -----------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Fill free pipeline slots (less one while `holding` and no prompt rows wait, rule 4) with
        micro-batches of ready requests; then, if the pipeline is full, let prompts that have not started
        overtake (rule 3 above)."""
        held = self.holding and not self.prefill_next        # prompt rows waiting take the held slot
        while self.in_flight < self.num_stages - held:
            segments = self._gather()
            if not segments:
                return
            self._inject(segments)
        if self.overtakes and self.in_flight == self.num_stages and self._overtaker not in self._batches:
            self._overtake()

    def _overtake(self) -> None:
        """One micro-batch beyond S of first chunks only, oldest prompt first, under the prefill budget.

            S = 4, 4 micro-batches in flight, C arrives (10-token prompt, chunk 6) -> [C's rows 0..5] goes in
            now, 5 in flight. D arrives -> waits (C's batch is still in flight); a result comes back -> 4 in
            flight, no slot is free; the next result frees one for C's rows 6..9, D's chunk and decode rows.
        """
        segments: list[Segment] = []
        left = self.prefill_chunk
        for request_id, start in list(self.prefill_next.items()):
            if left <= 0:
                break
            if start == 0:
                segments.append(self._prefill_chunk(self.requests[request_id], left))
                left -= segments[-1].rows
        if segments:
            self._overtaker = self._inject(segments)

    def _gather(self) -> list[Segment]:
        request_ids = list(self.requests)
        if request_ids:
            k = self._turn % len(request_ids)
            request_ids = request_ids[k:] + request_ids[:k]
            self._turn += 1
        prefilling = [r for r in self.requests if r in self.prefill_next]      # oldest first
        running = [r for r in request_ids if r not in self.prefill_next and self._ready(self.requests[r])]
        if len(running) > 1:
            running.sort(key=lambda r: -self._row_value(self.requests[r]))  # stable: round-robin among equals
        if not prefilling and not running:
            return []
        share = self._share()
        solo = len(self.requests) == 1           # a lone request's decode rows are capped by its share only
        segments: list[Segment] = []
        left = share if solo else self.node_budget
        decode_left = share if solo else self._decode_cap()
        if prefilling:                           # a prompt goes in: this micro-batch stays small
            share = min(share, self._share_beside_prompts())
        for request_id in running:
            if left <= 0 or decode_left <= 0:
                break
            seg = self._next_rows(self.requests[request_id], min(share, left, decode_left))
            if seg is not None and seg.rows:
                segments.append(seg)
                left -= seg.rows
                decode_left -= seg.rows
        prefill_left = self.prefill_chunk            # prompts have their own budget beside the decode rows
        for request_id in prefilling:
            if prefill_left <= 0:
                break
            segments.append(self._prefill_chunk(self.requests[request_id], prefill_left))
            prefill_left -= segments[-1].rows
        return segments

    def _prefill_chunk(self, state: RequestState, rows: int) -> Segment:
        request_id, prompt = state.request.request_id, state.request.prompt_ids
        start = self.prefill_next[request_id]
        end = min(len(prompt), start + rows)
        nodes = state.committed[start:end]
        parents = [state.committed[i - 1] if i else -1 for i in range(start, end)]
        want = [i == len(prompt) - 1 for i in range(start, end)]
        if end == len(prompt):
            del self.prefill_next[request_id]
        else:
            self.prefill_next[request_id] = end
        return Segment(request_id, nodes, parents, list(range(start, end)), list(prompt[start:end]), want)
