"""The coordinator's engine: runs the schedulers over a pipeline transport for many concurrent requests.

One task executes actions in the order the schedulers produced them (so a node is always injected after
its parent and after its commit broadcast), one task feeds results back. Each request gets a queue of
events: ("tokens", [ids]) as tokens commit, then ("finish", Finished).

Stage failure (coordinator/engine/recovery.py drives it): `suspend` retires every scheduler — what they already
committed still reaches the clients, what they had in flight is dropped — and `restart` runs every request
again on a new pipeline from its prompt plus the tokens its client already has, under a new wire id
("<id>.r1", ...) so that stale rows of the old attempt can never mix with the new one. Example: a request
that streamed 7 of its 20 tokens when stage 2 died is re-prefilled with prompt + those 7 and asked for 13
more; its client sees a pause, then token 8.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from services.batch import Control, MicroBatch
from services.logs import get_logger
from services.sampling import GREEDY, Sampling

from coordinator.core.admission import Admission, kv_need
from coordinator.engine.live import Finished, LiveRequest
from coordinator.core.schedulers.base import Broadcast, Emit, Finish, Inject, Request, Scheduler
from coordinator.core.schedulers.registry import SpecOptions, make_scheduler

log = get_logger(__name__)
# a request that made no progress through this many stage failures in a row fails itself: it may be what
# makes a stage fail (say its prefill runs the stage out of memory)
MAX_FRUITLESS = 2
# a micro-batch not back within max(MIN_BATCH_TIMEOUT_S, BATCH_TIMEOUT_FACTOR x the slowest recent round trip)
# was lost (a stage dropped it, a stream reset after accepting it, a compute step hangs): a pipeline failure
MIN_BATCH_TIMEOUT_S = 30.0
BATCH_TIMEOUT_FACTOR = 10.0


class Transport(Protocol):
    num_stages: int

    async def inject(self, batch: MicroBatch) -> None: ...
    async def broadcast(self, control: Control) -> None: ...
    def results(self): ...


class Engine:
    """Ownership: the schedulers' state is touched only inside `_call` (under `_lock`, in a worker thread,
    since a scheduler may run the draft model); the event loop owns `_live`, `_waiting`, `_owner` and the
    admission state. A request is admitted (coordinator/core/admission.py) before its scheduler sees it; while
    it waits, only `_live` and `_waiting` know it."""

    def __init__(self, transport: Transport, default_method: str = "pp", spec: SpecOptions | None = None,
                 admission: Admission | None = None, batch_timeout_s: float = 0.0) -> None:
        self.transport = transport
        self.default_method = default_method
        self.spec = spec or SpecOptions()
        self.admission = admission or Admission(max_active=64, max_queue=256)
        self._waiting: dict[str, asyncio.Future] = {}          # queued request -> set when it may start
        self._schedulers: dict[tuple[str, SpecOptions], Scheduler] = {}
        self._live: dict[str, LiveRequest] = {}
        self._client_of: dict[str, str] = {}                    # wire id of a re-run -> client request id
        self._orphans: set[str] = set()                         # wire ids a failed pipeline may still hold
        self._owner: dict[int, tuple[Scheduler, int]] = {}     # wire batch id -> (scheduler, its batch id)
        self._sent_at: dict[int, float] = {}                    # wire batch id -> when it was injected
        self._batch_ids = itertools.count(1)
        self._work: asyncio.Queue = asyncio.Queue()
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self.failure: BaseException | None = None
        self.unavailable = ""          # set while the pipeline has no stages (scaled to zero): why
        # called (on the loop) with the error and the transport that failed; None: every request fails
        self.on_failure: Callable[[BaseException, Transport], None] | None = None
        self.suspended = False         # between `suspend` and `restart`: requests wait for a new pipeline
        self._transition = asyncio.Lock()      # a restart waits for a suspend still under way
        self.batch_timeout_s = batch_timeout_s  # 0: derived from the round trips (`batch_timeout`)
        self._round_trips: collections.deque[float] = collections.deque(maxlen=256)   # seconds, recent
        self._timed_out: Transport | None = None       # the transport the watchdog already reported
        self._watchdog: asyncio.Task | None = None

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._execute(), name="engine-execute"),
                       asyncio.create_task(self._pump(), name="engine-pump")]
        self._watchdog = asyncio.create_task(self._watch(), name="engine-watchdog")

    async def close(self) -> None:
        for rid in list(self._live):
            self.cancel(rid)
        await asyncio.gather(*self._background, return_exceptions=True)
        try:                                   # let the release broadcasts reach the stages
            await asyncio.wait_for(self._work.join(), timeout=5)
        except asyncio.TimeoutError:
            log.warning("closing with undelivered actions", left=self._work.qsize())
        tasks = [*self._tasks, *([self._watchdog] if self._watchdog is not None else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def batch_timeout(self) -> float:
        """Seconds a micro-batch may be in flight before it counts as lost."""
        if self.batch_timeout_s > 0:
            return self.batch_timeout_s
        return max(MIN_BATCH_TIMEOUT_S, BATCH_TIMEOUT_FACTOR * max(self._round_trips, default=0.0))

    async def _watch(self) -> None:
        """No silent hang: a micro-batch that does not come back within `batch_timeout` fails the pipeline
        (once per transport), and recovery runs the requests again — a stage that lost it or whose compute
        hangs is found even while its health checks answer."""
        while True:
            bound = self.batch_timeout
            await asyncio.sleep(min(1.0, bound / 4))
            transport = self.transport
            if not self._sent_at or transport is None or transport is self._timed_out or self.suspended:
                continue
            wire_id, sent = min(self._sent_at.items(), key=lambda kv: kv[1])
            late = time.perf_counter() - sent
            if late > bound:
                self._timed_out = transport
                log.error("micro-batch lost: recovering", batch=wire_id, in_flight_s=round(late, 2),
                          bound_s=round(bound, 2))
                self._transport_failed(TimeoutError(f"micro-batch {wire_id} not back after {late:.1f} s "
                                                    f"(bound {bound:.1f} s)"), transport)

    async def drained(self, poll_s: float = 0.05) -> None:
        """Wait until no admitted request runs (queued ones stay queued) and every action they produced
        (their release broadcasts) has gone out — or until the engine is suspended (a stage failed): then
        the running requests wait for `restart`."""
        while self.admission.active and not self.suspended:
            await asyncio.sleep(poll_s)
        await self._work.join()

    async def swap_transport(self, transport: Transport | None, kv_slots: int | None, why: str = "") -> None:
        """Re-partitioning: with nothing running, continue on another pipeline (None: no pipeline, every
        request fails with UNAVAILABLE and `why`). Schedulers are rebuilt for the new depth."""
        if self.admission.active:
            raise RuntimeError("swap_transport needs a drained engine")
        await self._stop_pump()
        self._schedulers.clear()
        self.failure, self.suspended = None, False
        self.transport = transport
        self.unavailable = "" if transport is not None else why
        if transport is not None:
            self._tasks[1:] = [asyncio.create_task(self._pump(), name="engine-pump")]
            self._release_started(self.admission.resume(kv_slots))
        else:
            self.admission.resume(kv_slots)
            for rid, fut in list(self._waiting.items()):      # held requests cannot run anywhere
                if not fut.done():
                    fut.set_exception(RuntimeError(why))

    async def _stop_pump(self) -> None:
        """Stop reading results; forget the micro-batches in flight."""
        for t in self._tasks[1:]:
            t.cancel()
        await asyncio.gather(*self._tasks[1:], return_exceptions=True)
        self._tasks[1:] = []
        self._owner.clear()
        self._sent_at.clear()

    def _release_started(self, started: list[str]) -> None:
        for rid in started:
            fut = self._waiting.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    @property
    def serving(self) -> bool:
        """Whether a request submitted now can run: the pipeline is up, not failed, recovering or held by a
        re-partition (what health checks report)."""
        return (self.transport is not None and self.failure is None and not self.unavailable
                and not self.suspended and not self.admission.held)

    @property
    def active(self) -> int:
        """Requests the engine knows: running and queued."""
        return len(self._live)

    def scheduler(self, method: str, spec: SpecOptions | None = None) -> Scheduler:
        """The scheduler for a method and speculation settings (one per distinct pair)."""
        key = (method, spec or self.spec)
        if key not in self._schedulers:
            self._schedulers[key] = make_scheduler(method, self.transport.num_stages, key[1])
        return self._schedulers[key]

    async def submit(self, prompt_ids: list[int], max_new_tokens: int, method: str = "",
                     eos_ids: frozenset[int] = frozenset(), request_id: str = "",
                     spec: SpecOptions | None = None, sampling: Sampling = GREEDY,
                     client: str = "") -> tuple[str, asyncio.Queue]:
        """Start a request, waiting in the admission queue if the server is full; returns its id and its
        event queue. Raises ValueError for bad input, Overloaded when the queue is full or the request can
        never fit, RuntimeError when the pipeline has failed or the engine closes while it waits."""
        if self.failure is not None:
            raise RuntimeError(f"the pipeline failed: {self.failure}")
        if self.unavailable:
            raise RuntimeError(self.unavailable)
        method = method or self.default_method
        sched = self.scheduler(method, spec)
        rid = request_id or uuid.uuid4().hex[:16]
        if rid in self._live:
            raise ValueError(f"request id {rid} is already running")
        request = Request(rid, list(prompt_ids), max_new_tokens, eos_ids, sampling)
        need = kv_need(len(prompt_ids), max_new_tokens, self.transport.num_stages, sched.kv_rows_per_batch)
        runs_now = self.admission.offer(rid, need, client)
        live = self._live[rid] = LiveRequest(sched, asyncio.Queue(), time.perf_counter(), request, method, spec, rid)
        added = False
        try:
            if not runs_now:
                self._waiting[rid] = asyncio.get_running_loop().create_future()
                await self._waiting[rid]
                # a re-partition may have happened meanwhile: take the scheduler of the current pipeline
                sched = live.scheduler = self.scheduler(method, spec)
            added = live.started = True
            await self._call(sched, sched.add, request)
        except BaseException as e:
            self._waiting.pop(rid, None)
            if added and isinstance(e, asyncio.CancelledError):
                self._spawn(self._abandon(rid))     # the client left while it was being added
            else:
                self._live.pop(rid, None)
                self._release(rid)
            raise
        return rid, live.events

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Stop a request (safe to call from anywhere on the loop, any number of times)."""
        live = self._live.get(request_id)
        if live is None:
            return
        live.cancel_reason = live.cancel_reason or reason       # honoured by `restart` if one is under way
        waiting = self._waiting.get(request_id)
        if waiting is not None:
            if not waiting.done():
                why = f"the pipeline failed: {self.failure}" if self.failure else f"request {reason} while queued"
                waiting.set_exception(RuntimeError(why))
            return
        self._spawn(self._call(live.scheduler, live.scheduler.cancel, live.wire_id, reason))

    async def _abandon(self, rid: str) -> None:
        """A submit cancelled around `add`: cancel the request if the scheduler took it, else (the add
        never ran, or failed) drop what the engine holds for it."""
        live = self._live.get(rid)
        if live is None:
            return
        sched, wire_id = live.scheduler, live.wire_id
        if await self._call(sched, lambda: wire_id in sched.requests):
            await self._call(sched, sched.cancel, wire_id, "cancelled")
        else:
            self._live.pop(rid, None)
            self._release(rid)

    def _release(self, request_id: str) -> None:
        """The request no longer holds its admission; start the queued requests that fit now."""
        self._release_started(self.admission.release(request_id))

    async def _call(self, sched: Scheduler, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` on `sched` in a worker thread and queue the actions it produced. A retired scheduler
        (see `suspend`) is not called any more: the result is None."""
        async with self._lock:
            if not self._current(sched):
                return None
            job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            try:
                return await asyncio.shield(job)
            except asyncio.CancelledError:
                await asyncio.wait([job])   # the thread still owns the scheduler: keep the lock until it ends
                raise
            finally:
                for action in sched.poll():
                    self._work.put_nowait((sched, action))
                if sched.has_work:       # deferred draft compute runs after the actions above are queued
                    self._spawn(self._call(sched, sched.work))

    def _current(self, sched: Scheduler) -> bool:
        return any(s is sched for s in self._schedulers.values())

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    async def _execute(self) -> None:
        while True:
            sched, action = await self._work.get()
            transport = self.transport
            try:
                if isinstance(action, (Inject, Broadcast)) and not self._current(sched):
                    self._orphans.update(_request_ids(action))  # for a failed pipeline: released on the next
                elif isinstance(action, Inject):
                    wire_id = next(self._batch_ids)
                    self._owner[wire_id] = (sched, action.batch.batch_id)
                    action.batch.batch_id = wire_id
                    self._sent_at[wire_id] = time.perf_counter()
                    await transport.inject(action.batch)
                elif isinstance(action, Broadcast):
                    await transport.broadcast(action.control)
                elif isinstance(action, Emit):
                    self._emit(action)
                elif isinstance(action, Finish):
                    self._finish(action)
            except (Exception, asyncio.CancelledError) as e:   # a broken transport: recovery, or fail all
                task = asyncio.current_task()
                if isinstance(e, asyncio.CancelledError) and task is not None and task.cancelling():
                    raise           # the engine closes (a write cut off by an aborted channel is a failure)
                self._orphans.update(_request_ids(action))
                self._transport_failed(e, transport)
            finally:
                self._work.task_done()

    async def _pump(self) -> None:
        transport = self.transport
        try:
            async for batch in transport.results():
                owner = self._owner.pop(batch.batch_id, None)
                sent = self._sent_at.pop(batch.batch_id, None)
                if owner is None:
                    continue
                if sent is not None:
                    self._round_trips.append(time.perf_counter() - sent)
                self._account(batch, sent)
                sched, local_id = owner
                batch.batch_id = local_id
                try:
                    await self._call(sched, sched.on_result, batch)
                except Exception as e:     # the scheduler failed on this result: its requests' fault
                    self._fail_requests(sched, [s.request_id for s in batch.segments], e)
        except Exception as e:
            self._transport_failed(e, transport)

    def _fail_requests(self, sched: Scheduler, wire_ids: list[str], error: BaseException) -> None:
        """End these requests with INTERNAL (the pipeline and every other request go on)."""
        log.error("request failed while its result was handled", requests=sorted(set(wire_ids)),
                  error=repr(error))
        for wire_id in dict.fromkeys(wire_ids):
            self._spawn(self._call(sched, sched.cancel, wire_id, "failed"))
            self._finish(Finish(wire_id, "error", {}, f"internal error while handling its result: {error!r}", 13))

    def _transport_failed(self, error: BaseException, transport: Transport) -> None:
        if self.on_failure is not None:
            self.on_failure(error, transport)
        else:
            log.error("pipeline transport failed", error=str(error))
            self._fail_all(error)

    def _client(self, wire_id: str) -> LiveRequest | None:
        return self._live.get(self._client_of.get(wire_id, wire_id))

    def _account(self, batch: MicroBatch, sent: float | None) -> None:
        """Round trip of a one-request micro-batch against the time stages spent on it: the rest is the
        coordinator, the transport and queueing."""
        rids = {s.request_id for s in batch.segments}
        live = self._client(next(iter(rids))) if len(rids) == 1 else None
        if live is not None and sent is not None:
            live.account((time.perf_counter() - sent) * 1e3, sum(t.compute_ms + t.wait_ms for t in batch.trace))

    def _emit(self, action: Emit) -> None:
        live = self._client(action.request_id)
        if live is None or live.wire_id != action.request_id:
            return
        live.token_times.append(time.perf_counter())
        live.emitted += action.token_ids
        live.events.put_nowait(("tokens", action.token_ids))

    def _finish(self, action: Finish) -> None:
        rid = self._client_of.pop(action.request_id, action.request_id)
        live = self._live.get(rid)
        if live is None or live.wire_id != action.request_id:
            return
        del self._live[rid]
        self._release(rid)
        stats = live.final_stats(action.stats, time.perf_counter())
        log.debug("request finished", request_id=rid, reason=action.reason, **stats)
        live.events.put_nowait(("finish", Finished(action.reason, stats, action.error, action.error_code)))

    def _fail_all(self, error: BaseException) -> None:
        """End every client stream with UNAVAILABLE; scheduler state is dropped through cancel."""
        first = self.failure is None
        self.failure = self.failure or error
        if first:
            for rid, live in list(self._live.items()):
                live.events.put_nowait(("finish", Finished("error", {}, f"pipeline failure: {error}", 14)))
            for rid in list(self._live):
                self.cancel(rid)

    # -- stage failure (driven by coordinator/engine/recovery.py) -------------------------------------------
    async def suspend(self) -> set[str]:
        """Stop using a failed pipeline: hold admission, retire every scheduler (their requests stay with
        the engine; their micro-batches in flight are forgotten), deliver the tokens they had committed and
        drop the rest of their actions. Returns the wire ids the stages may still hold state for. The
        failed transport must be aborted first, so that nothing waits on it."""
        async with self._transition:
            self.admission.hold()
            self.suspended = True
            async with self._lock:
                retired = list(self._schedulers.values())
                self._schedulers.clear()
            await self._stop_pump()

            def forget() -> list[Finish]:   # scheduler and draft state of every request they still ran
                ended = []
                for sched in retired:
                    for wire_id in list(sched.requests):
                        sched.cancel(wire_id, "stage failure")
                    for action in sched.poll():
                        self._orphans.update(_request_ids(action))
                        if isinstance(action, Finish):
                            ended.append(action)
                return ended

            async with self._lock:
                for ended in await asyncio.to_thread(forget):
                    live = self._client(ended.request_id)
                    if live is not None and live.wire_id == ended.request_id:
                        live.carry(ended.stats)
            await self._work.join()          # Emit/Finish go to the clients; Inject/Broadcast become orphans
            orphans, self._orphans = self._orphans, set()
            return orphans | {live.wire_id for live in self._live.values() if live.started}

    async def restart(self, transport: Transport, kv_slots: int | None) -> int:
        """Go on over a new pipeline: every running request runs again from its prompt plus the tokens its
        client already has (a request cancelled meanwhile just finishes). Returns how many were re-run."""
        async with self._transition:
            self.transport, self.failure, self.unavailable = transport, None, ""
            self.suspended = False
            self._schedulers.clear()        # built for the old depth while suspended (none holds a request)
            self._tasks[1:] = [asyncio.create_task(self._pump(), name="engine-pump")]
            rerun = 0
            for rid, live in list(self._live.items()):
                if live.started and await self._rerun(rid, live):
                    rerun += 1
            self._release_started(self.admission.resume(kv_slots))
            return rerun

    async def _rerun(self, rid: str, live: LiveRequest) -> bool:
        """Run a request again after a failure (True), or end it: cancelled meanwhile, already complete, or
        without progress through MAX_FRUITLESS failures in a row."""
        req, done = live.request, live.emitted
        left = req.max_new_tokens - len(done)
        reason = live.cancel_reason or ("eos" if done and done[-1] in req.eos_ids else "length" if left < 1 else "")
        if reason:
            self._finish(Finish(live.wire_id, reason, {"steps": 0.0}))
            return False
        live.fruitless = live.fruitless + 1 if len(done) == live.emitted_at_start else 0
        if live.fruitless >= MAX_FRUITLESS:
            self._finish(Finish(live.wire_id, "error", {}, f"the pipeline failed {live.fruitless} times in a "
                                "row while this request made no progress; it is not run again (it may be what "
                                "makes a stage fail)", 13))
            return False
        live.attempts += 1
        live.emitted_at_start = len(done)
        self._client_of.pop(live.wire_id, None)
        live.wire_id = f"{rid}.r{live.attempts}"
        self._client_of[live.wire_id] = rid
        live.scheduler = sched = self.scheduler(live.method, live.spec)
        try:
            await self._call(sched, sched.add, Request(live.wire_id, req.prompt_ids + done, left, req.eos_ids,
                                                       req.sampling))
        except ValueError as e:         # cannot happen for a request that ran; end it rather than hang
            self._finish(Finish(live.wire_id, "error", {}, f"cannot resume after a stage failure: {e}", 13))
            return False
        return True

    def fail_running(self, why: str) -> None:
        """The pipeline is not coming back (soon): end every request with UNAVAILABLE — the tokens already
        streamed stay committed — and refuse new ones with `why` until `restart`."""
        self.unavailable = why
        for rid, live in list(self._live.items()):
            waiting = self._waiting.pop(rid, None)
            if waiting is not None and not waiting.done():
                waiting.set_exception(RuntimeError(why))
                continue
            if live.started:
                sched = live.scheduler       # still current when a re-partition owns the pipeline
                self._spawn(self._call(sched, sched.cancel, live.wire_id, "failed"))
                self._finish(Finish(live.wire_id, "error", {}, why, 14))


def _request_ids(action: Inject | Broadcast | Emit | Finish) -> list[str]:
    if isinstance(action, Inject):
        return [s.request_id for s in action.batch.segments]
    if isinstance(action, Broadcast):
        return [action.control.request_id]
    return []


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background scheduler call failed", error=repr(task.exception()))
