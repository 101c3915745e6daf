"""For the fuzz tests (tests/services/test_fuzz.py, tests/frontends/test_fuzz_api.py): real gRPC services run
on an event loop in a background thread so that synchronous hypothesis tests can drive them — a raw 2-stage
pipeline (nobody else subscribed to its Results) and, separately, a coordinator over its own 2 stages, both
with a 1 MiB message limit — plus the reference validator and the hypothesis strategies of micro-batches."""
from __future__ import annotations

import asyncio
import itertools
import math
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import torch
from hypothesis import strategies as st

from coordinator.engine.local import free_ports
from coordinator.config import CoordinatorConfig
from coordinator.frontends.server import start as start_coordinator
from protos import common_pb2, generation_pb2_grpc, stage_pb2, stage_pb2_grpc
from common.batch import Control
from services.config import MiB, StageConfig
from common.grpc_server import Server
from services.kv_cache import RequestKV
from services.server import SERVICE_NAME, build_runner
from services.servicer import StageServicer
from common.wire import control_to_proto

T = TypeVar("T")
SC = grpc.StatusCode
MAX_MB = 1
# the tiny model of tests/helpers/models.py
VOCAB, HIDDEN, CONTEXT, LAYERS = 256, 64, 512, 4
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1}


class Loop:
    """An asyncio loop in a daemon thread; `run` executes a coroutine there and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, aw: Awaitable[T] | Callable[[], Awaitable[T]], timeout: float = 60) -> T:
        """Await a coroutine, or what a callable returns (gRPC calls must be created on the loop)."""
        async def go() -> T:
            return await (aw() if callable(aw) else aw)
        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def start_stages(model: str, n: int) -> tuple[list[str], list[Server], list[StageServicer]]:
    ports = free_ports(n)
    addrs = [f"127.0.0.1:{p}" for p in ports]
    servers, servicers = [], []
    for i, port in enumerate(ports):
        config = StageConfig(model=model, stage=i, num_stages=n, port=port,
                             next_hop=addrs[i + 1] if i + 1 < n else "", max_message_mb=MAX_MB)
        runner, _ = build_runner(config)
        servicer = StageServicer(runner, config, model_name="test", model_ref=model)
        server = Server([SERVICE_NAME], MAX_MB * MiB)
        stage_pb2_grpc.add_StageServicer_to_server(servicer, server.server)
        server.bind(config.host, port)
        servicer.start()
        await server.start()
        servers.append(server)
        servicers.append(servicer)
    return addrs, servers, servicers


class Env:
    """Everything the fuzz tests talk to. Methods ending in _a are coroutines (run them with env.run)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.loop = Loop()
        self.batch_ids = itertools.count(1000)
        self.rids = itertools.count()
        self.loop.run(self._start())

    def run(self, aw: Awaitable[T] | Callable[[], Awaitable[T]], timeout: float = 60) -> T:
        return self.loop.run(aw, timeout)

    def rid(self) -> str:
        return f"fz{next(self.rids)}"

    async def _start(self) -> None:
        self.addrs, self._servers, self.servicers = await start_stages(self.model, 2)
        self.api_stage_addrs, api_servers, self.api_servicers = await start_stages(self.model, 2)
        self._servers += api_servers
        self.api_server, self.coord = await start_coordinator(CoordinatorConfig(
            stages=tuple(self.api_stage_addrs), model=self.model, port=0, max_new_tokens_cap=64,
            default_max_new_tokens=16, max_message_mb=MAX_MB, api_max_message_mb=MAX_MB))
        self.api_addr = f"127.0.0.1:{self.api_server.port}"
        self.channels = {a: grpc.aio.insecure_channel(a) for a in [*self.addrs, *self.api_stage_addrs, self.api_addr]}
        self.stubs = [stage_pb2_grpc.StageStub(self.channels[a]) for a in self.addrs]
        self.api_stage_stubs = [stage_pb2_grpc.StageStub(self.channels[a]) for a in self.api_stage_addrs]
        self.api = generation_pb2_grpc.GenerationStub(self.channels[self.api_addr])
        self.results = self.stubs[-1].Results(stage_pb2.ResultsRequest())
        await self.results.initial_metadata()

    def close(self) -> None:
        async def stop() -> None:
            self.results.cancel()
            for c in self.channels.values():
                await c.close()
            await self.api_server.stop(0)
            await self.coord.close()
            for server in self._servers:
                await server.stop(0)
            for servicer in [*self.servicers, *self.api_servicers]:
                await servicer.close()
        try:
            self.run(stop())
        finally:
            self.loop.close()

    # -- the raw stage pipeline ---------------------------------------------------------------------
    async def send_a(self, msg: stage_pb2.MicroBatch, stage: int = 0) -> stage_pb2.MicroBatch:
        """Forward one micro-batch into `stage`; return what the last stage publishes for it."""
        msg.batch_id = next(self.batch_ids)
        call = self.stubs[stage].Forward()
        await call.write(msg)
        await call.done_writing()
        summary = await call
        assert summary.batches == 1
        while True:
            out = await asyncio.wait_for(self.results.read(), timeout=30)
            if out.batch_id == msg.batch_id:
                return out

    async def control_a(self, *msgs: Control | stage_pb2.ControlMessage, stubs=None) -> None:
        """Send control messages to every stage on one stream each; each stream must end OK."""
        for stub in stubs or self.stubs:
            call = stub.Control()
            for m in msgs:
                await call.write(m if isinstance(m, stage_pb2.ControlMessage) else control_to_proto(m))
            await call.done_writing()
            summary = await call
            assert summary.messages == len(msgs)

    async def held_a(self, api: bool = False) -> list[list[str]]:
        """Request ids holding state on each stage, from Info (active_requests) and from the runner."""
        stubs, servicers = (self.api_stage_stubs, self.api_servicers) if api else (self.stubs, self.servicers)
        out = []
        for stub, servicer in zip(stubs, servicers):
            info = await stub.Info(stage_pb2.InfoRequest(), timeout=10)
            assert info.active_requests == len(servicer.runner.cache.requests)
            out.append(sorted(servicer.runner.cache.requests))
        return out

    async def greedy_a(self, prompt: list[int], n: int) -> list[int]:
        """Greedy decoding over the raw pipeline, one token per trip (like `pp`); releases at the end."""
        from common.batch import MicroBatch, Segment
        from common.wire import batch_to_proto
        rid = self.rid()
        ids = list(range(len(prompt)))
        await self.control_a(Control(rid, commit=ids))
        seg = Segment(rid, ids, [-1] + ids[:-1], ids, prompt, [False] * (len(ids) - 1) + [True])
        out, tokens = await self.send_a(batch_to_proto(MicroBatch(0, [seg]))), []
        while True:
            assert not out.segments[0].error, out.segments[0].error
            tokens.append(out.argmax[0])
            if len(tokens) == n:
                break
            node = len(prompt) + len(tokens) - 1
            await self.control_a(Control(rid, commit=[node]))
            seg = Segment(rid, [node], [node - 1], [node], [tokens[-1]], [True])
            out = await self.send_a(batch_to_proto(MicroBatch(0, [seg])))
        await self.control_a(Control(rid, release=True))
        return tokens


