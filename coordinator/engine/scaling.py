"""Changing the pipeline depth while serving (`kubectl scale statefulset/<release>-stage --replicas=N`).

`Repartitioner.scale(n)` converges the pipeline to n stages:
1. hold: new requests wait in the admission queue (bounded by --max-queue; beyond it RESOURCE_EXHAUSTED);
2. drain: requests already running finish on the old pipeline (nothing is lost or restarted) — for at most
   --drain-timeout-s; then the old pipeline is dropped and what still runs goes on on the new one from its
   prompt plus the tokens it streamed (Pipelines.suspend, then swap: as after a stage failure);
3. re-partition: every stage 0..n-1 gets its even share of the layers and its next hop (Stage/Configure;
   a stage reads only the layers it now holds);
4. resume on the new pipeline (schedulers are rebuilt for the new depth), or, for n = 0, answer every
   request with UNAVAILABLE and a message saying the stages were scaled to zero.
Requests of the new target arriving while a re-partition runs are applied after it (the latest wins).

    plan(["a:1", "b:1", "c:1"], 30) -> stage 0 layers [0, 10) -> b:1, stage 1 [10, 20) -> c:1, stage 2 [20, 30) last
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from prometheus_client import Counter

from protos import stage_pb2, stage_pb2_grpc
from common.batch import Control
from common.logs import get_logger
from services.model.shard import even_split
from common.tls import TLSFiles, open_channel
from common.wire import control_to_proto

from coordinator.engine.pipeline import Pipelines
from coordinator.engine.state import EngineState
from coordinator.engine.transports.grpc import GrpcPipeline

log = get_logger(__name__)
REPARTITIONS = Counter("specpipe_repartitions_total", "Pipeline re-partitions by outcome", ["outcome"])


@dataclass(frozen=True)
class StagePlan:
    address: str
    stage: int
    num_stages: int
    first_layer: int
    last_layer: int
    next_hop: str


def plan(addresses: list[str], num_layers: int) -> list[StagePlan]:
    """The even layer split over the stages, each pointing at the next one."""
    ranges = even_split(num_layers, len(addresses))
    n = len(addresses)
    return [StagePlan(a, i, n, f, l, addresses[i + 1] if i + 1 < n else "")
            for i, (a, (f, l)) in enumerate(zip(addresses, ranges))]


async def configure(p: StagePlan, timeout_s: float = 600.0, attempts: int = 20,
                    tls: TLSFiles | None = None) -> stage_pb2.StageInfo:
    """Configure one stage; retries while it still releases the KV of drained requests (the control stream
    may deliver the releases a moment after the data plane went quiet)."""
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    async with open_channel(p.address, tls) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        req = stage_pb2.ConfigureRequest(stage=p.stage, num_stages=p.num_stages, first_layer=p.first_layer,
                                         last_layer=p.last_layer, next_hop=p.next_hop)
        for attempt in range(1, attempts + 1):
            try:
                return await stub.Configure(req, timeout=timeout_s, wait_for_ready=True)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION or attempt >= attempts:
                    raise
                await asyncio.sleep(0.1)


async def release_held(addresses: list[str], also: set[str], tls: TLSFiles | None,
                       timeout_s: float) -> list[stage_pb2.StageInfo]:
    """With no pipeline open, everything the stages hold is stale: release it (plus `also`, requests that may
    still be in flight towards them) on every stage; returns the stages' Info from before."""
    infos = await asyncio.gather(*(_info(a, tls, timeout_s) for a in addresses))
    await asyncio.gather(*(release(a, sorted(also | {r.request_id for r in info.requests}), tls, timeout_s)
                           for a, info in zip(addresses, infos)))
    return list(infos)


async def _info(address: str, tls: TLSFiles | None, timeout_s: float) -> stage_pb2.StageInfo:
    async with open_channel(address, tls) as channel:
        return await stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=timeout_s,
                                                             wait_for_ready=True)


async def release(address: str, request_ids: list[str], tls: TLSFiles | None, timeout_s: float) -> None:
    """Release requests on one stage and wait until it has applied the releases (unknown ids are harmless)."""
    if not request_ids:
        return
    async with open_channel(address, tls) as channel:
        call = stage_pb2_grpc.StageStub(channel).Control(timeout=timeout_s, wait_for_ready=True)
        for request_id in request_ids:
            await call.write(control_to_proto(Control(request_id, release=True)))
        await call.done_writing()
        await call


