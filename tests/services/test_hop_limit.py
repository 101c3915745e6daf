"""A stage whose output no hop would take fails that micro-batch's requests with RESOURCE_EXHAUSTED and goes
on: before, its send loop dropped the batch after 5 tries and the watchdog recovered the whole pipeline."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from helpers.reference import hf_greedy
from helpers.stage_servers import served_coordinator
from protos import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.grpc


async def collect(stub, prompt: list[int], n: int) -> tuple[list[int], object]:
    tokens, last = [], None
    async for m in stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n,
                                                                ignore_eos=True), timeout=60):
        tokens += m.token_ids
        last = m
    return tokens, last


async def test_a_micro_batch_too_large_for_the_hop_fails_its_request_not_the_pipeline(tiny_model, tiny_hf):
    async with served_coordinator(str(tiny_model), 2, method="pp", max_new_tokens_cap=64, default_max_new_tokens=8) as s:
        first = s.servicers[0]
        first.config = replace(first.config, max_message_mb=0.01)     # ~10 KiB: a long prompt's output is more
        stub = generation_pb2_grpc.GenerationStub(s.channel)
        long_prompt = list(range(3, 203))                              # 200 rows of hidden states
        short = [5, 6, 7]
        big, small = await asyncio.gather(collect(stub, long_prompt, 4), collect(stub, short, 6),
                                          return_exceptions=True)
        assert isinstance(big, grpc.aio.AioRpcError) and big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "above the hop limit" in big.details() and "--prefill-chunk" in big.details()
        tokens, last = small
        assert tokens == hf_greedy(tiny_hf, short, 6)
        assert last.stats.counters.get("recoveries", 0.0) == 0, "the pipeline was not recovered"
        tokens, _ = await collect(stub, [9, 10, 11, 12], 5)            # and it still serves
        assert tokens == hf_greedy(tiny_hf, [9, 10, 11, 12], 5)
