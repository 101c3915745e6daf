"""Draft sources for tests: one that is always right (the target itself), one that is always wrong, and
each kind by name.

    draft = make_draft("quant", tiny_model8, tiny_draft_model)     # quant | ngram | model | right | wrong
"""
from __future__ import annotations

import torch

from coordinator.core.drafts.base import DraftNode, DraftSource, Proposals
from coordinator.core.drafts.model import ModelDraft, check_same_tokenizer, quantized_copy
from coordinator.core.drafts.ngram import NgramDraft
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


class Reversed(ModelDraft):
    """The target's int8 copy with each node's proposals in reverse order: its likeliest last, so the target's
    token sits at the last ranks of any topk (what the cost rule's coverage must not cut)."""

    def __init__(self, model_path) -> None:
        super().__init__(quantized_copy(str(model_path)), name="reversed")

    def expand_many(self, jobs: list[tuple[str, list[DraftNode]]], k: int) -> list[Proposals | Exception]:
        return [r if isinstance(r, Exception) else [props[::-1] for props in r]
                for r in super().expand_many(jobs, k)]


def make_draft(kind: str, target, draft_model) -> DraftSource:
    """A draft for `target`: `quant` (its int8 copy), `ngram`, `model` (the separate `draft_model`),
    `right` (the target itself) or `wrong` (the target minus its top choice)."""
    if kind == "quant":
        return ModelDraft(quantized_copy(str(target)), name="quant")
    if kind == "ngram":
        return NgramDraft()
    if kind == "model":
        check_same_tokenizer(str(target), str(draft_model))
        return ModelDraft(load_causal_lm(str(draft_model), torch.float32, "cpu"))
    if kind == "right":
        return always_right(target)
    return AlwaysWrong(target)
