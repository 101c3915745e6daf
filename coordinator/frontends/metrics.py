"""The coordinator's Prometheus metrics, in one place (prometheus-client's global registry).

Coordinator.generate wraps each request in a `RequestMetrics` (a context manager):

    with RequestMetrics(method) as m:     # the clock starts: submit time, TTFT is measured from here
        m.tokens(n)                       # each chunk of n streamed tokens: TTFT, TBT gaps, token counter
        m.finished(reason, stats)         # the final chunk: outcome, TTFT phases, tokens/step, hit rate, ...
    # an exception leaving the block records its outcome: cancelled (client left), or a status name

Time between tokens is observed once per token gap, so a request of N streamed tokens adds N - 1
observations whose sum is the time from its first token to its last: a chunk of n tokens arriving `dt`
after the previous chunk counts as n gaps of dt / n (several tokens committed by one verification
share the wait), and the tokens after the first in the first chunk as gaps of 0.

The queue and active-request gauges read the engine's admission state when scraped (`track`), and
specpipe_repartitions_total lives with the re-partitioning code (coordinator/engine/scaling.py).
"""
from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from coordinator.core.vocabulary import METHODS
from coordinator.core.status import FinishReason, Status
from coordinator.core.stats import RequestStats

if TYPE_CHECKING:
    from coordinator.engine.engine import Engine

TBT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKENS_PER_STEP_BUCKETS = (0.05, 0.1, 0.125, 0.2, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0)
ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)

REQUESTS = Counter("specpipe_requests", "Generate requests by method and outcome: the finish reason "
                   "(length, eos, stop), cancelled (the client left), or the gRPC status of a failure "
                   "(invalid_argument, resource_exhausted, unavailable, internal, ...)", ["method", "outcome"])
TOKENS = Counter("specpipe_generated_tokens", "Tokens streamed to clients", ["method"])
TTFT = Histogram("specpipe_time_to_first_token_seconds", "Submit (including the admission queue) to the "
                 "first streamed token", ["method"], buckets=TTFT_BUCKETS)
TTFT_PHASE = Histogram("specpipe_time_to_first_token_phase_seconds", "The engine's time to first token in "
                       "phases that add up to it: queue (the admission queue), coordinator (admitted to its first "
                       "rows on the wire), pipeline (to the result with its last prompt row), emit (to the first "
                       "token streamed); observed when the request ends", ["method", "phase"],
                       buckets=PHASE_BUCKETS)
TBT = Histogram("specpipe_time_between_tokens_seconds", "Gap between consecutive streamed tokens, one "
                "observation per gap (tokens arriving together share the wait)", ["method"], buckets=TBT_BUCKETS)
TOKENS_PER_STEP = Histogram("specpipe_tokens_per_step", "Tokens committed per pipeline step, per finished "
                            "request", ["method"], buckets=TOKENS_PER_STEP_BUCKETS)
DECODE_TOKENS_PER_STEP = Histogram("specpipe_decode_tokens_per_step", "Tokens committed per pipeline step from "
                                   "the first committed token to the last (what time between tokens follows), "
                                   "per finished request", ["method"], buckets=TOKENS_PER_STEP_BUCKETS)
STALLED_STEPS = Counter("specpipe_stalled_steps", "SpecPipe steps whose result committed nothing: kind=lag (the "
                        "true path's next node went in late) or refill (the pipeline refilling after a miss)",
                        ["method", "kind"])
HIT_RATE = Histogram("specpipe_draft_hit_rate", "Share of a finished request's tokens that were accepted "
                     "draft tokens: hits / (hits + misses) (speculative methods)", ["method"], buckets=RATE_BUCKETS)
ACCEPT_LENGTH = Histogram("specpipe_acceptance_length", "Tokens committed per draft run of a finished request "
                          "(a run ends with a miss, the target's bonus token included): (hits + misses) / "
                          "max(misses, 1)", ["method"], buckets=ACCEPT_BUCKETS)
DRAFT_TOKENS = Counter("specpipe_draft_tokens", "Committed tokens of the speculative methods: result=hit "
                       "(an accepted draft token) or miss (the target's own bonus token)", ["method", "result"])
CONTROL_PER_STEP = Histogram("specpipe_control_seconds_per_step", "The coordinator's own time (scheduler, tree, "
                             "verification, dispatch; the draft model's compute excluded) per pipeline step, per "
                             "finished request", ["method"], buckets=TBT_BUCKETS)
