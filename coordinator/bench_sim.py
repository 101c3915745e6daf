"""`specpipe bench --simulate`: the same schedulers and real model outputs on a simulated clock
(coordinator/drivers/simulated.py), so S in {2, 4, 8, 16, 32} can be swept in minutes on a small machine.

One in-process runner holds every layer and computes at stage 0; the other stages only take the modelled
time `a + b * rows`. The draft's real compute time is charged to the coordinator.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import replace

import torch

from services.config import parse_dtype, parse_stage_time
from services.model.shard import load_shard
from services.runner import StageRunner

from coordinator.bench import BenchConfig, Variant, load_prompts, summarize
from coordinator.drafts.factory import build_draft
from coordinator.drivers.simulated import SimulatedPipeline
from coordinator.schedulers.base import Request
from coordinator.schedulers.registry import SpecOptions, make_scheduler
from coordinator.service import load_tokenizer
from coordinator.text import PromptEncoder


def run_simulated(cfg: BenchConfig, hop_ms: float = 0.3, log=print) -> dict:
    torch.set_num_threads(max(1, cfg.threads))
    prompts = load_prompts(cfg.prompts, cfg.num_prompts)
    stage_time = parse_stage_time(cfg.stage_time_ms)
    if stage_time == (0.0, 0.0):
        raise ValueError("--simulate needs a stage time model (--stage-time-ms A[+B])")
    runner = StageRunner(load_shard(cfg.model, 0, None, parse_dtype(cfg.dtype), cfg.device), stage_index=0)
    draft = build_draft(cfg.draft, cfg.model, device=cfg.device)
    tokenizer, _ = load_tokenizer(cfg.model)
    encoder = PromptEncoder(tokenizer)
    token_ids = [p.get("prompt_token_ids") or encoder.encode(p["prompt"], chat=not p.get("raw", False))
                 for p in prompts]
    ids = itertools.count()
    rows = []
    for num_stages in cfg.stages:
        runs: dict[Variant, list[dict]] = {v: [] for v in cfg.variants}
        for pi, prompt in enumerate(token_ids):
            for v in cfg.variants:
                spec = replace(SpecOptions(draft), **v.overrides())
                sched = make_scheduler(v.method, num_stages, spec)
                pipe = SimulatedPipeline([runner], stage_time, num_stages=num_stages, hop_ms=hop_ms)
                rid = f"sim{next(ids)}"
                o = pipe.run(sched, [Request(rid, prompt, cfg.max_new_tokens)], draft=draft)[rid]
                stats = dict(o.stats, tbt_ms=o.tbt_ms, ttft_ms=o.ttft_ms, wall_ms=o.end_ms - o.start_ms)
                runs[v].append(stats)
                log(f"  simulated S={num_stages} prompt {pi + 1}/{len(prompts)} {v.label}: tbt {o.tbt_ms:.1f} ms, "
                    f"{stats.get('tokens_per_step', 0):.2f} tok/step")
        for v in cfg.variants:
            row = summarize(v, num_stages, runs[v], stage_time)
            row.update(simulated=True, stage_compute_ms=[], compute_overrun_stages=[])
            rows.append(row)
    return {"config": {"stages": cfg.stages, "variants": [v.label for v in cfg.variants], "simulate": True,
                       "stage_time_ms": cfg.stage_time_ms, "emulated_stage_time": True, "hop_ms": hop_ms,
                       "max_new_tokens": cfg.max_new_tokens, "num_prompts_used": len(prompts), "model": cfg.model,
                       "draft": cfg.draft, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "rows": rows}
