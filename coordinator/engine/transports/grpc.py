"""The transport over real stage services: gRPC.

Data plane: one Forward stream into stage 0 (the stages forward among themselves) and one Results
subscription on the last stage. Control plane: one Control stream per stage. Messages on each stream keep
their order; the two planes are independent (stages cope with either order).

Failure detection: `results()` raises PipelineError when any of these streams ends or breaks (a killed stage
breaks its connections at once), and when a stage does not answer a health check within `probe_timeout_s`
(probed every `probe_interval_s`: a hung or unreachable stage; a draining one still answers, NOT_SERVING,
and keeps its streams until it stops). Keepalive pings bound the rest.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import stage_pb2, stage_pb2_grpc
from common.batch import Control, MicroBatch, Segment
from common.grpc_server import channel_options
from common.logs import get_logger
from common.tls import TLSFiles, open_channel
from common.wire import batch_from_proto, batch_to_proto, control_to_proto

from coordinator.core.status import Status

log = get_logger(__name__)


class PipelineError(RuntimeError):
    pass


class GrpcPipeline:
    def __init__(self, addresses: list[str], max_message_bytes: int = 256 * 1024 * 1024,
                 connect_timeout_s: float = 120.0, tls: TLSFiles | None = None,
                 probe_interval_s: float = 2.0, probe_timeout_s: float = 10.0) -> None:
        if not addresses:
            raise ValueError("a pipeline needs at least one stage address")
        self.addresses = addresses
        self.max_message_bytes = max_message_bytes
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self.infos: list[stage_pb2.StageInfo] = []
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[stage_pb2_grpc.StageStub] = []
        self._forward = None
        self._controls: list = []
        self._results: asyncio.Queue[MicroBatch | BaseException] = asyncio.Queue()
        self._reader: asyncio.Task | None = None
        self._watchers: list[asyncio.Task] = []
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._closing = False
        self._aborted = False

    @property
    def num_stages(self) -> int:
        return len(self.addresses)

    async def start(self) -> None:
        """Connect (waiting up to connect_timeout_s for every stage), check the layer coverage, open the
        streams. On failure nothing is left open."""
        try:
            await self._start()
        except BaseException:
            await self.abort()
            raise

    async def _start(self) -> None:
        opts = channel_options(self.max_message_bytes)
        self._channels = [open_channel(a, self.tls, opts) for a in self.addresses]
        self._stubs = [stage_pb2_grpc.StageStub(c) for c in self._channels]
        try:
            self.infos = list(await asyncio.gather(*(
                s.Info(stage_pb2.InfoRequest(), timeout=self.connect_timeout_s, wait_for_ready=True)
                for s in self._stubs)))
        except grpc.aio.AioRpcError as e:
            raise PipelineError(f"cannot reach the stages {self.addresses}: {e.details()}") from e
        check_coverage(self.infos, self.addresses)
        results_call = self._stubs[-1].Results(stage_pb2.ResultsRequest(), wait_for_ready=True)
        self._reader = asyncio.create_task(self._read_results(results_call))
        await asyncio.wait_for(results_call.initial_metadata(), timeout=self.connect_timeout_s)
        self._forward = self._stubs[0].Forward(wait_for_ready=True)
        self._controls = [s.Control(wait_for_ready=True) for s in self._stubs]
        streams = [(0, "forward", self._forward), *((i, "control", c) for i, c in enumerate(self._controls))]
        for i, what, call in streams:
            call.add_done_callback(lambda c, w=f"{what} stream to stage {i} ({self.addresses[i]})": self._ended(c, w))
        # a write waits for its stream's metadata to be sent, and never wakes if the call is cancelled before
        # (grpcio 1.85: _StreamRequestMixin._write): with the streams opened here, an abort cannot strand one
        try:
            await asyncio.wait_for(asyncio.gather(*(call.wait_for_connection() for _, _, call in streams)),
                                   timeout=self.connect_timeout_s)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            why = e.details() if isinstance(e, grpc.aio.AioRpcError) else f"not within {self.connect_timeout_s:g} s"
            raise PipelineError(f"cannot open the streams to the stages {self.addresses}: {why}") from e
        if self.probe_interval_s > 0:
            self._watchers.append(asyncio.create_task(self._probe()))

    def _broken(self, why: str) -> None:
        if not self._closing:
            log.warning("pipeline broken", why=why)
            self._results.put_nowait(PipelineError(why))

    def _ended(self, call: grpc.aio.Call, what: str) -> None:
        """A client stream ends only when we close it: ending or failing before that means a stage went."""
        if self._closing:
            return
        async def report() -> None:
            self._broken(f"{what} ended: {(await call.code()).name} {await call.details()}")
        self._watchers.append(asyncio.get_running_loop().create_task(report()))

    async def _probe(self) -> None:
        stubs = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        while True:
            await asyncio.sleep(self.probe_interval_s)
            for i, stub in enumerate(stubs):
                try:       # a draining stage (NOT_SERVING) still serves its streams: only silence counts
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout_s)
                except grpc.aio.AioRpcError as e:
                    self._broken(f"stage {i} ({self.addresses[i]}) health check failed: "
                                 f"{e.code().name} {e.details()}")
                    return

    async def _read_results(self, call) -> None:
        try:
            async for msg in call:
                batch = batch_from_proto(msg)
                batch.wire_bytes = msg.ByteSize()
                self._results.put_nowait(batch)
            self._results.put_nowait(PipelineError("the last stage closed the results stream"))
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as e:
            if not self._closing:
                self._results.put_nowait(PipelineError(f"results stream failed: {e.code().name} {e.details()}"))
        except Exception as e:   # an undecodable result: the pipeline is broken, say so rather than hang
            self._results.put_nowait(PipelineError(f"results stream failed: {e}"))

    async def inject(self, batch: MicroBatch) -> None:
        await self._forward.write(encode(batch))

    async def broadcast(self, control: Control) -> None:
        msg = control_to_proto(control)
        for call in self._controls:
            await call.write(msg)

    async def results(self) -> AsyncIterator[MicroBatch]:
        while True:
            item = await self._results.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    async def info(self, stage: int, request_id: str = "") -> stage_pb2.StageInfo:
        return await self._stubs[stage].Info(stage_pb2.InfoRequest(request_id=request_id), timeout=30)

    async def abort(self) -> None:
        """Drop the pipeline at once (after a failure): cancel every call, wait for nothing."""
        self._closing = self._aborted = True
        for task in [*self._watchers, self._reader]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*self._watchers, *([self._reader] if self._reader else []), return_exceptions=True)
        for c in self._channels:
            await c.close(grace=None)

    async def close(self) -> None:
        """Close the streams once the stages have read what was sent on them (nothing to do after abort)."""
        if self._aborted:
            return
        self._closing = True
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for call in [self._forward, *self._controls]:
            if call is not None:
                try:
                    await call.done_writing()
                    # the summary comes once the stage has read every message (the releases among them):
                    # closing the channel before that would drop what is still in transit
                    await asyncio.wait_for(call, timeout=10)
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, asyncio.TimeoutError):
                    pass
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        for c in self._channels:
            await c.close()


_UNENCODABLE = (ValueError, TypeError, OverflowError)


def encode(batch: MicroBatch) -> stage_pb2.MicroBatch:
    """The batch's wire message. A segment that cannot be encoded (a value outside its wire type, which
    validation at the door should have refused) is the fault of its request, not of the pipeline: it travels
    as a failed segment (no rows), so its request ends with INVALID_ARGUMENT when the batch comes back and
    the other requests of the batch are computed as usual.

        encode(MicroBatch(7, [ok, Segment("r2", ..., sampling=Sampling(1.0, 1.0, 2**32, 1))]))
        -> segments [ok, Segment.failed("r2", "the request cannot be sent to the stages: ...", INVALID_ARGUMENT, -1)]
    """
    try:
        return batch_to_proto(batch)
    except _UNENCODABLE:
        pass
    segments = []
    for seg in batch.segments:
        try:
            batch_to_proto(MicroBatch(0, [seg]))
            segments.append(seg)
        except _UNENCODABLE as e:
            log.warning("a segment cannot be encoded: failing its request", request_id=seg.request_id, error=str(e))
            segments.append(Segment.failed(seg.request_id, f"the request cannot be sent to the stages: {e}",
                                           Status.INVALID_ARGUMENT, -1))
    return batch_to_proto(replace(batch, segments=segments))


def check_coverage(infos: list[stage_pb2.StageInfo], addresses: list[str]) -> None:
    """The stages, in order, must hold consecutive layer ranges covering the whole model."""
    expected = 0
    for addr, info in zip(addresses, infos):
        if info.first_layer != expected:
            raise PipelineError(f"stage at {addr} holds layers [{info.first_layer}, {info.last_layer}), "
                                f"expected it to start at layer {expected}")
        expected = info.last_layer
    total = infos[0].num_layers_total
    if expected != total:
        raise PipelineError(f"the stages cover layers [0, {expected}) of the model's {total}")
