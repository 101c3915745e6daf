"""coordinator/engine/inflight.py: when a micro-batch counts as lost."""
from __future__ import annotations

from common.batch import MicroBatch

from coordinator.core.schedulers.pp import PPScheduler
from coordinator.engine.inflight import BATCH_TIMEOUT_FACTOR, MIN_BATCH_TIMEOUT_S, InFlight


def test_one_slow_round_trip_does_not_raise_the_bound_a_slow_pipeline_does():
    f = InFlight()
    f._round_trips.extend([0.05] * 200 + [9.0])           # one 9 s trip among fast ones
    assert f.bound == MIN_BATCH_TIMEOUT_S, "before: 10 x 9 s = 90 s for the next 256 batches"
    f._round_trips.extend([5.0] * 55)                      # the pipeline is now slow (>10% of recent trips)
    assert f.bound == BATCH_TIMEOUT_FACTOR * 5.0
    assert InFlight(timeout_s=7.0).bound == 7.0


def test_a_batch_is_renumbered_on_the_wire_and_back():
    f, sched = InFlight(), PPScheduler(2)
    batch = MicroBatch(0, [])
    wire = f.sent(sched, batch)
    assert batch.batch_id == wire and len(f) == 1
    owner, sent_at = f.back(MicroBatch(wire, []))
    assert owner is sched and sent_at is not None and len(f) == 0