SIZED_WIDTH = Gauge("specpipe_sized_width", "specpipe's width as its cost rule had it for the last finished request "
                    "(0: no speculation, plain pipelining; coordinator/core/sizing.py)", ["method"])
SIZED_TOPK = Gauge("specpipe_sized_topk", "specpipe's topk (children per expanded node) as its cost rule had it for "
                   "the last finished request (0: no speculation)", ["method"])
SIZED_CALIBRATION = Gauge("specpipe_sized_calibration", "specpipe's cost rule: the measured pace of its speculating "
                          "choice over what its model predicts, as of the last finished request (1: the model is "
                          "exact; what it leaves out: shared cores, lag, refills; set once the rule has decided)",
                          ["method"])
QUEUED = Gauge("specpipe_queued_requests", "Requests waiting in the admission queue")
ACTIVE = Gauge("specpipe_active_requests", "Requests admitted and running")


def track(engine: "Engine") -> None:
    """Point the load gauges at this engine's admission state (the newest engine wins; weakly held)."""
    ref = weakref.ref(engine)

    def reader(part: str) -> Callable[[], float]:
        def read() -> float:
            e = ref()
            return float(len(getattr(e.admission, part))) if e is not None else 0.0
        return read

    QUEUED.set_function(reader("queue"))
    ACTIVE.set_function(reader("active"))


def outcome_of(error: BaseException) -> str:
    """The `outcome` label of a request that ended with this exception."""
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
        return "cancelled"
    code = getattr(error, "code", None)
    if isinstance(code, int):           # GenerationFailed.code: a Status
        return Status.of(code).name.lower()
    if isinstance(error, ValueError):
        return "invalid_argument"
    return "internal"


class RequestMetrics:
    """One request's observations; see the module docstring. Not thread-safe (the event loop's)."""

    def __init__(self, method: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.method = method if method in METHODS else "unknown"     # bounded label values
        self._clock = clock
        self.submitted = clock()
        self.streamed = 0
        self.outcome = ""
        self._last: float | None = None

    def __enter__(self) -> "RequestMetrics":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if error is not None:
            self.record_outcome(outcome_of(error))

    def tokens(self, n: int) -> None:
        """n tokens were just streamed."""
        if n <= 0:
            return
        now = self._clock()
        TOKENS.labels(self.method).inc(n)
        tbt = TBT.labels(self.method)
        if self._last is None:
            TTFT.labels(self.method).observe(now - self.submitted)
            gaps, gap = n - 1, 0.0
        else:
            gaps, gap = n, (now - self._last) / n
        for _ in range(gaps):
            tbt.observe(gap)
        self._last = now
        self.streamed += n

    def finished(self, reason: FinishReason, stats: RequestStats) -> None:
        """The request ended normally with this finish reason and the engine's per-request stats."""
        self.record_outcome(reason)
        for phase, ms in stats.ttft_phases.items():
            TTFT_PHASE.labels(self.method, phase.value).observe(ms / 1e3)
        if stats.batches and stats.control_ms > 0:          # 0: this driver does not measure it
            CONTROL_PER_STEP.labels(self.method).observe(stats.control_ms / stats.batches / 1e3)
        if stats.sized_width is not None:
            SIZED_WIDTH.labels(self.method).set(stats.sized_width)
        if stats.sized_topk is not None:
            SIZED_TOPK.labels(self.method).set(stats.sized_topk)
        if stats.sized_calibration is not None:
            SIZED_CALIBRATION.labels(self.method).set(stats.sized_calibration)
        if stats.steps:
            TOKENS_PER_STEP.labels(self.method).observe(stats.tokens_per_step)
        if stats.decode_steps:
            DECODE_TOKENS_PER_STEP.labels(self.method).observe(stats.decode_tokens_per_step)
        spec = stats.spec
        if spec is None:
            return
        for kind, steps in (("lag", spec.lag_steps), ("refill", spec.refill_steps)):
            if steps:
                STALLED_STEPS.labels(self.method, kind).inc(steps)
        hits, misses = spec.hits, spec.misses
        if hits + misses <= 0:
            return
        DRAFT_TOKENS.labels(self.method, "hit").inc(hits)
        DRAFT_TOKENS.labels(self.method, "miss").inc(misses)
        HIT_RATE.labels(self.method).observe(hits / (hits + misses))
        ACCEPT_LENGTH.labels(self.method).observe((hits + misses) / max(misses, 1.0))

    def record_outcome(self, outcome: str) -> None:
        """Count the request once, with the first outcome recorded."""
        if not self.outcome:
            self.outcome = outcome
            REQUESTS.labels(self.method, outcome).inc()
