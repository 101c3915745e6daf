"""`specpipe bench --hf-reference`: transformers' own `generate` and assisted `generate(assistant_model=...)`
with the same model, draft and prompts, in this process, timed token by token like our methods.

These rows are the external yardstick for S=1 `sps` and `tree`: one process, no gRPC, no pipeline.
"""
from __future__ import annotations

import time

import torch

from coordinator.bench.common import Variant, percentile


class _Clock:
    """A transformers streamer that records when each generated token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:          # the first put is the prompt
            self._prompt_seen = True
            return
        self.times.extend([time.perf_counter()] * int(value.numel()))

    def end(self) -> None:
        pass


def hf_rows(model_ref: str, draft_kind: str, prompts: list[dict], max_new_tokens: int, device: str = "cpu",
            threads: int = 1) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coordinator.core.drafts.model import quantized_copy
    from coordinator.core.text import PromptEncoder

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_ref)
    target = AutoModelForCausalLM.from_pretrained(model_ref, dtype=torch.float32).to(device).eval()
    variants: list[tuple[Variant, object | None]] = [(Variant("hf-generate"), None)]
    if draft_kind in ("quant", "quant+ngram"):
        variants.append((Variant("hf-assisted"), quantized_copy(model_ref, device)))
    encoder = PromptEncoder(tok)
    runs: dict[str, list[dict]] = {v.label: [] for v, _ in variants}
    for prompt in prompts:
        ids = prompt.get("prompt_token_ids") or encoder.encode(prompt["prompt"], chat=not prompt.get("raw", False))
        x = torch.tensor([ids], device=device)
        for v, assistant in variants:
            clock = _Clock()
            started = time.perf_counter()
            with torch.no_grad():
                target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, do_sample=False, streamer=clock,
                                assistant_model=assistant, pad_token_id=tok.eos_token_id)
            t = clock.times
            runs[v.label].append({"tokens": len(t), "wall_ms": (time.perf_counter() - started) * 1e3,
                                  "ttft_ms": (t[0] - started) * 1e3 if t else 0.0,
                                  "tbt_ms": (t[-1] - t[0]) * 1e3 / (len(t) - 1) if len(t) > 1 else 0.0})
    rows = []
    for v, _ in variants:
        rs = runs[v.label]
        tbts = [r["tbt_ms"] for r in rs]
        tokens = sum(r["tokens"] for r in rs)
        wall = sum(r["wall_ms"] for r in rs) / 1e3
        rows.append({"method": v.method, "label": v.label, "width": None, "tree_policy": None, "stages": 1,
                     "concurrency": 1, "requests": len(rs), "tbt_ms_mean": sum(tbts) / len(tbts),
                     "tbt_ms_p50": percentile(tbts, 0.5), "tbt_ms_p90": percentile(tbts, 0.9),
                     "ttft_ms_mean": sum(r["ttft_ms"] for r in rs) / len(rs), "tokens_per_step": None,
                     "hit_rate": None, "throughput_tok_s": tokens / wall if wall else 0.0, "steps": None,
                     "tokens": tokens, "wall_s": wall, "draft_share": 0.0, "stage_compute_ms": [],
                     "emulated_stage_ms": 0.0, "compute_overrun_stages": [], "reference": True})
    return rows
