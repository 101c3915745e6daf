"""The engine's view of specpipe's cost rule (coordinator/engine/rule_log.py): the switches a result made are
returned from the scheduler call that made them, and each is logged once with its paces and counted by why."""
from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from coordinator.core.sizing import NONE, Choice, Sizer, Sizing, Switch, Why
from coordinator.engine.rule_log import log_switches, on_result_switches


def _count(why: str) -> float:
    return REGISTRY.get_sample_value("specpipe_cost_rule_switches_total", {"method": "test-rule", "why": why}) or 0.0


class _Deciding:
    """A scheduler whose result makes its real `Sizer` switch `times` times (a decision and a topk change)."""
    name = "test-rule"

    def __init__(self, times: int) -> None:
        self.sizer, self.times = Sizer(4, Sizing.of(0, 0, 0)), times

    def on_result(self, batch: object) -> None:
        for i in range(self.times):
            self.sizer._switch(NONE if i % 2 == 0 else Choice(8, 4, 1), Why.FASTER)


@pytest.mark.parametrize("times, earlier", [(0, 0), (1, 0), (2, 3), (2, 8)])
def test_a_result_returns_the_switches_it_made_and_no_earlier_one(times, earlier):
    sched = _Deciding(earlier)
    sched.on_result(None)                        # switches before this result (8: all the sizer keeps)
    sched.times = times
    made = on_result_switches(sched, None)
    assert made == list(sched.sizer.switches)[len(sched.sizer.switches) - times:]
    assert len(made) == times and sched.sizer.switched == earlier + times


def test_a_scheduler_without_a_rule_has_no_switches():
    class Plain:
        calls = 0

        def on_result(self, batch: object) -> None:
            self.calls += 1
    sched = Plain()
    assert on_result_switches(sched, None) == [] and sched.calls == 1


def test_each_switch_is_logged_with_its_paces_and_counted_by_why():
    switches = [Switch(Choice(32, 16, 3), Choice(1, 4, 1), Why.DRAFT_BOUND, None, None, False, False),
                Switch(Choice(1, 4, 1), Choice(2, 2, 2), Why.GROW, 45.1, None, True, False),
                Switch(Choice(1, 4, 1), NONE, Why.TRY_NONE, 51.23, 54.2, True, False)]
    before = {w: _count(w) for w in ("draft_bound", "grow", "try_none", "faster")}
    with capture_logs() as logs:
        log_switches("test-rule", switches)
    assert [(e["event"], e["why"], e["reason"], e["before"], e["after"], e["before_pace"], e["after_pace"])
            for e in logs] == [
        ("cost rule switched", "draft_bound", "draft-bound start", "width 32 x 3 rounds, topk 16",
         "width 1 x 1 rounds, topk 4", "unknown", "unknown"),
        ("cost rule switched", "grow", "measuring a longer chain", "width 1 x 1 rounds, topk 4",
         "width 2 x 2 rounds, topk 2", "45.1 ms/token (measured)", "unknown"),
        ("cost rule switched", "try_none", "trying none", "width 1 x 1 rounds, topk 4", "none",
         "51.2 ms/token (measured)", "54.2 ms/token (modelled)")]
    assert all(e["log_level"] == "info" and e["method"] == "test-rule" for e in logs)
    assert {w: _count(w) - before[w] for w in before} == {"draft_bound": 1.0, "grow": 1.0, "try_none": 1.0,
                                                          "faster": 0.0}
