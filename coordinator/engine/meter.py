"""What the coordinator's own work costs per pipeline step (the *control plane*).

Control time is the wall time of the scheduler's calls (`add`, `on_result`, `cancel`, `work`, `poll`: the
tree, verification, commits and prunes, the draft's bookkeeping, dispatch) less the draft model's compute
inside them (its `compute_s`), which has a time model of its own. A *step* is one result handled: a result's
call and every call after it up to the next result are that step's; calls before the first result
(admission, the draft's prefill) are the `startup`. The simulated clock charges both to the coordinator
(coordinator/engine/loops/simulated.py); the engine counts them per request (`control_ms`).

    meter = StepMeter()
    out, control_ms, draft_s = timed(sched.on_result, batch, draft=sched_draft)
    meter.add(control_ms, draft_ms=3.0, result=True)     # opens a step
    meter.add(0.2, draft_ms=1.5)                         # the work round after it: same step
    meter.steps -> [StepCost(control_ms=..., draft_ms=4.5)]
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class StepCost:
    control_ms: float = 0.0
    draft_ms: float = 0.0


def draft_seconds(draft: Any) -> float:
    """The draft's compute counter (0 without a draft)."""
    return draft.compute_s if draft is not None else 0.0


def timed(fn: Callable[..., Any], *args: Any, draft: Any = None) -> tuple[Any, float, float]:
    """Run fn(*args): (its result, control ms = wall time less the draft's compute, the draft's compute ms)."""
    before = draft_seconds(draft)
    start = time.perf_counter()
    out = fn(*args)
    wall = time.perf_counter() - start
    spent = draft_seconds(draft) - before
    return out, max(0.0, wall - spent) * 1e3, spent * 1e3


class StepMeter:
    """Control and draft time, bucketed by pipeline step."""

    def __init__(self) -> None:
        self.startup = StepCost()
        self.steps: list[StepCost] = []

    def add(self, control_ms: float, draft_ms: float = 0.0, result: bool = False) -> None:
        if result:
            self.steps.append(StepCost())
        cost = self.steps[-1] if self.steps else self.startup
        cost.control_ms += control_ms
        cost.draft_ms += draft_ms

    def extend(self, other: "StepMeter") -> None:
        self.steps += other.steps
        self.startup.control_ms += other.startup.control_ms
        self.startup.draft_ms += other.startup.draft_ms

    @property
    def control_ms(self) -> float:
        return self.startup.control_ms + sum(s.control_ms for s in self.steps)

    def summary(self) -> dict[str, float]:
        """Median and p90 per step, and totals (startup included), for a bench row."""
        control = [s.control_ms for s in self.steps]
        draft = [s.draft_ms for s in self.steps]
        return {"control_ms_per_step_p50": quantile(control, 0.5), "control_ms_per_step_p90": quantile(control, 0.9),
                "draft_ms_per_step_p50": quantile(draft, 0.5), "draft_ms_per_step_p90": quantile(draft, 0.9),
                "control_ms_total": self.control_ms,
                "draft_ms_total": self.startup.draft_ms + sum(draft)}


def quantile(xs: list[float], q: float) -> float:
    """Linear interpolation between order statistics (0 for no data).

    >>> quantile([4.0, 1.0, 3.0, 2.0], 0.5)
    2.5
    """
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
