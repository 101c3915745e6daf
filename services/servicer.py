"""The Stage gRPC servicer: translates proto <-> StageRunner and moves micro-batches between hops.

Ownership: the StageRunner (and through it the KVCache) is touched only under `self._state`; compute runs
in a worker thread so control messages keep flowing while a step computes. `self._busy` serialises steps
(compute plus the emulated stage time), as one GPU would.

With TLS on, each RPC first checks the caller's certificate names (common/tls.py `PeerNames`):
Configure, Results and Control only from the coordinator, Forward from the coordinator or a stage (with a
certificate per stage: from the previous stage, by the index the last Configure gave; an open Forward stream
is checked again when Configure changes who that is).
"""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import replace

import grpc

from protos import stage_pb2, stage_pb2_grpc
from common.batch import Segment
from common.codec import CodecError
from services.config import StageConfig
from common.grpc_server import channel_options
from services import metrics
from common.logs import get_logger
from common.process import after_load
from services.model.shard import load_shard
from services.nodes import ProtocolError
from services.runner import BatchError, StageRunner
from common.tls import open_channel, require_peer
from common.wire import batch_from_proto, batch_to_proto, control_from_proto

log = get_logger(__name__)
_END = object()
HOP_CONNECT_S = 5.0     # how long a new Forward stream may take to reach the next hop before a retry


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, runner: StageRunner, config: StageConfig, model_name: str = "", model_ref: str = "") -> None:
        self.runner = runner
        self.config = config
        self.model_name = model_name
        self.model_ref = model_ref           # what load_shard reads when Configure moves the layer range
        self._state = asyncio.Lock()
        self._busy = asyncio.Lock()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._subscriber: asyncio.Queue | None = None
        self._next_hop = config.next_hop
        self._hop_version = 0                # bumped by Configure: the send loop reconnects
        self._sender: asyncio.Task | None = None
        self._channel: grpc.aio.Channel | None = None
        self._old_channels: list[grpc.aio.Channel] = []     # next hops before a Configure; closed at close()
        self.log = log.bind(stage=config.stage)
        self._peers = config.peer_names      # None with TLS off: no identity checks

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._sender = asyncio.create_task(self._send_loop())
        metrics.watch(self)

    async def close(self) -> None:
        metrics.forget(self)
        if self._sender is not None:
            await self._outbox.put(_END)
            try:
                await asyncio.wait_for(self._sender, timeout=5)
            except asyncio.TimeoutError:
                self._sender.cancel()
        if self._subscriber is not None:
            self._subscriber.put_nowait(_END)
        for channel in [self._channel, *self._old_channels]:
            if channel is not None:
                await channel.close()

    # -- data plane ---------------------------------------------------------------------------------
    async def Forward(self, request_iterator, context):
        policy = self._peers
        await require_peer(context, "Forward", policy)
        count = 0
        async for msg in request_iterator:
            if policy != self._peers:            # Configure moved this stage: is the caller still before it?
                policy = self._peers
                await require_peer(context, "Forward", policy)
            out = await self._process(msg)
            await self._outbox.put(out)
            count += 1
        return stage_pb2.ForwardSummary(batches=count)

    async def _process(self, msg: stage_pb2.MicroBatch) -> stage_pb2.MicroBatch:
        a_ms, b_ms = self.config.stage_time
        async with self._busy:
            started = time.perf_counter()
            try:
                batch = batch_from_proto(msg, self.runner.shard.device)
                async with self._state:
                    out = await asyncio.to_thread(self.runner.step, batch)
            except (CodecError, BatchError) as e:
                self.log.warning("micro-batch rejected", batch_id=msg.batch_id, error=str(e))
                return _rejected(msg, str(e), self.config.stage)
            except Exception as e:   # e.g. out of memory: fail the requests in it, keep the stream and stage
                self.log.error("micro-batch failed", batch_id=msg.batch_id, error=repr(e))
                return _rejected(msg, f"stage failed to compute: {e!r}", self.config.stage,
                                 code=grpc.StatusCode.INTERNAL)
            if a_ms or b_ms:
                rows = out.trace[-1].rows_computed
                remaining = (a_ms + b_ms * rows) / 1e3 - (time.perf_counter() - started)
                if remaining > 0:
                    await asyncio.sleep(remaining)
                out.trace[-1].wait_ms = max(0.0, remaining * 1e3)
            metrics.step(self.config.stage, out.trace[-1], emulated=bool(a_ms or b_ms))
            encoded = await asyncio.to_thread(batch_to_proto, out)
            size, limit = encoded.ByteSize(), self.config.max_message_mb * 1024 * 1024
            if size > limit:      # no hop would take it: its requests fail now, the pipeline goes on
                self.log.warning("micro-batch too large to send", batch_id=msg.batch_id, bytes=size, limit=limit)
                return _rejected(msg, f"stage {self.config.stage}'s output of {batch.rows} rows is {size} bytes, "
                                      f"above the hop limit of {limit} bytes (--max-message-mb); send the prompt "
                                      "in smaller chunks (--prefill-chunk)", self.config.stage,
                                 code=grpc.StatusCode.RESOURCE_EXHAUSTED)
            return encoded

    async def _send_loop(self) -> None:
        """Deliver outputs in order: to the next hop's Forward stream, or to the Results subscriber."""
        call, version = None, self._hop_version
        while True:
            msg = await self._outbox.get()
            self._outbox.task_done()
            if msg is _END:
                break
            if version != self._hop_version:        # Configure changed the next hop
                await _finish_call(call)
                call, version = None, self._hop_version
            if not self._next_hop:
                if self._subscriber is None:
                    self.log.warning("result dropped: no Results subscriber", batch_id=msg.batch_id)
                else:
                    self._subscriber.put_nowait(msg)
                    metrics.SENT_BYTES.labels(str(self.config.stage), "results").inc(msg.ByteSize())
                continue
            for attempt in range(5):
                try:
                    if call is None:
                        call = await self._connect_forward()
                    await call.write(msg)
                    metrics.SENT_BYTES.labels(str(self.config.stage), "next_stage").inc(msg.ByteSize())
                    break
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError,
                        asyncio.TimeoutError) as e:
                    self.log.warning("forward to next hop failed", next_hop=self._next_hop, attempt=attempt,
                                     error=str(e) or type(e).__name__)
                    call = None
                    await asyncio.sleep(0.05 * 2 ** attempt)
            else:
                self.log.error("micro-batch lost: next hop unreachable", batch_id=msg.batch_id,
                               next_hop=self._next_hop)
        await _finish_call(call)

    async def _connect_forward(self):
        """A Forward stream to the next hop, once it reached it (within HOP_CONNECT_S, else TimeoutError). A
        write on a stream that has not reached its peer waits until it does, and is never woken if the hop is
        gone for good (grpcio 1.85: a cancelled call does not wake it): the send loop would hang there, deaf
        to a Configure that names another next hop."""
        if self._channel is None:
            self._channel = open_channel(self._next_hop, self.config.tls,
                                         channel_options(self.config.max_message_mb * 1024 * 1024))
        call = stage_pb2_grpc.StageStub(self._channel).Forward(wait_for_ready=True)
        try:
            await asyncio.wait_for(call.wait_for_connection(), HOP_CONNECT_S)
        except BaseException:
            call.cancel()
            raise
        return call

    async def Results(self, request, context):
        await require_peer(context, "Results", self._peers)
        if self._next_hop:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"stage {self.config.stage} is not the last stage; results come from the last one")
        if self._subscriber is not None:
            self._subscriber.put_nowait(_END)
        queue: asyncio.Queue = asyncio.Queue()
        self._subscriber = queue
        await context.send_initial_metadata(())    # tells the subscriber it is registered
        peer = context.peer()     # read now: the context must not be touched once the server has gone
        self.log.info("results subscriber connected", peer=peer)
        how = "cancelled"
        try:
            while True:
                msg = await queue.get()
                if msg is _END:
                    how = "replaced or stopped"
                    return
                yield msg
        finally:
            if self._subscriber is queue:
                self._subscriber = None
            self.log.info("results subscriber left", peer=peer, how=how)

    # -- control plane ------------------------------------------------------------------------------
    async def Control(self, request_iterator, context):
        await require_peer(context, "Control", self._peers)
        count = 0
        async for msg in request_iterator:
            control = control_from_proto(msg)
            async with self._state:
                try:
                    self.runner.apply(control)
                    metrics.CONTROL.labels(str(self.config.stage), "applied").inc()
                except ProtocolError as e:
                    self.log.warning("control message rejected", request_id=control.request_id, error=str(e))
                    metrics.CONTROL.labels(str(self.config.stage), "rejected").inc()
            count += 1
        return stage_pb2.ControlSummary(messages=count)

    async def Configure(self, request: stage_pb2.ConfigureRequest, context):
        """Take layers [first, last) and place `stage` of `num_stages` with a new next hop. The stage must
        hold no request (the coordinator drains first); new layers are read from the model's files."""
        await require_peer(context, "Configure", self._peers)
        shard = self.runner.shard
        first, last, n, stage = request.first_layer, request.last_layer, request.num_stages, request.stage
        if not (0 <= first < last <= shard.total_layers and 0 <= stage < n):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"layers [{first}, {last}) of {shard.total_layers}, stage {stage} of {n}")
        if (stage == n - 1) != (not request.next_hop) or (last == shard.total_layers) != (stage == n - 1):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "exactly the last stage holds the last layer and has no next hop")
        hop = re.fullmatch(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})", request.next_hop)
        if request.next_hop and not (hop and 0 < int(hop.group(1)) < 65536):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"next hop {request.next_hop!r} is not HOST:PORT")
        async with self._busy:
            async with self._state:
                if self.runner.cache.requests:
                    held = sorted(self.runner.cache.requests)
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"{len(held)} request(s) still hold KV on stage {self.config.stage} "
                                        f"({', '.join(held[:3])}); drain before re-partitioning")
            try:
                await asyncio.wait_for(self._outbox.join(), timeout=30)
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "outputs still queued for the next hop")
            started = time.perf_counter()
            loaded = (first, last) != (shard.first, shard.last)
            if loaded:
                new = await asyncio.to_thread(load_shard, self.model_ref, first, last, shard.dtype, shard.device)
                runner = StageRunner(new, stage, kv_limit_bytes=self.runner.cache.limit_bytes)
            else:
                runner = self.runner
                runner.stage_index = stage
            async with self._state:
                self.runner = runner
                self.config = replace(self.config, stage=stage, num_stages=n, first_layer=first,
                                      last_layer=last, next_hop=request.next_hop)
                self._peers = self.config.peer_names        # with a name per stage: a new predecessor
                if request.next_hop != self._next_hop:
                    self._next_hop = request.next_hop
                    self._hop_version += 1
                    if self._channel is not None:                # the send loop finishes its call on it
                        self._old_channels.append(self._channel)
                        self._channel = None
                if self._next_hop and self._subscriber is not None:
                    self._subscriber.put_nowait(_END)       # no longer the last stage
            if loaded:
                shard = None                        # (the old layers go before the heap is frozen again)
                after_load(replaced=True)
            self.log = log.bind(stage=stage)
            self.log.info("re-partitioned", layers=f"{first}:{last}", num_stages=n,
                          next_hop=request.next_hop or "(last)", seconds=round(time.perf_counter() - started, 2))
        return await self.Info(stage_pb2.InfoRequest(), context)

    async def Info(self, request, context):
        r, shard, cache = self.runner, self.runner.shard, self.runner.cache
        async with self._state:
            info = stage_pb2.StageInfo(
                stage=self.config.stage, num_stages=self.config.num_stages, first_layer=shard.first,
                last_layer=shard.last, num_layers_total=shard.total_layers, model=self.model_name,
                dtype=str(shard.dtype).removeprefix("torch."), device=str(shard.device),
                vocab_size=shard.vocab_size, hidden_size=shard.hidden_size,
                max_position=shard.config.max_position_embeddings, active_requests=len(cache.requests),
                kv_bytes=cache.nbytes(), next_hop=self._next_hop, batches=r.counters.batches,
                rows_computed=r.counters.rows_computed, rows_dropped=r.counters.rows_dropped,
                kv_limit_bytes=cache.limit_bytes, kv_bytes_per_slot=cache.geometry.bytes_per_slot)
            for request_id, kv in cache.requests.items():
                if request.request_id and request_id != request.request_id:
                    continue
                info.requests.add(request_id=request_id, committed=kv.table.committed_count, live=kv.table.live_count,
                                  node_ids=sorted(kv.slot_of), tombstones=len(kv.table.tombstones),
                                  kv_bytes=kv.nbytes())
        return info


async def _finish_call(call) -> None:
    if call is None:
        return
    try:
        await call.done_writing()
        await call
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
        pass


def _rejected(msg: stage_pb2.MicroBatch, error: str, stage: int,
              code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> stage_pb2.MicroBatch:
    """The same micro-batch with every segment turned into an error (no rows, no tensors)."""
    metrics.REJECTED.labels(str(stage), code.name.lower()).inc()
    code = code.value[0]
    out = stage_pb2.MicroBatch(batch_id=msg.batch_id, return_logprobs=msg.return_logprobs)
    out.trace.extend(msg.trace)
    for s in msg.segments:
        f = s if s.error else Segment.failed(s.request_id, error, code, stage)
        out.segments.add(request_id=f.request_id, error=f.error, error_code=f.error_code,
                         error_stage=f.error_stage)
    return out

