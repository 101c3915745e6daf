"""specpipe's cost rule (coordinator/core/sizing.py), seen from the engine: each switch it makes is logged at
INFO (`cost rule switched`, with why and the two paces it compared) and counted by why. The core keeps the
switches (`Sizer.switches`) and does not log; the engine reads the new ones in the call that made them, under
the scheduler's lock, and logs them after it. (The simulated clock drives schedulers without the engine: its
runs log nothing.)"""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter

from common.batch import MicroBatch
from common.logs import get_logger

from coordinator.core.schedulers.base import Scheduler
from coordinator.core.sizing_choices import Choice, Switch

log = get_logger(__name__)
SWITCHES = Counter("specpipe_cost_rule_switches_total", "specpipe's cost rule changing its choice "
                   "(coordinator/core/sizing.py), by why: draft_bound (a start whose draft cannot keep up), "
                   "grow (measuring a wider, deeper choice where stages share cores), try_none (measuring plain "
                   "pipelining), faster (a choice expected faster), coverage (topk alone)", ["method", "why"])


def on_result_switches(sched: Scheduler, batch: MicroBatch) -> list[Switch]:
    """`sched.on_result(batch)`, and the switches of specpipe's cost rule it made (at most two a result: a
    decision and a topk change; `Sizer.switches` keeps the last 8)."""
    sizer = getattr(sched, "sizer", None)
    before = sizer.switched if sizer is not None else 0
    sched.on_result(batch)
    if sizer is None or sizer.switched == before:
        return []
    return list(sizer.switches)[-min(sizer.switched - before, len(sizer.switches)):]


def log_switches(method: str, switches: Iterable[Switch]) -> None:
    """Log and count these switches (a few per pipeline and load: INFO).

        {"method": "specpipe", "why": "try_none", "reason": "trying none", "before": "width 1 x 1 rounds, topk 4",
         "after": "none",
         "before_pace": "51.2 ms/token (measured)", "after_pace": "54.2 ms/token (modelled)", ...}
    """
    def named(c: Choice) -> str:
        return f"width {c.width} x {c.rounds} rounds, topk {c.topk}" if c.speculates else "none"

    def pace(ms: float | None, measured: bool) -> str:
        return "unknown" if ms is None else f"{ms:.1f} ms/token ({'measured' if measured else 'modelled'})"
    for s in switches:
        SWITCHES.labels(method, s.why.label).inc()
        log.info("cost rule switched", method=method, why=s.why.label, reason=s.why.value, before=named(s.before),
                 after=named(s.after), before_pace=pace(s.before_ms, s.before_measured),
                 after_pace=pace(s.after_ms, s.after_measured))
