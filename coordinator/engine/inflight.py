"""The micro-batches on the wire: whose each one is, when it left, and when one counts as lost.

Schedulers number their micro-batches themselves; on the wire each gets an engine-wide id, so that several
schedulers (one per method and speculation settings) share one pipeline. A batch not back within
`timeout_s` (given, else max(MIN_BATCH_TIMEOUT_S, BATCH_TIMEOUT_FACTOR x the 90th percentile of the recent
round trips: one slow trip does not raise it, a pipeline that stays slow does) was
lost: a stage dropped it, a stream reset after accepting it, or a compute step hangs.

    f = InFlight(); wire = f.sent(sched, batch)     # batch.batch_id 0 (the scheduler's) -> wire id 1
    f.back(result_with_id_1) -> (sched, sent_at)     # result.batch_id is the scheduler's 0 again
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable
from typing import TypeVar

from common.batch import MicroBatch
from common.logs import get_logger

from coordinator.core.schedulers.base import Action, Broadcast, Inject, Scheduler

log = get_logger(__name__)
T = TypeVar("T")
MIN_BATCH_TIMEOUT_S = 30.0
BATCH_TIMEOUT_FACTOR = 10.0


class InFlight:
    """Owned by the engine's loop: `sent` by the executor, `back` by the results pump, `forget` when a
    pipeline is dropped, `watch` by the watchdog."""

    def __init__(self, timeout_s: float = 0.0) -> None:
        self.timeout_s = timeout_s            # 0: derived from the round trips
        self._owner: dict[int, tuple[Scheduler, int]] = {}     # wire id -> (scheduler, its batch id)
        self._sent_at: dict[int, float] = {}                   # wire id -> perf_counter() at inject
        self._ids = itertools.count(1)
        self._round_trips: collections.deque[float] = collections.deque(maxlen=256)   # seconds, recent

    def __len__(self) -> int:
        return len(self._sent_at)

    @property
    def bound(self) -> float:
        """Seconds a micro-batch may be in flight before it counts as lost."""
        if self.timeout_s > 0:
            return self.timeout_s
        trips = sorted(self._round_trips)
        typical = trips[int(0.9 * (len(trips) - 1))] if trips else 0.0
        return max(MIN_BATCH_TIMEOUT_S, BATCH_TIMEOUT_FACTOR * typical)

    def sent(self, sched: Scheduler, batch: MicroBatch) -> int:
        """`batch` of `sched` goes on the wire now: renumber it with a wire id (returned)."""
        wire_id = next(self._ids)
        self._owner[wire_id] = (sched, batch.batch_id)
        batch.batch_id = wire_id
        self._sent_at[wire_id] = time.perf_counter()
        return wire_id

    def back(self, batch: MicroBatch) -> tuple[Scheduler, float | None] | None:
        """A result arrived: its scheduler and when it was sent, its id the scheduler's again; None for a
        batch of a dropped pipeline."""
        owner = self._owner.pop(batch.batch_id, None)
        sent = self._sent_at.pop(batch.batch_id, None)
        if owner is None:
            return None
        if sent is not None:
            self._round_trips.append(time.perf_counter() - sent)
        sched, batch.batch_id = owner
        return sched, sent

    def oldest(self) -> tuple[int, float] | None:
        """(wire id, seconds in flight) of the batch out longest; None when none is."""
        if not self._sent_at:
            return None
        wire_id, sent = min(self._sent_at.items(), key=lambda kv: kv[1])
        return wire_id, time.perf_counter() - sent

    def forget(self) -> None:
        """The pipeline was dropped: no result of what is in flight will be handled."""
        self._owner.clear()
        self._sent_at.clear()

    async def watch(self, watched: Callable[[], T | None], lost: Callable[[BaseException, T], None]) -> None:
        """The watchdog, forever: a batch out longer than `bound` reports the transport `watched()` names
        (None: none is watched now) as `lost`, once per transport."""
        reported: T | None = None
        while True:
            bound = self.bound
            await asyncio.sleep(min(1.0, bound / 4))
            transport, oldest = watched(), self.oldest()
            if oldest is None or transport is None or transport is reported:
                continue
            wire_id, late = oldest
            if late > bound:
                reported = transport
                log.error("micro-batch lost: recovering", batch=wire_id, in_flight_s=round(late, 2),
                          bound_s=round(bound, 2))
                lost(TimeoutError(f"micro-batch {wire_id} not back after {late:.1f} s (bound {bound:.1f} s)"),
                     transport)


def attempt_ids(action: Action) -> list[str]:
    """The attempts whose state an action puts on the stages (an Inject's or a Broadcast's)."""
    if isinstance(action, Inject):
        return [s.request_id for s in action.batch.segments]
    if isinstance(action, Broadcast):
        return [action.control.request_id]
    return []
