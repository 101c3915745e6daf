"""Waiting on a condition, never a fixed sleep standing in for it: poll until it holds, fail the test with a
message when a deadline passes (the deadline only keeps a broken run from hanging).

    await wait_until(lambda: len(coord.engine.admission.queue) == 1, what="the second request queued")
    await wait_until(lambda: stage_holds(stub), timeout=10)        # an async predicate is awaited each poll
    wait_until_blocking(lambda: port_file.exists(), timeout=120, what="the stage's port file")
    await wait_until_empty(stage_addresses, coord)                 # nothing left on stages or engine
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from protos import stage_pb2, stage_pb2_grpc

Predicate = Callable[[], Any]                  # returns a truth value, or an awaitable of one
What = str | Callable[[], str]                 # what should hold; a callable is asked when the deadline passes


def _failed(what: What, timeout: float) -> None:
    pytest.fail(f"{what() if callable(what) else what} did not hold within {timeout} s")


async def wait_until(predicate: Predicate, timeout: float = 60.0, what: What = "the condition",
                     interval: float = 0.02) -> Any:
    """Poll `predicate` every `interval` s until it returns a true value (returned); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            _failed(what, timeout)
        await asyncio.sleep(interval)


def wait_until_blocking(predicate: Callable[[], Any], timeout: float = 60.0, what: What = "the condition",
                        interval: float = 0.02) -> Any:
    """wait_until for code without an event loop (blocking clients, subprocesses, threads)."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            _failed(what, timeout)
        time.sleep(interval)
    return result


async def stage_infos(addrs: list[str]) -> list[stage_pb2.StageInfo]:
    """Every stage's Info, in order."""
    out = []
    for a in addrs:
        async with grpc.aio.insecure_channel(a) as ch:
            out.append(await stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=10))
    return out


async def wait_until_empty(addrs: list[str], coord: Any, timeout: float = 10.0) -> None:
    """Releases travel asynchronously: wait until no stage holds any request and no micro-batch of a finished
    request is still on its way back (a cancelled request's last micro-batch may be in transit)."""
    infos: list[stage_pb2.StageInfo] = []
    in_flight = 0

    async def empty() -> bool:
        nonlocal infos, in_flight
        infos = await stage_infos(addrs)
        in_flight = sum(s.in_flight for s in coord.engine._schedulers.values())
        return all(i.active_requests == 0 and i.kv_bytes == 0 for i in infos) and coord.engine.active == 0 \
            and in_flight == 0

    await wait_until(empty, timeout, interval=0.05, what=lambda: (
        f"nothing left (stages {[(i.active_requests, i.kv_bytes) for i in infos]}, engine {coord.engine.active}, "
        f"micro-batches in flight {in_flight})"))


async def wait_until_released(pipeline: Any, num_stages: int, timeout: float = 10.0) -> None:
    """Release messages travel on the control streams: wait until no stage of `pipeline` (a GrpcPipeline,
    asked by `info(stage)`) holds a request or KV bytes."""
    infos: list[stage_pb2.StageInfo] = []

    async def released() -> bool:
        nonlocal infos
        infos = [await pipeline.info(i) for i in range(num_stages)]
        return all(i.active_requests == 0 and i.kv_bytes == 0 for i in infos)

    await wait_until(released, timeout, interval=0.05,
                     what=lambda: f"stages released (they hold {[(i.active_requests, i.kv_bytes) for i in infos]})")
