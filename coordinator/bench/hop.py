"""`specpipe bench-hop`: what one stage hop costs over real gRPC on 127.0.0.1.

A hop is the path a micro-batch's hidden states take from one stage to the next: the sender encodes the
micro-batch (`common.wire.batch_to_proto`) and writes it on its open `Stage.Forward` stream; the receiver,
another process, decodes it (`batch_from_proto`) and holds the tensor. Measured here from the sender's call
to the receiver holding the tensor, on CLOCK_MONOTONIC (one clock for every process of a machine), one
micro-batch at a time (latency, not throughput), with the stages' own channel and server options.

Reported per hop (p50 / p99 over `--count` hops after `--warmup`): `encode_ms` (sender, micro-batch to
message), `wire_ms` (the write until the receiver's handler has the message: serialisation, HTTP/2,
deserialisation), `decode_ms` (receiver, message to tensor) and `hop_ms` (all three).

    specpipe bench-hop --rows 32 --hidden 8192 --dtype bfloat16 --count 300

32 rows of hidden size 8192 in bf16 are 512 KiB: a tree of 32 nodes of a 70B model between two stages.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import grpc
import torch

from protos import stage_pb2, stage_pb2_grpc
from common.batch import MicroBatch, Segment
from services.config import parse_dtype
from common.grpc_server import channel_options, server_options
from common.memory import tune_allocator
from common.sampling import Sampling
from common.wire import batch_from_proto, batch_to_proto

LIMIT = 256 * 1024 * 1024


class _Receiver(stage_pb2_grpc.StageServicer):
    """Stage.Forward that decodes every micro-batch and reports (batch id, arrived, decoded) times."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    async def Forward(self, request_iterator, context):
        count = 0
        async for msg in request_iterator:
            arrived = time.monotonic_ns()
            batch = batch_from_proto(msg)
            decoded = time.monotonic_ns()
            assert batch.hidden is not None
            self.conn.send((msg.batch_id, arrived, decoded, int(batch.hidden.numel())))
            count += 1
        return stage_pb2.ForwardSummary(batches=count)


def _serve(conn: Connection, tuned: bool) -> None:
    if tuned:
        tune_allocator()

    async def main() -> None:
        server = grpc.aio.server(options=server_options(LIMIT))
        stage_pb2_grpc.add_StageServicer_to_server(_Receiver(conn), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.to_thread(conn.recv)      # told to stop
        await server.stop(1.0)
    asyncio.run(main())


def _batch(batch_id: int, hidden: torch.Tensor) -> MicroBatch:
    rows = hidden.shape[0]
    seg = Segment("r", list(range(rows)), [-1] + list(range(rows - 1)), list(range(rows)), [0] * rows,
                  [True] * rows, sampling=Sampling())
    return MicroBatch(batch_id, [seg], hidden)


def _quantiles(xs: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(xs, n=100, method="inclusive")
    return {"p50": round(statistics.median(xs), 4), "p99": round(qs[98], 4)}


async def measure(rows: int, hidden_size: int, dtype: torch.dtype, count: int, warmup: int,
                  tuned: bool = True) -> dict:
    """Hops of one micro-batch of [rows, hidden_size] `dtype` hidden states; see the module docstring.
    `tuned`: both processes run with `common.memory.tune_allocator` (as the stages and coordinator do)."""
    if tuned:
        tune_allocator()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(there, tuned), daemon=True)
    proc.start()
    try:
        port = await asyncio.to_thread(here.recv)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(LIMIT))
        call = stage_pb2_grpc.StageStub(channel).Forward(wait_for_ready=True)
        hidden = torch.randn(rows, hidden_size).to(dtype)
        encode, wire, decode, total = [], [], [], []
        for i in range(warmup + count):
            batch = _batch(i, hidden)
            sent = time.monotonic_ns()
            msg = batch_to_proto(batch)
            encoded = time.monotonic_ns()
            await call.write(msg)
            batch_id, arrived, decoded, numel = await asyncio.to_thread(here.recv)
            if batch_id != i or numel != hidden.numel():
                raise RuntimeError(f"hop {i}: the receiver got batch {batch_id} with {numel} values")
            if i >= warmup:
                encode.append((encoded - sent) / 1e6)
                wire.append((arrived - encoded) / 1e6)
                decode.append((decoded - arrived) / 1e6)
                total.append((decoded - sent) / 1e6)
        await call.done_writing()
        await call
        await channel.close()
        here.send("stop")
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    nbytes = hidden.numel() * hidden.element_size()
    return {"rows": rows, "hidden": hidden_size, "dtype": str(dtype).removeprefix("torch."), "bytes": nbytes,
            "allocator": "tuned" if tuned else "default",
            "count": count, "encode_ms": _quantiles(encode), "wire_ms": _quantiles(wire),
            "decode_ms": _quantiles(decode), "hop_ms": _quantiles(total)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=32, help="rows of hidden states per micro-batch")
    p.add_argument("--hidden", type=int, default=8192, help="hidden size (8192: a 70B Llama)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    p.add_argument("--count", type=int, default=300, help="hops measured")
    p.add_argument("--warmup", type=int, default=30, help="hops sent first and not counted")
    p.add_argument("--allocator", choices=("tuned", "default"), default="tuned",
                   help="tuned: glibc keeps message-sized buffers on the heap, as in the stages and coordinator "
                        "(common/memory.py); default: glibc's own settings, for comparison. A sender that "
                        "already tuned its allocator cannot untune it: run `default` in a fresh process")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def main(args: argparse.Namespace) -> int:
    if args.rows < 1 or args.hidden < 1 or args.count < 2 or args.warmup < 0:
        raise ValueError("--rows and --hidden must be >= 1, --count >= 2, --warmup >= 0")
    result = asyncio.run(measure(args.rows, args.hidden, parse_dtype(args.dtype), args.count, args.warmup,
                                 tuned=args.allocator == "tuned"))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"one hop, {result['rows']} x {result['hidden']} {result['dtype']} ({result['bytes'] // 1024} KiB), "
          f"{result['count']} hops over gRPC on 127.0.0.1 (CLOCK_MONOTONIC), {result['allocator']} allocator, "
          "ms p50 / p99:")
    for part in ("encode_ms", "wire_ms", "decode_ms", "hop_ms"):
        print(f"  {part.removesuffix('_ms'):<7} {result[part]['p50']:8.3f} {result[part]['p99']:8.3f}")
    return 0