class Recovering(Protocol):
    """What a re-partition asks of the recovery (coordinator/engine/recovery.Recovery)."""

    @property
    def running(self) -> bool: ...
    def retarget(self, addresses: list[str]) -> None: ...
    async def wait(self) -> None: ...
    async def close(self, why: str) -> None: ...


class _DrainTimeout(Protocol):
    @property
    def drain_timeout_s(self) -> float: ...


class Served(Protocol):
    """What a re-partition needs of the coordinator it serves (frontends/service.Coordinator is one)."""

    @property
    def pipelines(self) -> Pipelines[GrpcPipeline]: ...
    @property
    def recovery(self) -> Recovering | None: ...
    @property
    def config(self) -> _DrainTimeout: ...


class Repartitioner:
    """Changes the pipeline's depth through its owner (coordinator/engine/pipeline.py); see the module
    docstring."""

    def __init__(self, coordinator: Served, address_of: Callable[[int], str]) -> None:
        self.coordinator = coordinator
        self.pipelines = coordinator.pipelines
        self.address_of = address_of
        current = self.pipelines.current
        self.current = current.num_stages if current is not None else 0
        self._target: int | None = None

    @property
    def broken(self) -> bool:
        """The pipeline failed with nothing to recover it: re-apply the partition even at the same depth."""
        return self.pipelines.engine.state is EngineState.FAILED

    async def scale(self, n: int, force: bool = False) -> None:
        """Converge to n stages (returns when done; concurrent calls: the latest target wins). force:
        re-partition even at the same depth (after a failure)."""
        if n < 0:
            raise ValueError("the number of stages cannot be negative")
        self._target = n
        p, recovery = self.pipelines, self.coordinator.recovery
        if recovery is not None and recovery.running and n > 0:   # recover straight onto the new depth
            recovery.retarget([self.address_of(i) for i in range(n)])
            await recovery.wait()
            pipeline = p.current
            self.current = pipeline.num_stages if pipeline is not None else -1
        elif recovery is not None and recovery.running:
            await recovery.close("the pipeline has no stages: the stage StatefulSet was scaled to 0 replicas")
        if p.closing:
            return
        async with p.replacing():
            if force and self.broken:
                self.current = -1
            while self._target is not None and self._target != self.current:
                if not await self._repartition(self._target):
                    break                       # failed: the next scale() (a watch event) tries again
            self._target = None

    async def _repartition(self, n: int) -> bool:
        p, engine = self.pipelines, self.pipelines.engine
        drain_timeout_s = self.coordinator.config.drain_timeout_s
        started = time.perf_counter()
        log.info("re-partition: holding new requests, draining", stages_from=self.current, stages_to=n,
                 running=len(engine.admission.active))
        p.drain()                               # a stage failure now is handed to us (recovery.py)
        orphans: set[str] = set()
        try:                                    # or suspended: the requests then run again on the new pipeline
            await asyncio.wait_for(engine.drained(), drain_timeout_s)
        except asyncio.TimeoutError:            # bounded pause: move what still runs, as a recovery would
            log.warning("re-partition: drain timed out, moving the running requests to the new pipeline",
                        running=len(engine.admission.active), drain_timeout_s=drain_timeout_s)
            if p.current is not None and engine.state is not EngineState.SUSPENDED:
                orphans = await p.suspend()
        await p.retire()
        if n == 0:
            self.current = 0
            await p.swap(None, "the pipeline has no stages: the stage StatefulSet was scaled to 0 replicas; "
                               "scale it up to serve again")
            REPARTITIONS.labels("scaled_to_zero").inc()
            log.warning("re-partition: no stages, answering UNAVAILABLE")
            return True
        try:
            plans = plan([self.address_of(i) for i in range(n)], p.num_layers)
            await release_held([s.address for s in plans], orphans, p.tls, 10.0)   # its stages are ready
            await asyncio.gather(*(configure(s, tls=p.tls) for s in plans))
            pipeline = await p.open([s.address for s in plans])
        except Exception as e:
            self.current = -1                       # unknown: the next scale() tries again
            await p.swap(None, f"re-partition to {n} stages failed: {e}")
            REPARTITIONS.labels("failed").inc()
            log.error("re-partition failed", stages=n, error=str(e))
            return False
        self.current = n
        await p.swap(pipeline)
        REPARTITIONS.labels("ok").inc()
        log.info("re-partitioned", stages=n, layers=[(s.first_layer, s.last_layer) for s in plans],
                 seconds=round(time.perf_counter() - started, 2))
        return True
