"""A scheduler run over stage runners called directly, one pipeline step at a time (tests, equivalence checks):
`InProcessPipeline.run(scheduler, requests)`. A loop that drives a scheduler, not a Transport of the engine
(coordinator/engine/transports/); its sibling simulated.py does the same on a simulated clock.

Each tick every stage computes the micro-batch in front of it (stage i's output is stage i+1's input at
the next tick), results of the last stage go to the scheduler, control messages reach every stage at once,
and at most one new micro-batch enters stage 0.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.batch import MicroBatch
from services.runner import StageRunner

from coordinator.core.schedulers.base import Broadcast, Emit, Finish, Inject, Request, Scheduler
from coordinator.core.stats import RequestStats


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    reason: str = ""
    stats: RequestStats = field(default_factory=RequestStats)
    error: str = ""


class InProcessPipeline:
    def __init__(self, runners: list[StageRunner]) -> None:
        if not runners:
            raise ValueError("a pipeline needs at least one stage")
        self.runners = runners
        self.ticks = 0

    def run(self, scheduler: Scheduler, requests: list[Request], max_ticks: int = 100_000,
            on_tick: Callable[[], None] | None = None, arrive: dict[str, int] | None = None,
            cancel: dict[str, int] | None = None) -> dict[str, Outcome]:
        """Run requests to completion; `on_tick` is called after every pipeline step (for invariants).
        `arrive` / `cancel` map request ids to the tick at which they are added / cancelled (default:
        all arrive at tick 0, none is cancelled)."""
        outcomes = {r.request_id: Outcome() for r in requests}
        arrive, cancel = arrive or {}, dict(cancel or {})
        pending = sorted(requests, key=lambda r: arrive.get(r.request_id, 0))
        stages: list[MicroBatch | None] = [None] * len(self.runners)
        waiting: deque[MicroBatch] = deque()
        done: set[str] = set()
        for tick in range(max_ticks):
            while pending and arrive.get(pending[0].request_id, 0) <= tick:
                scheduler.add(pending.pop(0))
            for request_id in [r for r, t in cancel.items() if t <= tick]:
                del cancel[request_id]
                scheduler.cancel(request_id)
            self._apply(scheduler, outcomes, waiting, done)
            if len(done) == len(requests) and not any(stages) and not waiting:
                return outcomes
            if stages[0] is None and waiting:
                stages[0] = waiting.popleft()
            nxt: list[MicroBatch | None] = [None] * len(self.runners)
            for i, batch in enumerate(stages):
                if batch is None:
                    continue
                out = self.runners[i].step(batch)
                if i + 1 < len(self.runners):
                    nxt[i + 1] = out
                else:
                    scheduler.on_result(out)
            stages = nxt
            self.ticks += 1
            self._apply(scheduler, outcomes, waiting, done)
            if on_tick is not None:
                on_tick()
        raise RuntimeError(f"pipeline did not finish within {max_ticks} ticks")

    def _apply(self, scheduler, outcomes, waiting, done) -> None:
        self._dispatch(scheduler, outcomes, waiting, done)
        while scheduler.has_work:                  # draft work happens between pipeline steps
            scheduler.work()
            self._dispatch(scheduler, outcomes, waiting, done)

    def _dispatch(self, scheduler, outcomes, waiting, done) -> None:
        for action in scheduler.poll():
            if isinstance(action, Inject):
                waiting.append(action.batch)
            elif isinstance(action, Broadcast):
                for r in self.runners:
                    r.apply(action.control)
            elif isinstance(action, Emit):
                outcomes[action.request_id].tokens.extend(action.token_ids)
            elif isinstance(action, Finish):
                o = outcomes[action.request_id]
                o.reason, o.stats, o.error = action.reason, action.stats, action.error
                done.add(action.request_id)
