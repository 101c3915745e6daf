"""Stage failure recovery: the client's stream pauses, then goes on, every token exactly once.

When the pipeline breaks (coordinator/engine/transports/grpc.py: a stream of a stage ends or fails, or a stage stops
answering health checks), `Recovery` runs:
1. the failed pipeline is dropped and the engine suspended (Engine.suspend): new requests wait in the
   admission queue, the tokens already committed reach their clients, the speculation in flight is lost;
2. wait until every stage answers again — the same process, a restarted one (`specpipe local` restarts
   dead stage processes) or a replacement pod with the same index and DNS name — for at most
   `--recovery-timeout-s`;
3. release everything the stages hold (nothing of it is valid any more); a stage that came back with
   other layers than the partition needs (a pod restarted from its start-up arguments after a re-partition)
   is re-configured with the even split (coordinator/engine/scaling.py);
4. open a new pipeline and re-run every request from its prompt plus the tokens already streamed
   (Engine.restart) — greedy and seeded sampling give the same continuation a run without the failure gives.
If that has not happened within the timeout (whatever step hangs), every running request ends with
UNAVAILABLE (what it streamed stays valid) and new ones are refused with UNAVAILABLE, while recovery keeps
trying; once the stages are back the coordinator serves again. A failure of the pipeline a re-partition is
draining (`kubectl scale` removed a pod that still served) is handed to the re-partition, which runs the
requests again on its new pipeline.

    failure at t=0 (stage 2 killed) -> suspended -> t=3.1 s all stages answer -> releases -> re-run 5 requests
"""
from __future__ import annotations

import asyncio
import time
import weakref
from typing import TYPE_CHECKING

import grpc
from prometheus_client import Counter

from protos import stage_pb2
from services.logs import get_logger

from coordinator.engine.transports.grpc import GrpcPipeline, PipelineError
from coordinator.engine.scaling import configure, plan, release_held

if TYPE_CHECKING:
    from coordinator.frontends.service import Coordinator

log = get_logger(__name__)
FAILURES = Counter("specpipe_stage_failures_total", "Pipeline failures by outcome of the recovery",
                   ["outcome"])
RECOVERED = Counter("specpipe_stage_failures_recovered_total",
                    "Requests re-run on a recovered pipeline after a stage failure")


