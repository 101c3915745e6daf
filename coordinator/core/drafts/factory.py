"""Build the configured draft source: quant | quant+ngram | model | ngram | none."""
from __future__ import annotations

from services.config import parse_dtype
from services.model.loader import resolve_model, stderr_log
from services.model.shard import load_causal_lm

from coordinator.core.drafts.base import DraftSource
from coordinator.core.drafts.combined import CombinedDraft
from coordinator.core.drafts.model import ModelDraft, check_same_tokenizer, quantized_copy
from coordinator.core.drafts.ngram import NgramDraft
from coordinator.core.vocabulary import DRAFTS, DraftKind



def build_draft(kind: str, target: str, draft_model: str = "", device: str = "cpu",
                dtype: str = "auto") -> DraftSource | None:
    """dtype of a separate draft model: `auto` is bfloat16 on CUDA, float32 elsewhere."""
    if kind not in DRAFTS:
        raise ValueError(f"unknown draft {kind!r}; choose from {', '.join(DRAFTS)}")
    if kind == DraftKind.NONE:
        return None
    if kind == DraftKind.NGRAM:
        return NgramDraft()
    target_ref = resolve_model(target, log=stderr_log)
    if kind == DraftKind.QUANT:
        return ModelDraft(quantized_copy(target_ref, device), name="quant")
    if kind == DraftKind.QUANT_NGRAM:
        return CombinedDraft(ModelDraft(quantized_copy(target_ref, device), name="quant"), NgramDraft())
    if not draft_model:
        raise ValueError("--draft model needs --draft-model PATH (a Hugging Face folder)")
    draft_ref = resolve_model(draft_model, log=stderr_log)
    check_same_tokenizer(target_ref, draft_ref)
    if dtype == "auto":
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    return ModelDraft(load_causal_lm(draft_ref, parse_dtype(dtype), device), name="model")

