"""A raw client of a stage pipeline: Forward into stage 0, Results from the last, Control to every stage.

    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        async with Pipe(addrs) as pipe:
            out = await pipe.send(prefill("r", [5, 6, 7]))         # nodes 0 -> 1 -> 2; one output, node 2's
"""
from __future__ import annotations

import asyncio

import grpc

from protos import stage_pb2, stage_pb2_grpc
from common.batch import Control, MicroBatch, Segment
from common.wire import batch_to_proto, control_to_proto


class Pipe:
    """A raw client of a stage pipeline: Forward into stage 0, Results from the last, Control to all."""

    def __init__(self, addresses: list[str]) -> None:
        self.channels = [grpc.aio.insecure_channel(a) for a in addresses]
        self.stubs = [stage_pb2_grpc.StageStub(c) for c in self.channels]

    async def __aenter__(self) -> "Pipe":
        self.results = self.stubs[-1].Results(stage_pb2.ResultsRequest())
        await self.results.initial_metadata()
        return self

    async def __aexit__(self, *exc) -> None:
        self.results.cancel()
        for c in self.channels:
            await c.close()

    async def send(self, msg: stage_pb2.MicroBatch, stage: int = 0) -> stage_pb2.MicroBatch:
        call = self.stubs[stage].Forward()
        await call.write(msg)
        await call.done_writing()
        await call
        return await asyncio.wait_for(self.results.read(), timeout=30)

    async def control(self, *msgs: Control) -> None:
        for stub in self.stubs:
            call = stub.Control()
            for m in msgs:
                await call.write(control_to_proto(m))
            await call.done_writing()
            await call


def prefill(rid: str, tokens: list[int]) -> stage_pb2.MicroBatch:
    n = len(tokens)
    seg = Segment(rid, list(range(n)), [-1] + list(range(n - 1)), list(range(n)), tokens, [False] * (n - 1) + [True])
    return batch_to_proto(MicroBatch(1, [seg]))
