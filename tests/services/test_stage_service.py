"""The stage service over real gRPC: malformed input is refused per request, the stage stays up."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from helpers.pipe import Pipe, prefill
from helpers.stage_servers import stage_servers
from protos import common_pb2, stage_pb2, stage_pb2_grpc
from common.batch import Control, MicroBatch, Segment
from common.wire import batch_to_proto, control_to_proto

pytestmark = pytest.mark.grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.mark.smoke
async def test_info_health_and_a_good_batch(tiny_model):
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        async with Pipe(addrs) as pipe:
            info = await pipe.stubs[1].Info(stage_pb2.InfoRequest())
            assert (info.first_layer, info.last_layer, info.num_layers_total) == (2, 4, 4)
            out = await pipe.send(prefill("ok", [5, 6, 7]))
            assert len(out.argmax) == 1 and not out.segments[0].error
            assert [t.stage for t in out.trace] == [0, 1]


async def test_malformed_input_gets_invalid_argument_and_stage_stays_up(tiny_model):
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        async with Pipe(addrs) as pipe:
            # unknown parent
            bad = batch_to_proto(MicroBatch(2, [Segment("a", [3], [99], [1], [5], [True])]))
            out = await pipe.send(bad)
            assert out.segments[0].error_code == INVALID and "unknown parent 99" in out.segments[0].error
            # token id outside the vocabulary
            out = await pipe.send(prefill("b", [5, 100000]))
            assert out.segments[0].error_code == INVALID and "vocabulary" in out.segments[0].error
            # fields of different lengths
            bad = stage_pb2.MicroBatch(batch_id=3)
            bad.segments.add(request_id="c", node_ids=[0, 1], parent_ids=[-1], positions=[0, 1],
                             token_ids=[5, 6], want_output=[True, True])
            out = await pipe.send(bad)
            assert out.segments[0].error_code == INVALID
            # hidden states of the wrong dtype, wrong shape, and undecodable bytes, straight into stage 1
            seg = Segment("d", [0], [-1], [0], [5], [True])
            for hidden in (torch.zeros(1, 64, dtype=torch.float16), torch.zeros(2, 64), torch.zeros(1, 63)):
                out = await pipe.send(batch_to_proto(MicroBatch(4, [seg], hidden=hidden)), stage=1)
                assert out.segments[0].error_code == INVALID, hidden.shape
            msg = batch_to_proto(MicroBatch(5, [seg]))
            msg.hidden.CopyFrom(common_pb2.Tensor(dtype="float32", shape=[1, 64], data=b"\x00" * 7))
            out = await pipe.send(msg, stage=1)
            assert out.segments[0].error_code == INVALID and "bytes" in out.segments[0].error
            msg.hidden.CopyFrom(common_pb2.Tensor(dtype="complex999", shape=[1], data=b""))
            out = await pipe.send(msg, stage=1)
            assert "dtype" in out.segments[0].error
            # still serving, and no state left for the rejected requests
            out = await pipe.send(prefill("fine", [5, 6]))
            assert len(out.argmax) == 1
            info = await pipe.stubs[0].Info(stage_pb2.InfoRequest())
            assert {r.request_id for r in info.requests} == {"fine"}


async def test_prune_frees_kv_and_drops_rows_not_yet_computed(tiny_model):
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        async with Pipe(addrs) as pipe:
            await pipe.control(Control("t", commit=[0, 1, 2]))
            await pipe.send(prefill("t", [5, 6, 7]))
            tree = Segment("t", [3, 4], [2, 2], [3, 3], [8, 9], [True, True])
            await pipe.send(batch_to_proto(MicroBatch(2, [tree])))
            # prune node 3 before its child 5 arrives: 5 is dropped at stage 0, never computed
            await pipe.control(Control("t", prune=[3]))
            out = await pipe.send(batch_to_proto(MicroBatch(3, [Segment("t", [5, 6], [3, 4], [4, 4], [1, 1],
                                                                             [True, True])])))
            assert list(out.segments[0].node_ids) == [6] and len(out.argmax) == 1
            assert out.trace[0].rows_in == 2 and out.trace[0].rows_computed == 1
            for stub in pipe.stubs:
                info = await stub.Info(stage_pb2.InfoRequest(request_id="t"))
                assert sorted(info.requests[0].node_ids) == [0, 1, 2, 4, 6]
            await pipe.control(Control("t", release=True))
            for stub in pipe.stubs:
                info = await stub.Info(stage_pb2.InfoRequest())
                assert info.active_requests == 0 and info.kv_bytes == 0


async def test_results_only_on_the_last_stage(tiny_model):
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        async with grpc.aio.insecure_channel(addrs[0]) as ch:
            call = stage_pb2_grpc.StageStub(ch).Results(stage_pb2.ResultsRequest())
            try:
                await call.read()
                raise AssertionError("expected FAILED_PRECONDITION")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION



async def test_after_a_miss_stages_hold_only_committed_and_live_nodes(tiny_model):
    """A coordinator-style miss: the target's token (bonus 7) is committed before its row exists and
    everything in flight below the old root is pruned. Info on every stage then shows only the committed
    chain; once the bonus row and its children arrive, those are all that is held besides it."""
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        async with Pipe(addrs) as pipe:
            await pipe.control(Control("m", commit=[0, 1, 2]))
            await pipe.send(prefill("m", [5, 6, 7]))
            layer1 = Segment("m", [3, 4], [2, 2], [3, 3], [8, 9], [True, True])
            layer2 = Segment("m", [5, 6], [3, 4], [4, 4], [10, 11], [True, True])
            await pipe.send(batch_to_proto(MicroBatch(2, [layer1])))
            await pipe.send(batch_to_proto(MicroBatch(3, [layer2])))
            await pipe.control(Control("m", commit=[7], prune=[3, 4, 5, 6]))     # miss: bonus 7
            for stub in pipe.stubs:
                r = (await stub.Info(stage_pb2.InfoRequest(request_id="m"))).requests[0]
                assert sorted(r.node_ids) == [0, 1, 2] and r.committed == 3 and r.live == 0
            late = Segment("m", [8], [5], [5], [12], [True])                      # child of a pruned node
            out = await pipe.send(batch_to_proto(MicroBatch(4, [late])))
            assert list(out.segments[0].node_ids) == [] and out.trace[0].rows_computed == 0
            restart = Segment("m", [7, 9], [2, 7], [3, 4], [13, 14], [True, True])  # bonus + first child
            await pipe.send(batch_to_proto(MicroBatch(5, [restart])))
            for stub in pipe.stubs:
                r = (await stub.Info(stage_pb2.InfoRequest(request_id="m"))).requests[0]
                assert sorted(r.node_ids) == [0, 1, 2, 7, 9] and r.committed == 4 and r.live == 1


async def test_a_compute_failure_fails_only_that_micro_batch_with_internal(tiny_model, monkeypatch):
    async with stage_servers(str(tiny_model), 2) as (addrs, servicers):
        async with Pipe(addrs) as pipe:
            real_step = servicers[1].runner.step

            def failing_step(batch):
                raise RuntimeError("CUDA out of memory (simulated)")

            monkeypatch.setattr(servicers[1].runner, "step", failing_step)
            out = await pipe.send(prefill("oom", [5, 6, 7]))
            seg = out.segments[0]
            assert seg.error_code == grpc.StatusCode.INTERNAL.value[0] and seg.error_stage == 1
            assert "out of memory" in seg.error
            monkeypatch.setattr(servicers[1].runner, "step", real_step)
            out = await pipe.send(prefill("after", [5, 6, 7]))          # the same streams keep working
            assert len(out.argmax) == 1 and not out.segments[0].error


async def test_a_next_hop_that_never_answers_does_not_stall_the_stage(tiny_model, monkeypatch):
    """Configure named a next hop that is gone for good (a pod removed): the stage retries its outputs for a
    bounded time, and once Configure names a next hop that answers, what it computes next arrives there. Before,
    the send loop waited for ever on its first write to the dead hop, deaf to the Configure."""
    from coordinator.engine.local import free_port
    monkeypatch.setattr("services.servicer.HOP_CONNECT_S", 0.2)
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        async with Pipe(addrs) as pipe:
            async def configure(next_hop: str) -> None:
                info = await pipe.stubs[0].Info(stage_pb2.InfoRequest(), timeout=10)
                await pipe.stubs[0].Configure(stage_pb2.ConfigureRequest(
                    stage=0, num_stages=2, first_layer=info.first_layer, last_layer=info.last_layer,
                    next_hop=next_hop), timeout=30)

            await configure(f"127.0.0.1:{free_port()}")             # nothing listens there
            call = pipe.stubs[0].Forward()
            await call.write(prefill("stranded", [5, 6, 7]))
            await call.done_writing()
            await call
            # released on stage 0 only (then Configure may run there): stage 1 would refuse the stranded batch
            release = pipe.stubs[0].Control()
            await release.write(control_to_proto(Control("stranded", release=True)))
            await release.done_writing()
            await release
            await configure(addrs[1])
            call = pipe.stubs[0].Forward()
            await call.write(prefill("after", [8, 9]))
            await call.done_writing()
            await call
            seen = []
            while "after" not in seen:               # "stranded" may come first: retried once the hop answers
                out = await asyncio.wait_for(pipe.results.read(), timeout=20)
                seen += [s.request_id for s in out.segments]
                assert not any(s.error for s in out.segments)
            assert set(seen) <= {"stranded", "after"}
