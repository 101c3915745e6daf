"""Driving a scheduler by hand, micro-batch by micro-batch, to follow a rule on hand-computed cases:

    m1, m2 = injected(sched)           # what it put in since the last look
    (m3,) = back(sched, m1)            # m1 returns (token 9 for every output row); m3 went in
    rows_of(m3) == {"A": [3], "C": [0, 1]}     # request -> positions of its rows
"""
from __future__ import annotations

from common.batch import MicroBatch

from coordinator.core.schedulers.base import Inject, Scheduler


def injected(sched: Scheduler) -> list[MicroBatch]:
    """The micro-batches the scheduler injected since the last poll (other actions are dropped)."""
    return [a.batch for a in sched.poll() if isinstance(a, Inject)]


def back(sched: Scheduler, batch: MicroBatch, token: int = 9) -> list[MicroBatch]:
    """The last stage returns `batch` with `token` for every output row; returns what the scheduler injects."""
    outputs = sum(sum(s.want_output) for s in batch.segments)
    sched.on_result(MicroBatch(batch.batch_id, batch.segments, argmax=[token] * outputs))
    return injected(sched)


def rows_of(batch: MicroBatch) -> dict[str, list[int]]:
    """Request id -> the positions of its rows in `batch`."""
    return {s.request_id: s.positions for s in batch.segments}