def check_invariants(r: RequestKV) -> None:
    """A request's node table, KV slots and masks agree (used after every fuzzed message)."""
    t = r.table
    assert set(r.slot_of) == set(t.nodes), "every held node has exactly one KV slot"
    assert len(set(r.slot_of.values())) == len(r.slot_of)
    assert sorted([*r.slot_of.values(), *r.free]) == list(range(r.high_water)), "no slot lost or shared"
    assert not set(t.nodes) & t.tombstones and not t.pending_commit & set(t.nodes)
    roots = [i for i, n in t.nodes.items() if n.parent == -1]
    assert len(roots) <= 1
    for i, n in t.nodes.items():
        assert n.parent == -1 or n.parent in t.nodes, "every live node's parent is live"
        if n.parent != -1:
            assert i in t.nodes[n.parent].children and n.position == t.nodes[n.parent].position + 1
        assert all(c in t.nodes and t.nodes[c].parent == i for c in n.children)
        assert r.slot_position[r.slot_of[i]].item() == n.position
        assert bool(r.committed[r.slot_of[i]]) == n.committed
        t.visible(i)                       # walks to the root without a missing link
    if r.high_water:
        r.attention_mask(sorted(t.nodes))


def code_of(call) -> SC:
    """The status code a synchronous call (e.g. lambda: env.run(...)) ends with."""
    try:
        call()
    except grpc.aio.AioRpcError as e:
        return e.code()
    return SC.OK