class Recovery:
    """Owns the coordinator's pipeline while it recovers; attach() makes the engine call it on failure.

    A failure of the pipeline being recovered is old news and ignored; a failure of the pipeline it just
    opened (a stage that flaps) makes it run once more when it is done."""

    def __init__(self, coordinator: Coordinator, timeout_s: float, retry_s: float = 0.5,
                 attempt_timeout_s: float = 5.0) -> None:
        self.coordinator = coordinator
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.attempt_timeout_s = attempt_timeout_s    # per reconnect attempt, so that a retarget is seen soon
        self._task: asyncio.Task | None = None
        self._addresses: list[str] = []
        self._failed: weakref.WeakSet = weakref.WeakSet()     # transports whose failure is being handled
        self._again: tuple[BaseException, object] | None = None    # a failure of the pipeline just opened
        self._gave_up, self._why = False, ""

    def attach(self) -> None:
        self.coordinator.engine.on_failure = self.trigger

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def trigger(self, error: BaseException, transport: object) -> None:
        if transport in self._failed:
            return
        self._failed.add(transport)
        if self.running:
            self._again = (error, transport)
            return
        pipeline = self.coordinator.pipeline
        self._addresses = list(pipeline.addresses) if pipeline is not None else []
        self._task = asyncio.get_running_loop().create_task(self._run(error, transport))

    def retarget(self, addresses: list[str]) -> None:
        """A re-partition arrived while recovering (say `kubectl scale` removed the failed stage): recover
        onto these stages instead (re-configured with the even split if they hold other layers)."""
        self._addresses = list(addresses)

    async def wait(self) -> None:
        """Until the recovery in progress (if any) has ended."""
        if self._task is not None:
            await asyncio.wait([self._task])

    async def close(self, why: str = "the coordinator is shutting down") -> None:
        """Stop recovering: the requests it held end with UNAVAILABLE and `why`."""
        if self.running:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self.coordinator.engine.fail_running(why)

    async def _run(self, error: BaseException, transport: object) -> None:
        c = self.coordinator
        while True:
            try:
                if c.pipeline_lock.locked() and transport is c.draining:
                    await self._hand_over(error, transport)
                else:
                    async with c.pipeline_lock:     # after a re-partition in progress, if any
                        if c.pipeline is transport:
                            await self._recover(error)
            except Exception as e:                  # a bug: say so to the held requests rather than hang them
                log.exception("recovery failed", error=repr(e))
                c.engine.fail_running(f"recovery after a stage failure failed: {e!r}")
                FAILURES.labels("failed").inc()
                return
            if self._again is None:
                return
            (error, transport), self._again = self._again, None

    async def _hand_over(self, error: BaseException, transport: GrpcPipeline) -> None:
        """The pipeline a re-partition is draining failed: drop it and suspend the engine; the re-partition
        (coordinator/engine/scaling.py) then runs the requests again on the new pipeline."""
        c = self.coordinator
        log.warning("stage failure during a re-partition: the requests go on on the new pipeline",
                    error=str(error))
        c.pipeline = None
        await transport.abort()
        await c.engine.suspend()
        FAILURES.labels("repartition").inc()

    async def _recover(self, error: BaseException) -> None:
        c, engine = self.coordinator, self.coordinator.engine
        started = time.monotonic()
        old, c.pipeline = c.pipeline, None
        log.warning("stage failure: recovering", error=str(error), running=len(engine.admission.active),
                    timeout_s=self.timeout_s)
        await old.abort()
        orphans = await engine.suspend()
        self._gave_up, self._why = False, str(error)
        give_up = asyncio.get_running_loop().call_later(self.timeout_s, self._give_up)   # whatever hangs
        attempt = 0
        try:
            while True:
                try:
                    pipeline = await self._reconnect(self._addresses, orphans, self.attempt_timeout_s)
                    c.pipeline = pipeline
                    rerun = await engine.restart(pipeline, c.kv_slots(pipeline))
                    break
                except Exception as e:
                    if c.pipeline is not None:           # the restart failed half-way: take it down again
                        await c.pipeline.abort()
                        c.pipeline = None
                        orphans |= await engine.suspend()
                    attempt += 1
                    self._why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                    if attempt == 1 or attempt % 20 == 0:
                        log.info("waiting for the stages", error=self._why, attempt=attempt)
                    await asyncio.sleep(self.retry_s)
        finally:
            give_up.cancel()
        RECOVERED.inc(rerun)
        if not self._gave_up:
            FAILURES.labels("recovered").inc()
        log.warning("pipeline recovered", seconds=round(time.monotonic() - started, 2), rerun=rerun,
                    released=len(orphans), stages=len(pipeline.addresses))

    def _give_up(self) -> None:
        """The recovery timeout passed: answer the held requests (the recovery goes on for later ones)."""
        self._gave_up = True
        FAILURES.labels("gave_up").inc()
        log.error("stages not back: failing the running requests", seconds=self.timeout_s, error=self._why)
        self.coordinator.engine.fail_running(f"a pipeline stage failed and did not come back within "
                                             f"{self.timeout_s:.0f} s ({self._why}); retry later")

    async def _reconnect(self, addresses: list[str], orphans: set[str], timeout_s: float) -> GrpcPipeline:
        c = self.coordinator
        if not addresses:
            raise PipelineError("no stages")
        infos = await release_held(addresses, orphans, c.config.tls, timeout_s)
        if _covers_wrongly(infos, c.num_layers):
            log.warning("a stage came back with other layers: re-configuring the pipeline")
            await asyncio.gather(*(configure(p, tls=c.config.tls) for p in plan(addresses, c.num_layers)))
        return await c.open_pipeline(addresses)


def _covers_wrongly(infos: list[stage_pb2.StageInfo], num_layers: int) -> bool:
    expected = 0
    for info in infos:
        if info.first_layer != expected:
            return True
        expected = info.last_layer
    return expected != num_layers
