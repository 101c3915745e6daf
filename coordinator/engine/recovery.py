"""Stage failure recovery: the client's stream pauses, then goes on, every token exactly once.

When the pipeline breaks (coordinator/engine/transports/grpc.py: a stream of a stage ends or fails, or a stage stops
answering health checks), `Recovery` runs:
1. the failed pipeline is dropped and the engine suspended (Pipelines.suspend): new requests wait in the
   admission queue, the tokens already committed reach their clients, the speculation in flight is lost;
2. wait until every stage answers again — the same process, a restarted one (`specpipe local` restarts
   dead stage processes) or a replacement pod with the same index and DNS name — for at most
   `--recovery-timeout-s`;
3. release everything the stages hold (nothing of it is valid any more); a stage that came back with
   other layers than the partition needs (a pod restarted from its start-up arguments after a re-partition)
   is re-configured with the even split (coordinator/engine/scaling.py);
4. open a new pipeline and re-run every request from its prompt plus the tokens already streamed
   (Pipelines.restart) — greedy and seeded sampling give the same continuation a run without the failure gives.
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

import grpc
from prometheus_client import Counter

from protos import stage_pb2
from common.logs import get_logger

from coordinator.engine.pipeline import Pipelines
from coordinator.engine.scaling import configure, plan, release_held
from coordinator.engine.transports.grpc import GrpcPipeline, PipelineError

log = get_logger(__name__)
FAILURES = Counter("specpipe_stage_failures_total", "Pipeline failures by outcome of the recovery",
                   ["outcome"])
RECOVERED = Counter("specpipe_stage_failures_recovered_total",
                    "Requests re-run on a recovered pipeline after a stage failure")


class Recovery:
    """Replaces the pipeline after a failure, through its owner (coordinator/engine/pipeline.py); attach()
    makes the engine call it on failure.

    A failure of the pipeline being recovered is old news and ignored; a failure of the pipeline it just
    opened (a stage that flaps) makes it run once more when it is done."""

    def __init__(self, pipelines: Pipelines[GrpcPipeline], timeout_s: float, retry_s: float = 0.5,
                 attempt_timeout_s: float = 5.0) -> None:
        self.pipelines = pipelines
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.attempt_timeout_s = attempt_timeout_s    # per reconnect attempt, so that a retarget is seen soon
        self._task: asyncio.Task[None] | None = None
        self._addresses: list[str] = []
        self._failed: weakref.WeakSet[object] = weakref.WeakSet()     # transports whose failure is handled
        self._again: tuple[BaseException, object] | None = None    # a failure of the pipeline just opened
        self._gave_up, self._why = False, ""

    def attach(self) -> None:
        self.pipelines.engine.on_failure = self.trigger

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
        pipeline = self.pipelines.current
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
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self.pipelines.engine.fail_running(why)

    async def _run(self, error: BaseException, transport: object) -> None:
        p = self.pipelines
        while True:
            try:
                draining = p.draining
                if p.busy and draining is not None and transport is draining:
                    await self._hand_over(error, draining)
                else:
                    async with p.replacing():       # after a re-partition in progress, if any
                        current = p.current
                        if current is not None and current is transport:
                            await self._recover(error, current)
            except Exception as e:                  # a bug: say so to the held requests rather than hang them
                log.exception("recovery failed", error=repr(e))
                p.engine.fail_running(f"recovery after a stage failure failed: {e!r}")
                FAILURES.labels("failed").inc()
                return
            if self._again is None:
                return
            (error, transport), self._again = self._again, None

    async def _hand_over(self, error: BaseException, drained: GrpcPipeline) -> None:
        """The pipeline a re-partition is draining failed: drop it and suspend the engine; the re-partition
        (coordinator/engine/scaling.py) then runs the requests again on the new pipeline."""
        log.warning("stage failure during a re-partition: the requests go on on the new pipeline",
                    error=str(error))
        await self.pipelines.suspend(drained)
        FAILURES.labels("repartition").inc()

    async def _recover(self, error: BaseException, failed: GrpcPipeline) -> None:
        p = self.pipelines
        started = time.monotonic()
        log.warning("stage failure: recovering", error=str(error), running=len(p.engine.admission.active),
                    timeout_s=self.timeout_s)
        self._gave_up, self._why = False, str(error)
        give_up = asyncio.get_running_loop().call_later(self.timeout_s, self._give_up)   # whatever hangs
        attempt = 0
        try:
            orphans = await p.suspend(failed)
            while True:
                try:
                    pipeline = await self._reconnect(self._addresses, orphans, self.attempt_timeout_s)
                    rerun = await p.restart(pipeline)
                    break
                except Exception as e:
                    if p.current is not None:            # the restart failed half-way: take it down again
                        orphans |= await p.suspend()
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
        self.pipelines.engine.fail_running(f"a pipeline stage failed and did not come back within "
                                           f"{self.timeout_s:.0f} s ({self._why}); retry later")

    async def _reconnect(self, addresses: list[str], orphans: set[str], timeout_s: float) -> GrpcPipeline:
        p = self.pipelines
        if not addresses:
            raise PipelineError("no stages")
        infos = await release_held(addresses, orphans, p.tls, timeout_s)
        if _covers_wrongly(infos, p.num_layers):
            log.warning("a stage came back with other layers: re-configuring the pipeline")
            await asyncio.gather(*(configure(s, tls=p.tls) for s in plan(addresses, p.num_layers)))
        return await p.open(addresses)


def _covers_wrongly(infos: list[stage_pb2.StageInfo], num_layers: int) -> bool:
    expected = 0
    for info in infos:
        if info.first_layer != expected:
            return True
        expected = info.last_layer
    return expected != num_layers