async def raw_code(call) -> SC:
    try:
        if hasattr(call, "read"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return SC.OK


def raw(env: Env, where: str, path: str, kind: str, payload: bytes) -> SC:
    """Send raw bytes (no serializer) to a method of a stage or of the coordinator; return the status."""
    addr = {"stage0": env.addrs[0], "stage1": env.addrs[1], "api": env.api_addr}[where]
    channel = env.channels[addr]

    async def go() -> SC:
        if kind == "uu":
            return await raw_code(channel.unary_unary(path)(payload, timeout=10))
        if kind == "us":
            return await raw_code(channel.unary_stream(path)(payload, timeout=10))
        make = channel.stream_unary if kind == "su" else channel.stream_stream
        call = make(path)(timeout=10)
        await call.write(payload)
        await call.done_writing()
        return await raw_code(call)
    return env.run(go())


# -- micro-batches: reference validator and strategies --------------------------------------------
def sampling_ok(s: dict) -> bool:
    t, p, k = s.get("temperature", 0.0), s.get("top_p", 0.0) or 1.0, s.get("top_k", 0)
    return t >= 0 and t != math.inf and 0 < p <= 1 and k >= 0          # NaN fails every comparison


def segment_ok(s: dict, stage: int, repeated: set[str]) -> bool:
    """Whether a stage must accept this segment of a request it has never seen."""
    nodes, parents, pos, toks, want = (s[k] for k in ("node_ids", "parent_ids", "positions", "token_ids",
                                                      "want_output"))
    if not s["request_id"] or s["request_id"] in repeated or not sampling_ok(s):
        return False
    if not len(nodes) == len(parents) == len(pos) == len(toks) == len(want):
        return False
    if any(not 0 <= p < CONTEXT for p in pos) or (stage == 0 and any(not 0 <= t < VOCAB for t in toks)):
        return False
    seen: dict[int, int] = {}
    root = False
    for node, parent, p in zip(nodes, parents, pos):
        if node < 0 or node in seen:
            return False
        if parent == -1:
            if p != 0 or root:
                return False
            root = True
        elif parent not in seen or p != seen[parent] + 1:
            return False
        seen[node] = p
    return True


def decodable(t: common_pb2.Tensor) -> bool:
    size = ITEMSIZE.get(t.dtype)
    return (size is not None and len(t.shape) <= 8 and all(d >= 0 for d in t.shape)
            and len(t.data) == math.prod(t.shape) * size)


@st.composite
def segment(draw) -> dict:
    """A tree segment (parents before children); half of them then get bad sampling values, an empty or
    repeated request id, and 0-2 corruptions of their rows."""
    n = draw(st.integers(0, 5))
    base = draw(st.sampled_from([0, 100, (1 << 62)]))
    nodes = [base + i for i in range(n)]
    parents = [-1] + [nodes[draw(st.integers(0, i - 1))] for i in range(1, n)]
    depth = {-1: -1}
    for node, parent in zip(nodes, parents):
        depth[node] = depth[parent] + 1
    faulty = draw(st.booleans())
    def pick(good: list, bad: list):
        return draw(st.sampled_from(good + bad if faulty else good))
    s = dict(rid=pick(["fresh"] * 3, ["empty", "repeat"]), node_ids=nodes, parent_ids=parents,
             positions=[depth[x] for x in nodes],
             token_ids=draw(st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n)),
             want_output=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
             temperature=pick([0.0] * 3 + [0.7, 1e-45], [math.nan, math.inf, -1.0]),
             top_p=pick([0.0] * 3 + [0.5, 1.0], [2.0, -0.1, math.nan]),
             top_k=pick([0] * 3 + [5, (1 << 31) - 1], [-1]), seed=draw(st.sampled_from([0, (1 << 64) - 1])))
    corruptions = draw(st.lists(st.sampled_from(["dup", "swap", "parent", "root", "pos", "token", "negative",
                                                 "short"]), max_size=2 if n and faulty else 0))
    for corrupt in sorted(corruptions, key=lambda c: c == "short"):      # a shortened field last
        i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        if corrupt == "dup":
            s["node_ids"][j] = s["node_ids"][i]
        elif corrupt == "swap":                                   # maybe a child before its parent
            for k in ("node_ids", "parent_ids", "positions"):
                s[k][i], s[k][j] = s[k][j], s[k][i]
        elif corrupt == "parent":
            s["parent_ids"][j] = draw(st.sampled_from([-7, 55, (1 << 63) - 1]))
        elif corrupt == "root":
            s["parent_ids"][j], s["positions"][j] = -1, 0
        elif corrupt == "pos":
            s["positions"][j] = draw(st.sampled_from([-1, CONTEXT, (1 << 31) - 1, -(1 << 31), s["positions"][j] + 1]))
        elif corrupt == "token":
            s["token_ids"][j] = draw(st.sampled_from([-1, VOCAB, (1 << 31) - 1]))
        elif corrupt == "negative":
            s["node_ids"][j] = draw(st.sampled_from([-1, -(1 << 63)]))
        else:
            field = s[draw(st.sampled_from(["parent_ids", "positions", "token_ids", "want_output"]))]
            del field[-1:]
    return s


