"""Fixtures of the front-end tests: the OpenAI API serving the tiny model with a chat tokenizer."""
from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from coordinator.frontends.service import Coordinator
from helpers.openai_server import client, serving


@pytest.fixture
async def openai_api(chat_model: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI, Coordinator]]:
    """An `openai` client of the HTTP API over 2 stages serving `chat_model`, and the coordinator."""
    async with serving(chat_model) as (coord, url, _):
        c = client(url)
        try:
            yield c, coord
        finally:
            await c.close()
