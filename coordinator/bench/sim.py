"""`specpipe bench --simulate`: the same schedulers and real model outputs on a simulated clock
(coordinator/engine/loops/simulated.py), so S in {2, 4, 8, 16, 32} can be swept in minutes on a small machine.

One in-process runner holds every layer and computes at stage 0; the other stages only take the modelled
time `a + b * rows`. The draft's work is charged to the coordinator by the draft-time model
(`--draft-time-ms`, services/config.py parse_draft_time): by default each draft model call costs
0.3 x the stage-time model (0.3a ms + 0.3b ms per row), or its measured CPU time with `measured`. The
modelled stage time does not depend on the draft's work, and specpipe's cost rule is told so
(`stage_hardware=apart`: it tries none only where its own model favours none).
"""
from __future__ import annotations

import copy
import itertools
import time
from dataclasses import replace

import torch

from common.process import after_load
from services.config import describe_draft_time, parse_draft_time, parse_dtype, parse_stage_time
from services.model.shard import load_shard
from services.runner import StageRunner

from coordinator.bench.common import BenchConfig, Variant, load_prompts, poisson_arrivals, summarize
from coordinator.core.drafts.factory import build_draft
from coordinator.engine.meter import StepMeter
from coordinator.engine.loops.simulated import SimulatedPipeline, replayable
from coordinator.core.schedulers.base import Request
from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
from coordinator.frontends.service import load_tokenizer
from coordinator.core.text import PromptEncoder
from coordinator.core.vocabulary import StageHardware


