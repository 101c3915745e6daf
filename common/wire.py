"""Proto <-> core dataclass translation for the stage protocol (no gRPC, no algorithm)."""
from __future__ import annotations

import torch

from protos import common_pb2, stage_pb2
from common.batch import Control, MicroBatch, Segment, StageTrace
from common.codec import decode_tensor, encode_tensor
from common.sampling import Sampling


def tensor_to_proto(t: torch.Tensor, into: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    """`t` as a Tensor message, filled in place when `into` (a message's field) is given: the tensor's bytes
    are copied once into the message, not again by a CopyFrom."""
    msg = common_pb2.Tensor() if into is None else into
    msg.dtype, shape, msg.data = encode_tensor(t)
    msg.shape.extend(shape)
    return msg


def tensor_from_proto(msg: common_pb2.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    return decode_tensor(msg.dtype, list(msg.shape), msg.data, device)


def batch_to_proto(b: MicroBatch) -> stage_pb2.MicroBatch:
    msg = stage_pb2.MicroBatch(batch_id=b.batch_id, argmax=b.argmax, return_logprobs=b.return_logprobs)
    for s in b.segments:
        msg.segments.add(request_id=s.request_id, node_ids=s.node_ids, parent_ids=s.parent_ids,
                         positions=s.positions, token_ids=s.token_ids, want_output=s.want_output,
                         error=s.error, error_code=s.error_code, error_stage=s.error_stage,
                         temperature=s.sampling.temperature, top_p=s.sampling.top_p, top_k=s.sampling.top_k,
                         seed=s.sampling.seed)
    if b.hidden is not None:
        tensor_to_proto(b.hidden, into=msg.hidden)
    if b.logprobs is not None:
        tensor_to_proto(b.logprobs, into=msg.logprobs)
    for t in b.trace:
        msg.trace.add(stage=t.stage, rows_in=t.rows_in, rows_computed=t.rows_computed,
                      compute_ms=t.compute_ms, wait_ms=t.wait_ms)
    return msg


def batch_from_proto(msg: stage_pb2.MicroBatch, device: torch.device | str = "cpu") -> MicroBatch:
    """Raises common.codec.CodecError for undecodable tensors."""
    segments = [Segment(s.request_id, list(s.node_ids), list(s.parent_ids), list(s.positions),
                        list(s.token_ids), list(s.want_output), s.error, s.error_code, s.error_stage,
                        Sampling(s.temperature, s.top_p or 1.0, s.top_k, s.seed))
                for s in msg.segments]
    hidden = tensor_from_proto(msg.hidden, device) if msg.HasField("hidden") else None
    logprobs = tensor_from_proto(msg.logprobs) if msg.HasField("logprobs") else None
    trace = [StageTrace(t.stage, t.rows_in, t.rows_computed, t.compute_ms, t.wait_ms) for t in msg.trace]
    return MicroBatch(msg.batch_id, segments, hidden, list(msg.argmax), logprobs, msg.return_logprobs, trace)


def control_to_proto(c: Control) -> stage_pb2.ControlMessage:
    return stage_pb2.ControlMessage(request_id=c.request_id, commit=c.commit, prune=c.prune, release=c.release)


def control_from_proto(msg: stage_pb2.ControlMessage) -> Control:
    return Control(msg.request_id, list(msg.commit), list(msg.prune), msg.release)
