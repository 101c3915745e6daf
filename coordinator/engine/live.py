"""What the engine knows of one client request (pure bookkeeping: no I/O, no scheduler calls).

A request may run more than once — after a stage failure it runs again from its prompt plus the tokens
already streamed (coordinator/engine/engine.py) — so its record carries what the client has been sent and the
statistics of the earlier attempts; the final stats cover all of them.

    live.carry(RequestStats(steps=10, tokens=4))             # attempt 1 ended by a failure
    live.final_stats(RequestStats(steps=6, tokens=2), now).steps -> 16

Time to first token in four phases (`TTFTPhase`), which add up to the stats' `ttft_ms`:

    submitted --queue--> admitted --coordinator--> first rows sent --pipeline--> last prompt row back --emit--> token
    e.g. 0 ms, admitted at 2, prompt sent at 14, its result back at 5616, first token at 5624:
    ttft_queue_ms 2, ttft_coordinator_ms 12, ttft_pipeline_ms 5602, ttft_emit_ms 8 (ttft_ms 5624)

A stage failure before the first token puts its recovery in `pipeline` (the last attempt's prompt result
counts).

`Requests` is the engine's table of them, by client id and by the attempt id of the current attempt:

    reqs.next_attempt(live)  # "a" asked for 20, streamed 7 -> Request("a.r1", prompt + those 7, 13)
    reqs.emit(Emit("a.r1", [5]))    # -> Tokens([5]) on a's queue;  Emit("a", [5]) is stale: dropped
"""
from __future__ import annotations

import asyncio
from copy import deepcopy
from dataclasses import dataclass, field, replace

from common.batch import MicroBatch

from coordinator.core.schedulers.base import Emit, Finish, Request, Scheduler
from coordinator.core.schedulers.registry import SpecOptions
from coordinator.core.stats import RequestStats, TTFTPhase
from coordinator.core.status import FinishReason, Status

# a request that made no progress through this many stage failures in a row fails itself: it may be what
# makes a stage fail (say its prefill runs the stage out of memory)
MAX_FRUITLESS = 2


@dataclass(frozen=True)
class Tokens:
    """Tokens committed for a request, in order (its queue's events before the last)."""
    token_ids: list[int]


# what a request's queue carries: Tokens as they commit, then one Finish (its id the client's)
Event = Tokens | Finish


@dataclass
class LiveRequest:
    scheduler: Scheduler
    events: asyncio.Queue[Event]
    submitted: float                    # perf_counter() at submit
    request: Request                    # as the client asked (its id is the client's)
    method: str
    spec: SpecOptions | None
    attempt_id: str                     # the id the current scheduler and the stages know it by
    started: bool = False               # admitted (not queued)
    cancel_reason: FinishReason | None = None
    attempts: int = 0                   # re-runs after stage failures
    emitted_at_start: int = 0           # tokens the client had when the current attempt started
    fruitless: int = 0                  # stage failures in a row during which it streamed nothing new
    emitted: list[int] = field(default_factory=list)      # token ids the client has been sent
    token_times: list[float] = field(default_factory=list)
    carried: RequestStats = field(default_factory=RequestStats)   # the earlier attempts' additive stats
    rtt_ms: float = 0.0                 # inject -> result, summed over this request's own micro-batches
    busy_ms: float = 0.0                # of which stages computed or waited out emulated time
    trips: int = 0
    admitted: float | None = None       # perf_counter() when its first attempt was handed to the scheduler
    first_sent: float | None = None     # ... when a micro-batch first carried its rows to stage 0
    prefilled: float | None = None      # ... when the result with its (last attempt's) last prompt row came back

    def carry(self, stats: RequestStats) -> None:
        """An attempt ended by a stage failure: keep its statistics."""
        self.carried.add(stats)

    def account(self, rtt_ms: float, busy_ms: float) -> None:
        self.rtt_ms += rtt_ms
        self.busy_ms += busy_ms
        self.trips += 1

    def final_stats(self, stats: RequestStats, now: float) -> RequestStats:
        """The scheduler's stats of the last attempt, plus the earlier attempts and what the engine timed."""
        out = deepcopy(self.carried)
        out.add(stats)
        out.sized_width, out.sized_topk, out.sized_calibration = \
            stats.sized_width, stats.sized_topk, stats.sized_calibration
        n = len(self.emitted)
        out.tokens = n if self.attempts else stats.tokens
        out.recoveries = self.attempts
        times = self.token_times
        out.wall_ms = (now - self.submitted) * 1e3
        out.ttft_ms = (times[0] - self.submitted) * 1e3 if times else 0.0
        out.tbt_ms = (times[-1] - times[0]) * 1e3 / (n - 1) if n > 1 else 0.0
        if self.trips:
            out.rtt_ms_mean = self.rtt_ms / self.trips
            out.overhead_ms_mean = (self.rtt_ms - self.busy_ms) / self.trips
            out.overhead_share = (self.rtt_ms - self.busy_ms) / self.rtt_ms if self.rtt_ms else 0.0
        out.ttft_phases = self.ttft_phases()
        if out.spec is not None:
            out.draft_share = out.spec.draft_ms / out.wall_ms if out.wall_ms else 0.0
        return out

    def ttft_phases(self) -> dict[TTFTPhase, float]:
        """Milliseconds in each TTFTPhase, once the first token was streamed (else empty)."""
        marks = [self.submitted, self.admitted, self.first_sent, self.prefilled,
                 self.token_times[0] if self.token_times else None]
        if any(m is None for m in marks):
            return {}
        return {phase: (b - a) * 1e3 for phase, a, b in zip(TTFTPhase, marks, marks[1:])}


