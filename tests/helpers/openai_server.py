"""Stages, a coordinator and its OpenAI-compatible HTTP API on free ports, and an `openai` client of them
(the fixtures `chat_model` and `api` are in tests/frontends/conftest.py).

    async with serving(chat_model) as (coord, url, stage_addresses):
        r = await client(url).completions.create(model="tiny-chat", prompt=[10, 20], max_tokens=4, **GREEDY)
        text_of(r.choices[0].token_ids) == r.choices[0].text      # the byte tokenizer: one id per byte
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai

from coordinator.config import CoordinatorConfig
from coordinator.frontends.server import start, start_http
from coordinator.frontends.service import Coordinator
from helpers.stage_servers import stage_servers

GREEDY: dict[str, Any] = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})


def text_of(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


@asynccontextmanager
async def serving(model: Path, stage_time_ms: str = "0",
                  **config: Any) -> AsyncIterator[tuple[Coordinator, str, list[str]]]:
    """Stages + coordinator + HTTP API on free ports; yields (coordinator, base URL, stage addresses)."""
    async with stage_servers(str(model), 2, stage_time_ms=stage_time_ms) as (addrs, _):
        cfg = CoordinatorConfig(stages=tuple(addrs), model=str(model), port=0, max_new_tokens_cap=256,
                                default_max_new_tokens=16, **config)
        server, coord = await start(cfg)
        http = await start_http(cfg, coord, port=0)
        try:
            yield coord, f"{http.scheme}://127.0.0.1:{http.port}/v1", addrs
        finally:
            await http.stop()
            await server.stop(0)
            await coord.close()


def client(url: str, key: str = "none", **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=60, **kw)
