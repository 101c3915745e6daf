"""Stop strings and token counts (coordinator/frontends/service.py `_generate`): a chunk of committed ids that holds a
stop string streams only the ids up to the one completing it, and the token metrics and the final stats
count those ids only — so `token_ids`, `return_token_ids` and `usage.completion_tokens` agree.

Unit tests drive `_generate` with a fake engine whose chunks the test chooses: the schedulers of today emit
one id per event (Scheduler._commit is called per token), but an Emit carries a list and nothing promises
one. The end-to-end test checks the OpenAI API's token ids and usage against transformers' greedy decoding
over real stages."""
from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.text import PromptEncoder
from coordinator.core.validate import Limits
from coordinator.core.schedulers.base import Finish
from coordinator.core.stats import RequestStats
from coordinator.engine.live import Tokens
from coordinator.frontends.metrics import RequestMetrics
from coordinator.frontends.prework import Prework
from coordinator.frontends.service import Chunk, Coordinator, GenerateInput
from helpers.openai_server import serving, text_of
from helpers.reference import byte_tokenizer, hf_greedy


class FakeEngine:
    """Hands out one event queue filled with the given chunks of ids, then a finish whose stats count
    every id the scheduler committed (as the engine's do)."""

    def __init__(self, chunks: list[list[int]], reason: str = "stop") -> None:
        self.chunks, self.reason = chunks, reason
        self.cancelled: list[tuple[str, str]] = []
        self.spec = None

    async def submit(self, prompt_ids: list[int], max_new_tokens: int, method: str, eos: frozenset[int],
                     **kw: object) -> tuple[str, asyncio.Queue]:
        q: asyncio.Queue = asyncio.Queue()
        for c in self.chunks:
            q.put_nowait(Tokens(c))
        total = sum(len(c) for c in self.chunks)
        q.put_nowait(Finish("r1", self.reason, RequestStats(tokens=total, steps=4)))
        return "r1", q

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self.cancelled.append((request_id, reason))


def coordinator(engine: FakeEngine) -> Coordinator:
    """A Coordinator around the fake engine, without a pipeline (only what `_generate` reads)."""
    c = Coordinator.__new__(Coordinator)
    c.config, c.engine = CoordinatorConfig(stages=("unused:1",), method="pp"), engine
    c.encoder = PromptEncoder(byte_tokenizer())
    c.eos_ids = frozenset()
    c.limits = Limits(256, 512, 16, 256)
    c.prework = Prework()
    return c


async def run(chunks: list[list[int]], stop: list[str]) -> tuple[list[Chunk], RequestMetrics, FakeEngine]:
    engine = FakeEngine(chunks)
    metrics = RequestMetrics("pp")
    inp = GenerateInput(prompt_token_ids=[1, 2, 3], max_new_tokens=64, stop=stop, method="pp")
    out = [c async for c in coordinator(engine)._generate(inp, metrics)]
    return out, metrics, engine


def ids(s: str) -> list[int]:
    return list(s.encode())


async def test_stop_in_the_middle_of_a_chunk_ends_its_token_ids() -> None:
    out, metrics, engine = await run([ids("Hello "), ids("wor<END>ld and more"), ids("never seen")], ["<END>"])
    assert [c.token_ids for c in out] == [ids("Hello "), ids("wor<END>"), []]
    assert "".join(c.text for c in out) == "Hello wor"
    assert out[-1].finish_reason == "stop"
    n = len(ids("Hello wor<END>"))
    assert out[-1].stats.tokens == n == metrics.streamed == sum(len(c.token_ids) for c in out)
    assert out[-1].stats.prompt_tokens == 3
    assert engine.cancelled == [("r1", "stop")]


async def test_stop_completed_by_the_first_id_of_a_chunk() -> None:
    out, metrics, _ = await run([ids("ab <E"), ids("ND> tail")], ["<END>"])
    assert [c.token_ids for c in out] == [ids("ab <E"), ids("ND>"), []]
    assert "".join(c.text for c in out) == "ab " and out[-1].stats.tokens == 8 == metrics.streamed


async def test_stop_inside_a_multibyte_character_keeps_its_last_byte() -> None:
    euro = list("€".encode())                       # 3 bytes: the stop completes with the 3rd
    out, _, _ = await run([ids("x") + euro + ids("yz")], ["€"])
    assert out[0].token_ids == ids("x") + euro and out[0].text == "x"


async def test_without_a_stop_string_every_id_is_streamed_and_the_engine_count_stays() -> None:
    engine = FakeEngine([ids("abc"), ids("de")], reason="length")
    metrics = RequestMetrics("pp")
    inp = GenerateInput(prompt_token_ids=[1], max_new_tokens=5, stop=["zz"], method="pp")
    out = [c async for c in coordinator(engine)._generate(inp, metrics)]
    assert [c.token_ids for c in out] == [ids("abc"), ids("de"), []]
    assert out[-1].finish_reason == "length" and out[-1].stats.tokens == 5 == metrics.streamed


# -- end to end: OpenAI token ids and usage over real stages ----------------------------------------------
def first_stop(want: list[int], stop: str) -> int:
    """Ids a one-at-a-time generation keeps: up to the first whose text completes the stop string."""
    return next(k for k in range(1, len(want) + 1) if stop in text_of(want[:k]))


@pytest.mark.grpc
async def test_openai_usage_and_token_ids_end_at_the_stop(chat_model: Path, tiny_hf) -> None:
    prompt = [10, 20, 30, 40]
    want = hf_greedy(tiny_hf, prompt, 40)
    full = text_of(want)
    start = next(i for i in range(12, 30) if "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]
    k = first_stop(want, stop)
    async with serving(chat_model) as (_, url, _):
        c = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        try:
            body = {"ignore_eos": True, "return_token_ids": True}
            r = await c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=40, stop=[stop],
                                           temperature=0, extra_body=body)
            assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
            assert r.choices[0].token_ids == want[:k]
            assert r.usage.completion_tokens == k
            stream = await c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=40, stop=[stop],
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body=body)
            events = [e async for e in stream]
            chunks = [e.choices[0].token_ids for e in events if e.choices and e.choices[0].token_ids]
            assert [t for ch in chunks for t in ch] == want[:k]
            assert events[-1].usage.completion_tokens == k
        finally:
            await c.close()
