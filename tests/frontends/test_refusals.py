"""What Coordinator.generate answers for each refusal of Engine.submit: Overloaded -> RESOURCE_EXHAUSTED,
Unavailable -> UNAVAILABLE, and any other error is not disguised as either (it propagates as itself)."""
from __future__ import annotations

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.admission import Overloaded
from coordinator.core.status import Status
from coordinator.core.text import PromptEncoder
from coordinator.core.validate import Limits
from coordinator.engine.state import Unavailable
from coordinator.frontends.grpc_api import grpc_code
from coordinator.frontends.metrics import outcome_of
from coordinator.frontends.prework import Prework
from coordinator.frontends.service import Coordinator, GenerateInput, GenerationFailed
from helpers.reference import byte_tokenizer


class RefusingEngine:
    def __init__(self, error: Exception) -> None:
        self.error, self.spec = error, None

    async def submit(self, *args: object, **kw: object) -> None:
        raise self.error


def coordinator(error: Exception) -> Coordinator:
    """A Coordinator around the refusing engine, without a pipeline (only what `generate` reads)."""
    c = Coordinator.__new__(Coordinator)
    c.config, c.engine = CoordinatorConfig(stages=("unused:1",), method="pp"), RefusingEngine(error)
    c.encoder, c.eos_ids, c.limits = PromptEncoder(byte_tokenizer()), frozenset(), Limits(256, 512, 16, 256)
    c.prework = Prework()
    return c


async def first_chunk(c: Coordinator) -> None:
    async for _ in c.generate(GenerateInput(prompt_token_ids=[1, 2], max_new_tokens=4, method="pp")):
        break


@pytest.mark.parametrize("error, status, retryable", [
    (Overloaded("server busy"), Status.RESOURCE_EXHAUSTED, True),
    (Overloaded("never fits", retryable=False), Status.RESOURCE_EXHAUSTED, False),
    (Unavailable("scaled to zero"), Status.UNAVAILABLE, True)])
async def test_refusals_keep_their_status(error: Exception, status: Status, retryable: bool) -> None:
    with pytest.raises(GenerationFailed) as got:
        await first_chunk(coordinator(error))
    assert got.value.code is status and got.value.retryable is retryable and str(got.value) == str(error)
    assert grpc_code(got.value.code).name == status.name and outcome_of(got.value) == status.name.lower()


async def test_another_runtime_error_is_not_reported_as_a_refusal() -> None:
    with pytest.raises(RuntimeError, match="a bug") as got:
        await first_chunk(coordinator(RuntimeError("a bug")))
    assert not isinstance(got.value, GenerationFailed) and outcome_of(got.value) == "internal"
