"""RequestStats: which fields add up over a request's attempts, and the flat names the wire and results.json
use (hand-written here: they are the public names of `Stats.counters`)."""
from __future__ import annotations

import asyncio
from dataclasses import fields

import pytest

from coordinator.core.schedulers.base import Request
from coordinator.core.stats import RequestStats, SpecCounters, StageCounters, TTFTPhase
from coordinator.engine.live import LiveRequest


def test_every_field_says_its_unit_and_whether_it_adds_up():
    for cls in (RequestStats, SpecCounters, StageCounters):
        for f in fields(cls):
            if f.name in ("spec", "stages", "ttft_phases"):
                continue
            assert "unit" in f.metadata and "additive" in f.metadata, (cls.__name__, f.name)


def test_add_sums_the_additive_fields_and_keeps_the_others():
    a = RequestStats(steps=10, tokens=4, control_ms=1.5, sized_width=8, spec=SpecCounters(hits=3, misses=1))
    a.stage(0).rows_computed = 5.0
    b = RequestStats(steps=6, tokens=2, control_ms=0.5, sized_width=2, spec=SpecCounters(hits=1, draft_ms=2.0))
    b.stage(0).rows_computed = 1.0
    b.stage(1).wait_ms = 3.0
    a.add(b)
    assert (a.steps, a.tokens, a.control_ms, a.sized_width) == (16, 4, 2.0, 8)
    assert (a.spec.hits, a.spec.misses, a.spec.draft_ms) == (4, 1, 2.0)
    assert a.stages[0].rows_computed == 6.0 and a.stages[1].wait_ms == 3.0
    plain = RequestStats(steps=3)
    plain.add(RequestStats(steps=2, spec=SpecCounters(hits=2)))
    assert plain.steps == 5 and plain.spec.hits == 2


def test_as_dict_uses_the_wire_names():
    s = RequestStats(steps=8, tokens=4, decode_steps=3, batches=2.5, control_ms=1.25, sized_width=0, seed=7,
                     spec=SpecCounters(hits=3, misses=1, lag_steps=2), ttft_phases={TTFTPhase.QUEUE: 0.5})
    s.stage(1).rows_dropped = 4.0
    d = s.as_dict()
    assert d["steps"] == 8.0 and d["tokens"] == 4.0 and d["tokens_per_step"] == 0.5
    assert d["decode_tokens_per_step"] == 1.0 and d["batches"] == 2.5 and d["control_ms"] == 1.25
    assert d["sized_width"] == 0.0 and d["seed"] == 7.0
    assert d["hits"] == 3.0 and d["misses"] == 1.0 and d["lag_steps"] == 2.0
    assert d["stage1_rows_dropped"] == 4.0 and d["ttft_queue_ms"] == 0.5
    assert all(isinstance(v, float) for v in d.values())
    assert "rtt_ms_mean" not in d and "hits" not in RequestStats().as_dict()     # unset: left out


def test_final_stats_of_a_re_run_request_sum_its_attempts():
    live = LiveRequest(None, asyncio.Queue(), 0.0, Request("a", [1, 2], 6),  # type: ignore[arg-type]
                       "specpipe", None, "a")
    live.carry(RequestStats(steps=10, tokens=3, spec=SpecCounters(hits=2, misses=1)))
    live.attempts, live.emitted, live.token_times = 1, [5, 6, 7, 8], [1.0, 2.0, 3.0, 4.0]
    out = live.final_stats(RequestStats(steps=6, tokens=1, sized_width=4, spec=SpecCounters(hits=1)), 5.0)
    assert (out.steps, out.tokens, out.recoveries, out.sized_width) == (16, 4, 1, 4)
    assert out.spec.hits == 3 and out.spec.misses == 1
    assert out.tokens_per_step == pytest.approx(4 / 16)
    assert out.wall_ms == pytest.approx(5000.0) and out.tbt_ms == pytest.approx(1000.0)
    assert live.carried.steps == 10, "the carried stats are not changed by the final sum"
