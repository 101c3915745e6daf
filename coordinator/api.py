"""The public gRPC API: specpipe.v1.Generation/Generate. Translates proto <-> Coordinator only."""
from __future__ import annotations

import uuid

import grpc
import structlog

from protos import generation_pb2, generation_pb2_grpc
from services.logs import get_logger

from coordinator.requests import InvalidRequest
from coordinator.service import Chunk, Coordinator, GenerateInput, GenerationFailed

log = get_logger(__name__)
STATS_FIELDS = {"steps", "tokens_per_step", "tbt_ms", "ttft_ms", "prompt_tokens", "wall_ms"}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    async def Generate(self, request: generation_pb2.GenerateRequest, context):
        rid = uuid.uuid4().hex[:16]
        structlog.contextvars.bind_contextvars(request_id=rid)     # this RPC's task only
        inp = GenerateInput(
            prompt=request.prompt, prompt_token_ids=list(request.prompt_token_ids), raw=request.raw,
            max_new_tokens=request.max_new_tokens if request.HasField("max_new_tokens") else None,
            method=request.method, temperature=request.temperature, top_p=request.top_p or 1.0,
            top_k=request.top_k, seed=request.seed, stop=list(request.stop), ignore_eos=request.ignore_eos,
            request_id=rid)
        try:
            async for chunk in self.coordinator.generate(inp):
                yield to_proto(chunk)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except GenerationFailed as e:
            code = next((c for c in grpc.StatusCode if c.value[0] == e.code), grpc.StatusCode.INTERNAL)
            # refusals under overload are expected and counted (specpipe_requests_total): not a warning each
            level = log.debug if code == grpc.StatusCode.RESOURCE_EXHAUSTED else log.warning
            level("generation failed", error=str(e), code=code.name)
            await context.abort(code, str(e))


def to_proto(chunk: Chunk) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text,
                                          finish_reason=chunk.finish_reason, request_id=chunk.request_id)
    if chunk.stats is not None:
        s = chunk.stats
        msg.stats.steps = int(s.get("steps", 0))
        msg.stats.tokens_per_step = s.get("tokens_per_step", 0.0)
        msg.stats.tbt_ms = s.get("tbt_ms", 0.0)
        msg.stats.ttft_ms = s.get("ttft_ms", 0.0)
        msg.stats.wall_ms = s.get("wall_ms", 0.0)
        msg.stats.prompt_tokens = int(s.get("prompt_tokens", 0))
        msg.stats.completion_tokens = int(s.get("tokens", 0))
        for k, v in s.items():
            if k not in STATS_FIELDS and k != "tokens":
                msg.stats.counters[k] = float(v)
    return msg