@st.composite
def tensor(draw, rows: int) -> common_pb2.Tensor | None:
    kind = draw(st.sampled_from(["none"] + ["valid"] * 6 + ["dtype", "rows", "width", "dims", "bytes", "unknown",
                                                           "negative", "random"]))
    dtype, shape = "float32", [rows, HIDDEN]
    if kind == "none":
        return None
    if kind == "dtype":
        dtype = draw(st.sampled_from(["float16", "bfloat16", "float64", "int32", "bool"]))
    elif kind == "rows":
        shape = [rows + draw(st.sampled_from([-1, 1])), HIDDEN]
    elif kind == "width":
        shape = [rows, HIDDEN + draw(st.sampled_from([-1, 1]))]
    elif kind == "dims":
        shape = draw(st.sampled_from([[rows, HIDDEN, 1], [rows * HIDDEN], [1] * 9]))
    elif kind == "unknown":
        dtype = draw(st.sampled_from(["complex64", "", "Float32", "float8"]))
    elif kind == "negative":
        shape = [-rows - 1, -HIDDEN]
    elif kind == "random":
        dtype, shape = draw(st.sampled_from(sorted(ITEMSIZE))), draw(st.lists(st.integers(0, 5), max_size=3))
    size = abs(math.prod(shape)) * ITEMSIZE.get(dtype, 4)
    size += draw(st.sampled_from([-1, 1, 3])) if kind == "bytes" and size else 0
    values = torch.randn(size // 4 + 1, generator=torch.Generator().manual_seed(draw(st.integers(0, 1 << 16))))
    data = values.numpy().tobytes()[:size] if dtype == "float32" else draw(st.binary(min_size=size, max_size=size))
    return common_pb2.Tensor(dtype=dtype, shape=shape, data=data)


@st.composite
def micro_batch(draw) -> tuple:
    """(stage to send to, segments, preset error segment?, hidden, logprobs, return_logprobs)"""
    stage = draw(st.sampled_from([0, 1]))
    segs = draw(st.lists(segment(), max_size=3))
    preset = draw(st.integers(0, 9)) == 0                 # add a segment an earlier stage rejected
    rows = sum(len(s["node_ids"]) for s in segs)
    hidden = draw(tensor(rows)) if stage == 1 or draw(st.integers(0, 9)) == 0 else None
    logprobs = draw(st.sampled_from([None] * 9 + [common_pb2.Tensor(dtype="float32", shape=[2], data=b"\x00" * 7)]))
    return stage, segs, preset, hidden, logprobs, draw(st.booleans())
