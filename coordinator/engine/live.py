"""What the engine knows of one client request (pure bookkeeping: no I/O, no scheduler calls).

A request may run more than once — after a stage failure it runs again from its prompt plus the tokens
already streamed (coordinator/engine/engine.py) — so its record carries what the client has been sent and the
statistics of the earlier attempts; the final stats cover all of them.

    live.carry({"steps": 10, "tokens": 4, "hits": 3})      # attempt 1 ended by a failure
    live.final_stats({"steps": 6, "tokens": 2, "hits": 1}, now)["steps"] -> 16.0
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from coordinator.core.schedulers.base import Request, Scheduler
from coordinator.core.schedulers.registry import SpecOptions

# per-attempt stats that are not sums over the request's micro-batches
_NOT_ADDITIVE = frozenset({"tokens", "tokens_per_step", "seed"})


@dataclass
class Finished:
    reason: str
    stats: dict[str, float]
    error: str = ""
    error_code: int = 0


@dataclass
class LiveRequest:
    scheduler: Scheduler
    events: asyncio.Queue               # ("tokens", [ids]) ..., then ("finish", Finished)
    submitted: float                    # perf_counter() at submit
    request: Request                    # as the client asked (its id is the client's)
    method: str
    spec: SpecOptions | None
    wire_id: str                        # the id the current scheduler and the stages know it by
    started: bool = False               # admitted (not queued)
    cancel_reason: str = ""
    attempts: int = 0                   # re-runs after stage failures
    emitted_at_start: int = 0           # tokens the client had when the current attempt started
    fruitless: int = 0                  # stage failures in a row during which it streamed nothing new
    emitted: list[int] = field(default_factory=list)      # token ids the client has been sent
    token_times: list[float] = field(default_factory=list)
    carried: dict[str, float] = field(default_factory=dict)   # stats of the earlier attempts, summed
    rtt_ms: float = 0.0                 # inject -> result, summed over this request's own micro-batches
    busy_ms: float = 0.0                # of which stages computed or waited out emulated time
    trips: int = 0

    def carry(self, stats: dict[str, float]) -> None:
        """An attempt ended by a stage failure: keep its statistics."""
        for k, v in stats.items():
            if k not in _NOT_ADDITIVE:
                self.carried[k] = self.carried.get(k, 0.0) + v

    def account(self, rtt_ms: float, busy_ms: float) -> None:
        self.rtt_ms += rtt_ms
        self.busy_ms += busy_ms
        self.trips += 1

    def final_stats(self, stats: dict[str, float], now: float) -> dict[str, float]:
        """The scheduler's stats of the last attempt, plus the earlier attempts and what the engine timed."""
        out = dict(stats)
        for k, v in self.carried.items():
            out[k] = out.get(k, 0.0) + v
        n = len(self.emitted)
        if self.attempts:
            out["tokens"] = float(n)
            out["recoveries"] = float(self.attempts)
            out["tokens_per_step"] = n / out["steps"] if out.get("steps") else 0.0
        times = self.token_times
        out["wall_ms"] = (now - self.submitted) * 1e3
        out["ttft_ms"] = (times[0] - self.submitted) * 1e3 if times else 0.0
        out["tbt_ms"] = (times[-1] - times[0]) * 1e3 / (n - 1) if n > 1 else 0.0
        if self.trips:
            out["rtt_ms_mean"] = self.rtt_ms / self.trips
            out["overhead_ms_mean"] = (self.rtt_ms - self.busy_ms) / self.trips
            out["overhead_share"] = (self.rtt_ms - self.busy_ms) / self.rtt_ms if self.rtt_ms else 0.0
        if "draft_ms" in out:
            out["draft_share"] = out["draft_ms"] / out["wall_ms"] if out["wall_ms"] else 0.0
        return out