def run_simulated(cfg: BenchConfig, log=print) -> dict:
    torch.set_num_threads(max(1, cfg.threads))
    prompts = load_prompts(cfg.prompts, cfg.num_prompts)
    stage_time = parse_stage_time(cfg.stage_time_ms)
    if stage_time == (0.0, 0.0):
        raise ValueError("--simulate needs a stage time model (--stage-time-ms A[+B])")
    draft_time = parse_draft_time(cfg.draft_time_ms, stage_time)
    runner = StageRunner(load_shard(cfg.model, 0, None, parse_dtype(cfg.dtype), cfg.device), stage_index=0)
    draft = build_draft(cfg.draft, cfg.model, device=cfg.device)
    tokenizer, _ = load_tokenizer(cfg.model)
    encoder = PromptEncoder(tokenizer)
    after_load()              # as a service does (common/process.py): no full collection walks the models' heap
    token_ids = [p.get("prompt_token_ids") or encoder.encode(p["prompt"], chat=not p.get("raw", False))
                 for p in prompts]
    ids = itertools.count()
    rows = []
    for num_stages in cfg.stages:
        if cfg.load:
            rows += _levels(cfg, num_stages, runner, draft, token_ids, stage_time, draft_time, log)
            continue
        runs: dict[Variant, list[dict]] = {v: [] for v in cfg.variants}
        meters = {v: StepMeter() for v in cfg.variants}
        warm = {v: StepMeter() for v in cfg.variants}      # the same calls replayed with no model compute
        sizers: dict[Variant, object] = {}       # specpipe's cost rule and calibration live on across prompts,
        calibrations: dict[Variant, object] = {}     # as in the engine
        for pi, prompt in enumerate(token_ids):
            for v in cfg.variants:
                spec = replace(SpecOptions(draft), stage_hardware=StageHardware.APART, **v.overrides())
                sched = make_scheduler(v.method, num_stages, spec, sizers.get(v), calibrations.get(v))
                sizers[v] = getattr(sched, "sizer", None)
                calibrations[v] = getattr(sched, "calibration", None)
                twin = _twin(sched, draft, cfg.control_scale)
                pipe = SimulatedPipeline([runner], stage_time, num_stages=num_stages, hop_ms=cfg.hop_ms,
                                         draft_time=draft_time, control_scale=cfg.control_scale,
                                         record=twin is not None)
                request_id = f"sim{next(ids)}"
                calls, drows = (draft.calls, draft.rows) if draft is not None else (0, 0)
                o = pipe.run(sched, [Request(request_id, prompt, cfg.max_new_tokens)], draft=draft)[request_id]
                stats = dict(o.stats.as_dict(), tbt_ms=o.tbt_ms, ttft_ms=o.ttft_ms, wall_ms=o.end_ms - o.start_ms,
                             draft_ms=pipe.draft_ms, control_ms=pipe.control_ms)   # charged on the simulated clock
                meters[v].extend(pipe.steps)
                if twin is not None:
                    warm[v].extend(pipe.replay(twin))
                if draft is not None:
                    stats.update(draft_calls=draft.calls - calls, draft_rows=draft.rows - drows)
                runs[v].append(stats)
                log(f"  simulated S={num_stages} prompt {pi + 1}/{len(prompts)} {v.label}: tbt {o.tbt_ms:.1f} ms, "
                    f"{stats.get('tokens_per_step', 0):.2f} tok/step")
        for v in cfg.variants:
            row = summarize(v, num_stages, runs[v], stage_time)
            steps = sum(r["steps"] for r in runs[v])
            row.update(simulated=True, stage_compute_ms=[], compute_overrun_stages=[], compute_ms_per_step=None,
                       machine_bound=False,
                       draft_calls_per_step=sum(r.get("draft_calls", 0) for r in runs[v]) / steps if steps else 0.0,
                       draft_rows_per_step=sum(r.get("draft_rows", 0) for r in runs[v]) / steps if steps else 0.0,
                       **meters[v].summary(), **_warm(warm[v]))
            rows.append(row)
    return {"config": {"stages": cfg.stages, "variants": [v.label for v in cfg.variants], "simulate": True,
                       "stage_time_ms": cfg.stage_time_ms, "emulated_stage_time": True, "hop_ms": cfg.hop_ms,
                       "control_time": cfg.control_time, "repeats": cfg.repeats,
                       "max_new_tokens": cfg.max_new_tokens, "num_prompts_used": len(prompts), "model": cfg.model,
                       "draft": cfg.draft,
                       "draft_time_ms": {"measured_scale": draft_time[1]} if draft_time[0] == "measured" else
                       {"per_call_ms": draft_time[0], "per_row_ms": draft_time[1]},
                       "draft_time_model": describe_draft_time(cfg.draft_time_ms, draft_time),
                       "concurrency": cfg.concurrency, "request_rates": cfg.request_rates, "rounds": cfg.rounds,
                       "node_budget": cfg.node_budget,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "rows": rows}


def _twin(sched, draft, control_scale: float):
    """A copy of a scheduler before its run, to replay the run's calls on (the draft is shared, not copied);
    None where there is nothing to replay (control time not charged, or a draft that runs in line)."""
    if control_scale == 0 or not replayable(sched):
        return None
    return copy.deepcopy(sched, {id(draft): draft})


def _warm(meter: StepMeter | None) -> dict[str, float | None]:
    """The replayed (warm) control time per step of a bench row; None where there was no replay."""
    summary = meter.summary() if meter is not None and meter.steps else {}
    return {"control_warm_ms_per_step_p50": summary.get("control_ms_per_step_p50"),
            "control_warm_ms_per_step_p90": summary.get("control_ms_per_step_p90")}


def _levels(cfg: BenchConfig, num_stages: int, runner: StageRunner, draft, token_ids: list[list[int]],
            stage_time: tuple[float, float], draft_time, log) -> list[dict]:
    """The load sweep on the simulated clock, as bench_load does with real processes, so levels this machine
    could not host as processes (32, 64, 128 clients) can be measured: at concurrency c, c clients each send
    `rounds` requests one after another (prompts in turn); at request rate R, every prompt `rounds` times at
    Poisson arrival times (seed 0). One row per (level, variant)."""
    from coordinator.bench.load import level_name, level_row
    rows = []
    sizers: dict[Variant, object] = {}           # specpipe's cost rule and calibration live on across levels,
    calibrations: dict[Variant, object] = {}     # as in the engine
    for level in cfg.request_rates or cfg.concurrency:
        rate = level if cfg.request_rates else None
        n = len(token_ids) * cfg.rounds if rate else level * cfg.rounds
        for v in cfg.variants:
            spec = replace(SpecOptions(draft), stage_hardware=StageHardware.APART,
                           **{"node_budget": cfg.node_budget, **v.overrides()})
            sched = make_scheduler(v.method, num_stages, spec, sizers.get(v), calibrations.get(v))
            sizers[v] = getattr(sched, "sizer", None)
            calibrations[v] = getattr(sched, "calibration", None)
            twin = _twin(sched, draft, cfg.control_scale)
            pipe = SimulatedPipeline([runner], stage_time, num_stages=num_stages, hop_ms=cfg.hop_ms,
                                     draft_time=draft_time, control_scale=cfg.control_scale, record=twin is not None)
            reqs = [Request(f"{'r' if rate else 'c'}{level}-{v.label}-{i}", token_ids[i % len(token_ids)],
                            cfg.max_new_tokens) for i in range(n)]
            if rate:
                out = pipe.run(sched, reqs, draft=draft, arrive_ms=poisson_arrivals(n, rate))
            else:
                out = pipe.run(sched, reqs, draft=draft, clients=level)
            runs = [dict(o.stats.as_dict(), tbt_ms=o.tbt_ms, ttft_ms=o.ttft_ms, wall_ms=o.end_ms - o.start_ms)
                    for o in out.values()]
            wall_s = max(o.end_ms for o in out.values()) / 1e3
            row = level_row(v, num_stages, None if rate else level, runs, wall_s, stage_time, request_rate=rate)
            row.update(simulated=True, stage_compute_ms=[], compute_overrun_stages=[], compute_ms_per_step=None,
                       machine_bound=False, draft_ms=pipe.draft_ms,     # the coordinator's modelled draft time
                       draft_share=pipe.draft_ms / (wall_s * 1e3) if wall_s else 0.0, **pipe.steps.summary(),
                       **_warm(pipe.replay(twin) if twin is not None else None))
            rows.append(row)
            log(f"  simulated S={num_stages} {'rate' if rate else 'c'}={level_name(row)} {v.label}: "
                f"{row['throughput_tok_s']:.2f} tok/s, tbt p50 {row['tbt_ms_p50']:.0f} ms p90 "
                f"{row['tbt_ms_p90']:.0f} ms, ttft p50 {row['ttft_ms_p50']:.0f} ms p90 {row['ttft_ms_p90']:.0f} ms "
                f"({len(runs)} requests, {wall_s:.1f} s simulated)")
    return rows
