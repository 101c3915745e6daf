"""Fixtures of the front-end tests: the tiny model with a chat tokenizer, and the OpenAI API serving it."""
from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from coordinator.frontends.service import Coordinator
from helpers.openai_server import client, serving
from helpers.reference import byte_tokenizer


@pytest.fixture(scope="module")
def chat_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (same weights, so tiny_hf is its reference) plus the byte tokenizer."""
    path = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_model, path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
async def openai_api(chat_model: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI, Coordinator]]:
    """An `openai` client of the HTTP API over 2 stages serving `chat_model`, and the coordinator."""
    async with serving(chat_model) as (coord, url, _):
        c = client(url)
        try:
            yield c, coord
        finally:
            await c.close()
