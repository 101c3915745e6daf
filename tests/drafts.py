"""Draft sources for tests: one that is always right (the target itself) and one that is always wrong."""
from __future__ import annotations

import torch

from coordinator.core.drafts.base import DraftNode, Proposals
from coordinator.core.drafts.model import ModelDraft
from services.model.shard import load_causal_lm


def always_right(model_path) -> ModelDraft:
    return ModelDraft(load_causal_lm(str(model_path), torch.float32, "cpu"), name="target")


class AlwaysWrong(ModelDraft):
    """The target as draft, minus its top choice: every proposal misses the target's greedy token."""

    def __init__(self, model_path) -> None:
        super().__init__(load_causal_lm(str(model_path), torch.float32, "cpu"), name="wrong")

    def expand_many(self, jobs: list[tuple[str, list[DraftNode]]], k: int) -> list[Proposals | Exception]:
        return [r if isinstance(r, Exception) else [props[1:] for props in r]
                for r in super().expand_many(jobs, k + 1)]
