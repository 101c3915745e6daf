"""The engine's lifecycle methods: how it moves between the states of coordinator/engine/state.py.

`EngineLifecycle` is mixed into `Engine` (coordinator/engine/engine.py), whose state it works on: a failure that
ends every request (`fail_all`, `fail_running`), a re-partition's drain (`hold`, then `swap_transport`), a
stage failure's recovery (`suspend`, then `restart`). Only the pipeline owner (coordinator/engine/pipeline.py)
calls hold, suspend, restart and swap_transport. `state` and `transport` change only here.
"""
from __future__ import annotations

import asyncio

from coordinator.core.schedulers.base import Finish, Scheduler
from coordinator.core.stats import RequestStats
from coordinator.core.status import FinishReason, Status
from coordinator.engine.inflight import attempt_ids
from coordinator.engine.live import LiveRequest
from coordinator.engine.state import RESTARTABLE, EngineState, EngineStateError, Unavailable
from coordinator.engine.transports.base import Transport


class EngineLifecycle:
    """The lifecycle half of `Engine`, on the engine's own state (request table, schedulers, admission, work
    queue, draft thread) and methods (`scheduler`, `cancel`, `_call`, `_lock`, `_spawn`, `_finish`, and the
    result pump's `_start_pump` / `_stop_pump`): all of them defined by `Engine`."""

    def fail_all(self, error: BaseException) -> None:
        """A pipeline failure that nothing recovers (-> FAILED): every client stream ends with UNAVAILABLE
        (scheduler state is dropped through cancel); new requests are refused until a restart or swap."""
        if self._state is EngineState.FAILED:
            return
        self._state, self._why = EngineState.FAILED, f"the pipeline failed: {error}"
        for request_id, live in self._requests.items():
            live.events.put_nowait(Finish(request_id, FinishReason.ERROR, RequestStats(), f"pipeline failure: {error}",
                                          Status.UNAVAILABLE))
            self.cancel(request_id)

    def fail_running(self, why: str) -> None:
        """The pipeline is not coming back soon (-> UNAVAILABLE): every request ends with UNAVAILABLE (what it
        streamed stays committed) and new ones are refused with `why`."""
        self._state, self._why = EngineState.UNAVAILABLE, why
        for request_id, live in self._requests.items():
            if self._requests.refuse(request_id, Unavailable(why), forget=True):
                continue
            if live.started:
                sched = live.scheduler       # still current when a re-partition owns the pipeline
                self._spawn(self._call(sched, sched.cancel, live.attempt_id, FinishReason.FAILED))
                self._finish(Finish(live.attempt_id, FinishReason.ERROR, RequestStats(), why, Status.UNAVAILABLE))

    def hold(self) -> None:
        """A re-partition drains (RUNNING -> HELD; other states stay): running requests go on, new ones queue."""
        self.admission.hold()
        if self._state is EngineState.RUNNING:
            self._state = EngineState.HELD

    async def suspend(self) -> set[str]:
        """Stop using a failed pipeline, aborted first (-> SUSPENDED): hold admission, retire every scheduler
        (their requests stay, their batches in flight are forgotten), deliver the tokens they committed, drop
        their other actions. Returns the attempt ids the stages may still hold state for."""
        async with self._transition:
            self.admission.hold()
            self._state, self._why = EngineState.SUSPENDED, ""
            retired = list(self._schedulers.values())     # (no call of theirs starts from here on)
            self._schedulers.clear()
            await self._stop_pump()

            def forget(sched: Scheduler) -> list[Finish]:   # scheduler and draft state of its requests
                ended = []
                for attempt_id in list(sched.requests):
                    sched.cancel(attempt_id, FinishReason.STAGE_FAILURE)
                for action in sched.poll():
                    self._orphans.update(attempt_ids(action))
                    if isinstance(action, Finish):
                        ended.append(action)
                return ended

            for sched in retired:           # each once the call it may be in has ended
                async with self._lock(sched):
                    for ended in await asyncio.to_thread(forget, sched):
                        live = self._requests.current(ended.request_id)
                        if live is not None:
                            live.carry(ended.stats)
            loop = asyncio.get_running_loop()
            for sched in retired:           # the draft lets go of their requests (the releases queued)
                if sched.has_work:
                    await loop.run_in_executor(self._draft_pool, sched.work)
            await self._work.join()          # Emit/Finish go to the clients; Inject/Broadcast become orphans
            orphans, self._orphans = self._orphans, set()
            return orphans | {live.attempt_id for _, live in self._requests.items() if live.started}

    async def restart(self, transport: Transport, kv_slots: int | None) -> int:
        """After a failure (else EngineStateError), go on over a new pipeline (-> RUNNING): each running request
        runs again (Requests.next_attempt; one cancelled meanwhile just finishes). Returns how many were."""
        async with self._transition:
            if self._state not in RESTARTABLE:
                raise EngineStateError(f"restart needs a suspended engine, not a {self._state.value} one")
            self._transport, self._state, self._why = transport, EngineState.RUNNING, ""
            self._schedulers.clear()        # built for the old depth while suspended (none holds a request)
            self._start_pump()
            rerun = 0
            for _, live in self._requests.items():
                if live.started and await self._rerun(live):
                    rerun += 1
            self._requests.start(self.admission.resume(kv_slots))
            return rerun

    async def _rerun(self, live: LiveRequest) -> bool:
        """Run a request again after a failure (True), or end it (see Requests.next_attempt)."""
        nxt = self._requests.next_attempt(live)
        if isinstance(nxt, Finish):
            self._finish(nxt)
            return False
        live.scheduler = sched = self.scheduler(live.method, live.spec)
        try:
            await self._call(sched, sched.add, nxt)
        except ValueError as e:         # cannot happen for a request that ran; end it rather than hang
            self._finish(Finish(live.attempt_id, FinishReason.ERROR, RequestStats(),
                                f"cannot resume after a stage failure: {e}",
                                Status.INTERNAL))
            return False
        return True

    async def swap_transport(self, transport: Transport | None, kv_slots: int | None, why: str = "") -> None:
        """With nothing running (else EngineStateError), go on over another pipeline (-> RUNNING; schedulers
        rebuilt for its depth) or over none (-> UNAVAILABLE: every request fails with `why`)."""
        if self.admission.active:
            raise EngineStateError("swap_transport needs a drained engine")
        await self._stop_pump()
        self._schedulers.clear()
        self._transport = transport
        if transport is not None:
            self._state, self._why = EngineState.RUNNING, ""
            self._start_pump()
            self._requests.start(self.admission.resume(kv_slots))
        else:
            self._state, self._why = EngineState.UNAVAILABLE, why
            self.admission.resume(kv_slots)
            self._requests.refuse_all(Unavailable(why))      # held requests cannot run anywhere