class Requests:
    """The client requests the engine knows, running and queued (owned by the engine's loop): each by its
    client id, its current attempt by attempt id, and a queued one's turn (a future set when it may start)."""

    def __init__(self) -> None:
        self._live: dict[str, LiveRequest] = {}
        self._client_of: dict[str, str] = {}                    # attempt id of a re-run -> client request id
        self._waiting: dict[str, asyncio.Future[None]] = {}    # queued request -> set when it may start

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def get(self, request_id: str) -> LiveRequest | None:
        return self._live.get(request_id)

    def items(self) -> list[tuple[str, LiveRequest]]:
        """(client id, request), a copy: safe to change the table while going through it."""
        return list(self._live.items())

    def add(self, live: LiveRequest) -> None:
        self._live[live.request.request_id] = live

    def drop(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self._waiting.pop(request_id, None)

    def client(self, attempt_id: str) -> LiveRequest | None:
        """The request an attempt's attempt id belongs to (that attempt may be an earlier one)."""
        return self._live.get(self._client_of.get(attempt_id, attempt_id))

    def current(self, attempt_id: str) -> LiveRequest | None:
        """The request whose current attempt has this attempt id."""
        live = self.client(attempt_id)
        return live if live is not None and live.attempt_id == attempt_id else None

    # -- the admission queue ---------------------------------------------------------------------
    def queue(self, request_id: str) -> asyncio.Future[None]:
        """`request_id` waits for its turn: the future `start` sets (or `refuse` fails)."""
        fut = self._waiting[request_id] = asyncio.get_running_loop().create_future()
        return fut

    def queued(self, request_id: str) -> bool:
        return request_id in self._waiting

    def start(self, request_ids: list[str]) -> None:
        """These queued requests may run now."""
        for request_id in request_ids:
            fut = self._waiting.pop(request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def refuse(self, request_id: str, error: Exception, forget: bool = False) -> bool:
        """Fail the wait of a queued request with `error` (forget: and stop tracking it); False when
        `request_id` is not queued."""
        fut = self._waiting.pop(request_id, None) if forget else self._waiting.get(request_id)
        if fut is None:
            return False
        if not fut.done():
            fut.set_exception(error)
        return True

    def refuse_all(self, error: Exception) -> None:
        for request_id in list(self._waiting):
            self.refuse(request_id, error)

    def account(self, batch: MicroBatch, sent: float | None, now: float) -> None:
        """Round trip of a one-request micro-batch against the time stages spent on it: the rest is the
        coordinator, the transport and queueing."""
        request_ids = {s.request_id for s in batch.segments}
        live = self.client(next(iter(request_ids))) if len(request_ids) == 1 else None
        if live is not None and sent is not None:
            live.account((now - sent) * 1e3, sum(t.compute_ms + t.wait_ms for t in batch.trace))

    def sent(self, batch: MicroBatch, now: float) -> None:
        """`batch` went on the wire: the first one for a request starts its pipeline phase."""
        for seg in batch.segments:
            live = self.current(seg.request_id)
            if live is not None and live.first_sent is None:
                live.first_sent = now

    def returned(self, batch: MicroBatch, now: float) -> None:
        """`batch` came back: for a request with no token yet, the one holding its last prompt row ends the
        pipeline phase (for a re-run, the prompt is the client's plus the tokens streamed before)."""
        for seg in batch.segments:
            live = self.current(seg.request_id)
            if live is not None and not live.token_times:
                last = len(live.request.prompt_ids) + live.emitted_at_start - 1
                if last in seg.positions:
                    live.prefilled = now

    # -- events to the clients -------------------------------------------------------------------
    def emit(self, action: Emit, now: float) -> None:
        live = self.current(action.request_id)
        if live is None:
            return
        live.token_times.append(now)
        live.emitted += action.token_ids
        live.events.put_nowait(Tokens(action.token_ids))

    def finish(self, action: Finish, now: float) -> Finish | None:
        """End the request whose current attempt `action` ends: it leaves the table and its client gets the
        Finish (returned) with the client's id and the whole request's stats. None for a stale attempt."""
        request_id = self._client_of.pop(action.request_id, action.request_id)
        live = self._live.get(request_id)
        if live is None or live.attempt_id != action.request_id:
            return None
        del self._live[request_id]
        done = replace(action, request_id=request_id, stats=live.final_stats(action.stats, now))
        live.events.put_nowait(done)
        return done

    def next_attempt(self, live: LiveRequest) -> Request | Finish:
        """After a stage failure: the request to run again — its prompt plus the tokens the client has,
        for the tokens left, under the next attempt id ("<id>.r<n>") — or the Finish that ends it: cancelled
        meanwhile, already complete, or without progress through MAX_FRUITLESS failures in a row."""
        req, done = live.request, live.emitted
        left = req.max_new_tokens - len(done)
        eos = bool(done) and done[-1] in req.eos_ids
        reason = live.cancel_reason or (FinishReason.EOS if eos else FinishReason.LENGTH if left < 1 else None)
        if reason is not None:
            return Finish(live.attempt_id, reason, RequestStats())
        live.fruitless = live.fruitless + 1 if len(done) == live.emitted_at_start else 0
        if live.fruitless >= MAX_FRUITLESS:
            return Finish(live.attempt_id, FinishReason.ERROR, RequestStats(),
                          f"the pipeline failed {live.fruitless} times in a "
                          "row while this request made no progress; it is not run again (it may be what makes a "
                          "stage fail)", Status.INTERNAL)
        live.attempts += 1
        live.emitted_at_start = len(done)
        self._client_of.pop(live.attempt_id, None)
        live.attempt_id = f"{req.request_id}.r{live.attempts}"
        self._client_of[live.attempt_id] = req.request_id
        return Request(live.attempt_id, req.prompt_ids + done, left, req.eos_ids, req.sampling)
