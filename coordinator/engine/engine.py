"""The coordinator's engine: runs the schedulers over a pipeline transport for many concurrent requests.

One task executes actions in the order the schedulers produced them (so a node is always injected after
its parent and after its commit broadcast), one feeds results back, one watches for lost micro-batches
(inflight.py). A request's queue gets Tokens as they commit, then a Finish (live.py). After a stage failure
`suspend` retires every scheduler and `restart` runs each request again on a new pipeline (state.py; those
lifecycle methods are in lifecycle.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import Counter

from common.batch import MicroBatch
from common.logs import get_logger
from common.sampling import GREEDY, Sampling

from coordinator.core.admission import Admission, kv_need
from coordinator.core.schedulers.base import Action, Broadcast, Emit, Finish, Inject, Request, Scheduler
from coordinator.core.stats import RequestStats
from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
from coordinator.core.status import FinishReason, Status
from coordinator.engine.inflight import InFlight, attempt_ids
from coordinator.engine.lifecycle import EngineLifecycle
from coordinator.engine.live import Event, LiveRequest, Requests
from coordinator.engine.meter import timed
from coordinator.engine.rule_log import log_switches, on_result_switches
from coordinator.engine.state import REFUSING, EngineState, Unavailable
from coordinator.engine.transports.base import Transport

log = get_logger(__name__)
INVALID_RESULTS = Counter("specpipe_invalid_results_total", "Results of the last stage that could not answer the "
                          "micro-batch they came back for (another request's segment, rows not sent, too few tokens, "
                          "NaN): the batch's requests failed, nothing was applied")


class Engine(EngineLifecycle):
    """Ownership: a scheduler's state is touched only inside `_call` (under that scheduler's own lock, in a
    worker thread: one method's in-line draft work, a trip baseline's prefill say, never holds another's
    results back);
    the draft model only on the draft thread (`_draft_pool`, one thread for every scheduler: they share the
    draft), where `specpipe`'s draft jobs run beside the scheduler calls (`_draft_rounds`) and the trip
    baselines' `work` runs in line; the loop owns the request table, the batches in flight and the
    admission state (a queued request is known to the table only). `state` and `transport` change only in
    the lifecycle methods (`EngineLifecycle`, coordinator/engine/lifecycle.py)."""

    def __init__(self, transport: Transport | None, default_method: str = "pp", spec: SpecOptions | None = None,
                 admission: Admission | None = None, batch_timeout_s: float = 0.0) -> None:
        self._transport = transport
        self._state = EngineState.RUNNING if transport is not None else EngineState.UNAVAILABLE
        self._why = ""                 # FAILED, UNAVAILABLE: what submit answers
        self.default_method = default_method
        self.spec = spec or SpecOptions()
        self.admission = admission or Admission(max_active=64, max_queue=256)
        self._requests = Requests()
        self._schedulers: dict[tuple[str, SpecOptions], Scheduler] = {}
        self._orphans: set[str] = set()                         # attempt ids a failed pipeline may still hold
        self._in_flight = InFlight(batch_timeout_s)
        self._work: asyncio.Queue[tuple[Scheduler, Action]] = asyncio.Queue()
        self._locks: weakref.WeakKeyDictionary[Scheduler, asyncio.Lock] = weakref.WeakKeyDictionary()
        # results, per scheduler in arrival order, each scheduler's handled by a task of its own: one whose lock
        # is held (its in-line draft) holds back its own results only
        self._inboxes: dict[Scheduler, tuple[asyncio.Queue[MicroBatch], asyncio.Task[None]]] = {}
        self._transition = asyncio.Lock()      # a restart waits for a suspend still under way
        self._executor: asyncio.Task[None] | None = None
        self._pump_task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._draft_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specpipe-draft")
        self._drafting: set[Scheduler] = set()       # schedulers whose draft rounds are running
        # called (on the loop) with the error and the transport that failed; None: fail_all
        self.on_failure: Callable[[BaseException, Transport], None] | None = None

    @property
    def transport(self) -> Transport | None:
        """What the engine sends on (while SUSPENDED the failed one, whose depth new schedulers take)."""
        return self._transport

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def why(self) -> str:
        """FAILED, UNAVAILABLE: why requests are refused ("" otherwise)."""
        return self._why

    @property
    def serving(self) -> bool:
        """Whether a request submitted now can run (what health checks report)."""
        return self._state is EngineState.RUNNING

    @property
    def active(self) -> int:
        """Requests the engine knows: running and queued."""
        return len(self._requests)

    async def start(self) -> None:
        self._executor = asyncio.create_task(self._execute(), name="engine-execute")
        self._start_pump()
        watched = lambda: None if self._state is EngineState.SUSPENDED else self._transport   # noqa: E731
        self._watchdog = asyncio.create_task(self._in_flight.watch(watched, self._transport_failed),
                                             name="engine-watchdog")

    async def close(self) -> None:
        for request_id, _ in self._requests.items():
            self.cancel(request_id)
        await asyncio.gather(*self._background, return_exceptions=True)
        try:                                   # let the release broadcasts reach the stages
            await asyncio.wait_for(self._work.join(), timeout=5)
        except asyncio.TimeoutError:
            log.warning("closing with undelivered actions", left=self._work.qsize())
        tasks = [t for t in (self._executor, self._watchdog) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(self._stop_pump(), *tasks, return_exceptions=True)
        self._draft_pool.shutdown(wait=True)

    async def drained(self, poll_s: float = 0.05) -> None:
        """Wait until no admitted request runs (queued ones stay queued) and their actions (releases) went
        out — or until the engine is suspended (a stage failed): they then wait for `restart`."""
        while self.admission.active and self._state is not EngineState.SUSPENDED:
            await asyncio.sleep(poll_s)
        await self._work.join()

    def scheduler(self, method: str, spec: SpecOptions | None = None) -> Scheduler:
        """The scheduler for a method and speculation settings (one per distinct pair)."""
        key = (method, spec or self.spec)
        if key not in self._schedulers:
            assert self._transport is not None, "no pipeline"
            self._schedulers[key] = make_scheduler(method, self._transport.num_stages, key[1])
        return self._schedulers[key]

    async def submit(self, prompt_ids: list[int], max_new_tokens: int, method: str = "",
                     eos_ids: frozenset[int] = frozenset(), request_id: str = "",
                     spec: SpecOptions | None = None, sampling: Sampling = GREEDY,
                     client: str = "") -> tuple[str, asyncio.Queue[Event]]:
        """Start a request, waiting in the admission queue if the server is full; returns its id and its
        event queue. Raises ValueError for bad input, Overloaded when the queue is full or the request can
        never fit, Unavailable when the engine refuses requests or refuses this one while it waits."""
        if self._state in REFUSING:
            raise Unavailable(self._why)
        method = method or self.default_method
        sched = self.scheduler(method, spec)
        request_id = request_id or uuid.uuid4().hex[:16]
        if request_id in self._requests:
            raise ValueError(f"request id {request_id} is already running")
        request = Request(request_id, list(prompt_ids), max_new_tokens, eos_ids, sampling)
        need = kv_need(len(prompt_ids), max_new_tokens, sched.num_stages, sched.kv_rows_per_batch)
        runs_now = self.admission.offer(request_id, need, client)
        live = LiveRequest(sched, asyncio.Queue(), time.perf_counter(), request, method, spec, request_id)
        self._requests.add(live)
        added = False
        try:
            if not runs_now:
                await self._requests.queue(request_id)
                # a re-partition may have happened meanwhile: take the scheduler of the current pipeline
                sched = live.scheduler = self.scheduler(method, spec)
            added = live.started = True
            live.admitted = time.perf_counter()
            await self._call(sched, sched.add, request)
        except BaseException as e:
            if added and isinstance(e, asyncio.CancelledError):
                self._spawn(self._abandon(request_id))     # the client left while it was being added
            else:
                self._requests.drop(request_id)
                self._release(request_id)
            raise
        return request_id, live.events

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Stop a request (safe to call from anywhere on the loop, any number of times)."""
        live = self._requests.get(request_id)
        if live is None:
            return
        live.cancel_reason = live.cancel_reason or FinishReason(reason)   # honoured by a `restart` under way
        failed = self._state is EngineState.FAILED
        if self._requests.refuse(request_id, Unavailable(self._why if failed else f"request {reason} while queued")):
            return
        self._spawn(self._call(live.scheduler, live.scheduler.cancel, live.attempt_id, reason))

    async def _abandon(self, request_id: str) -> None:
        """A submit cancelled around `add`: cancel the request if the scheduler took it, else drop it."""
        live = self._requests.get(request_id)
        if live is None:
            return
        sched, attempt_id = live.scheduler, live.attempt_id
        if await self._call(sched, lambda: attempt_id in sched.requests):
            await self._call(sched, sched.cancel, attempt_id, FinishReason.CANCELLED)
        else:
            self._requests.drop(request_id)
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        """The request no longer holds its admission; start the queued requests that fit now."""
        self._requests.start(self.admission.release(request_id))

    async def _call(self, sched: Scheduler, fn: Callable[..., Any], *args: Any, on_draft: bool = False) -> Any:
        """Run `fn` on `sched` in a worker thread (`on_draft`: on the draft thread, for calls that run the
        draft in line) and queue the actions it produced. A retired scheduler (see `suspend`) is not called
        any more: the result is None."""
        async with self._lock(sched):
            if not self._current(sched):
                return None
            draft = getattr(sched, "draft", None) if on_draft else None     # its compute is not control time
            job = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                self._draft_pool if on_draft else None, functools.partial(timed, fn, *args, draft=draft)))
            try:
                out, control_ms, _ = await asyncio.shield(job)
                sched.charge_control(control_ms)     # the coordinator's own time, shared by the requests running
                return out
            except asyncio.CancelledError:
                await asyncio.wait([job])   # the thread still owns the scheduler: keep the lock until it ends
                raise
            finally:
                for action in sched.poll():
                    self._work.put_nowait((sched, action))
                if sched.has_work:       # deferred draft work runs after the actions above are queued
                    self._spawn(self._draft_rounds(sched) if sched.drafts_beside else
                                self._call(sched, sched.work, on_draft=True))

    async def _draft_rounds(self, sched: Scheduler) -> None:
        """`sched`'s draft jobs, one after another on the draft thread, while it has rounds due (one such loop
        per scheduler). Only making a job and applying its results take the lock: results, commits and
        injections go on while the draft computes (coordinator/core/drafts/job.py)."""
        if sched in self._drafting:
            return                      # the running loop asks for the next job itself
        self._drafting.add(sched)
        loop = asyncio.get_running_loop()
        try:
            job = None
            while True:
                if job is None:
                    job = await self._call(sched, sched.draft_job)
                if job is None:
                    self._drafting.discard(sched)
                    if not (sched.has_work and self._current(sched)):
                        return          # (a call that queued work before the discard above saw us running)
                    self._drafting.add(sched)
                    continue
                results = await loop.run_in_executor(self._draft_pool, job.run, sched.draft)
                job = await self._call(sched, sched.draft_next, job, results)   # applied, and the next job
        finally:
            self._drafting.discard(sched)

    def _lock(self, sched: Scheduler) -> asyncio.Lock:
        """The lock of one scheduler's state (made on first use; gone with the scheduler)."""
        lock = self._locks.get(sched)
        if lock is None:
            lock = self._locks[sched] = asyncio.Lock()
        return lock

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
            transport = self._transport
            try:
                if isinstance(action, (Inject, Broadcast)) and not self._current(sched):
                    self._orphans.update(attempt_ids(action))  # for a failed pipeline: released on the next
                elif isinstance(action, Inject):
                    self._in_flight.sent(sched, action.batch)
                    self._requests.sent(action.batch, time.perf_counter())
                    await transport.inject(action.batch)
                elif isinstance(action, Broadcast):
                    await transport.broadcast(action.control)
                elif isinstance(action, Emit):
                    self._requests.emit(action, time.perf_counter())
                elif isinstance(action, Finish):
                    self._finish(action)
            except (Exception, asyncio.CancelledError) as e:   # a broken transport: recovery, or fail all
                task = asyncio.current_task()
                if isinstance(e, asyncio.CancelledError) and task is not None and task.cancelling():
                    raise           # the engine closes (a write cut off by an aborted channel is a failure)
                self._orphans.update(attempt_ids(action))
                self._transport_failed(e, transport)
            finally:
                self._work.task_done()

    def _start_pump(self) -> None:
        if self._transport is not None:
            self._pump_task = asyncio.create_task(self._pump(self._transport), name="engine-pump")

    async def _stop_pump(self) -> None:
        """Stop reading results (and handling those read); forget the micro-batches in flight."""
        tasks = [self._pump_task] if self._pump_task is not None else []
        tasks += [task for _, task in self._inboxes.values()]
        self._pump_task, self._inboxes = None, {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._in_flight.forget()

    async def _pump(self, transport: Transport) -> None:
        try:
            async for batch in transport.results():
                back = self._in_flight.back(batch)
                if back is None:
                    continue
                sched, sent = back
                now = time.perf_counter()
                batch.trip_ms = (now - sent) * 1e3 if sent is not None else 0.0
                batch.arrived_ms = now * 1e3
                self._requests.account(batch, sent, now)
                self._requests.returned(batch, now)
                inbox = self._inboxes.get(sched)
                if inbox is None:
                    queue: asyncio.Queue[MicroBatch] = asyncio.Queue()
                    inbox = self._inboxes[sched] = (queue, asyncio.create_task(self._results_of(sched, queue)))
                inbox[0].put_nowait(batch)
        except Exception as e:
            self._transport_failed(e, transport)

    async def _results_of(self, sched: Scheduler, queue: asyncio.Queue[MicroBatch]) -> None:
        """One scheduler's results, in the order they came back."""
        while True:
            batch = await queue.get()
            invalid, switches = sched.invalid_results, None
            try:
                switches = await self._call(sched, on_result_switches, sched, batch)
                if sched.invalid_results != invalid:
                    INVALID_RESULTS.inc()
                    log.warning("the last stage answered a micro-batch wrongly: its requests failed",
                                batch_id=batch.batch_id, fault=sched.last_fault)
            except Exception as e:     # the scheduler failed on this result: its requests' fault
                self._fail_requests(sched, [s.request_id for s in batch.segments], e)
            if switches:
                try:                   # a log line must not stop this scheduler's results
                    log_switches(sched.name, switches)
                except Exception as e:
                    with contextlib.suppress(Exception):
                        log.warning("cost rule switches not logged", method=sched.name, error=repr(e))

    def _finish(self, action: Finish) -> None:
        done = self._requests.finish(action, time.perf_counter())
        if done is not None:
            self._release(done.request_id)
            log.debug("request finished", request_id=done.request_id, reason=done.reason, **done.stats.as_dict())

    def _fail_requests(self, sched: Scheduler, attempt_ids: list[str], error: BaseException) -> None:
        """End these requests with INTERNAL (the pipeline and every other request go on)."""
        log.error("request failed while its result was handled", requests=sorted(set(attempt_ids)),
                  error=repr(error))
        for attempt_id in dict.fromkeys(attempt_ids):
            self._spawn(self._call(sched, sched.cancel, attempt_id, FinishReason.FAILED))
            self._finish(Finish(attempt_id, FinishReason.ERROR, RequestStats(),
                                f"internal error while handling its result: {error!r}", Status.INTERNAL))

    def _transport_failed(self, error: BaseException, transport: Transport) -> None:
        if self.on_failure is not None:
            self.on_failure(error, transport)
        else:
            log.error("pipeline transport failed", error=str(error))
            self.fail_all(error)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background scheduler call failed", error=repr(task.exception()))
