"""`specpipe bench --concurrency 1,4,8,16`: many clients at once (SpecPipe-DB against cb-pp).

At concurrency c, c clients each send `rounds` requests one after another (a closed loop over the prompt
set), so c requests are in the server at all times except at the edges. Levels run in increasing order and,
within a level, the methods one after another, so drift is shared within a level. Per (method,
concurrency) one row: throughput (tokens of all requests / wall time of the level), time between tokens
p50/p90 over requests (each request's mean gap), time to first token, and the stage-compute overrun flags
of common.summarize.
"""
from __future__ import annotations

import asyncio
import time

from coordinator.bench.common import Variant, generate_one, percentile, summarize
from coordinator.frontends.service import Coordinator


async def run_level(coordinator: Coordinator, variant: Variant, prompts: list[dict], concurrency: int,
                    rounds: int, max_new: int, temperature: float = 0.0) -> tuple[list[dict], float]:
    """Stats of every request and the level's wall time in seconds."""
    work = [(i + 1, prompts[i % len(prompts)]) for i in range(concurrency * rounds)]
    runs: list[dict] = []

    async def client() -> None:
        while work:
            seed, prompt = work.pop(0)
            runs.append(await generate_one(coordinator, variant, prompt, max_new, temperature, seed))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return runs, time.perf_counter() - started


def level_row(variant: Variant, stages: int, concurrency: int, runs: list[dict], wall_s: float,
              stage_time: tuple[float, float]) -> dict:
    row = summarize(variant, stages, runs, stage_time)
    ttfts = [r["ttft_ms"] for r in runs]
    draft_ms = sum(r.get("draft_ms", 0.0) for r in runs)
    row.update(concurrency=concurrency, wall_s=wall_s,
               throughput_tok_s=row["tokens"] / wall_s if wall_s else 0.0,
               ttft_ms_p50=percentile(ttfts, 0.5), ttft_ms_p90=percentile(ttfts, 0.9),
               draft_share=draft_ms / (wall_s * 1e3) if wall_s else 0.0)
    return row


async def run_levels(coordinator: Coordinator, variants: list[Variant], prompts: list[dict], stages: int,
                     levels: list[int], rounds: int, max_new: int, stage_time: tuple[float, float],
                     log=print, temperature: float = 0.0) -> list[dict]:
    rows = []
    for c in levels:
        for v in variants:
            runs, wall = await run_level(coordinator, v, prompts, c, rounds, max_new, temperature)
            rows.append(level_row(v, stages, c, runs, wall, stage_time))
            r = rows[-1]
            log(f"  S={stages} c={c} {v.label}: {r['throughput_tok_s']:.2f} tok/s, tbt p50 {r['tbt_ms_p50']:.0f} ms "
                f"p90 {r['tbt_ms_p90']:.0f} ms, ttft {r['ttft_ms_mean']:.0f} ms ({len(runs)} requests, {wall:.1f} s)")
    return rows


def ratios(rows: list[dict], baseline: str = "cb-pp") -> list[str]:
    """Per (stages, concurrency): each method's throughput and time between tokens against the baseline."""
    base = {(r["stages"], r["concurrency"]): r for r in rows if r["method"] == baseline}
    out = []
    for r in rows:
        b = base.get((r["stages"], r["concurrency"]))
        if b is None or r["method"] == baseline or not b["throughput_tok_s"] or not r["tbt_ms_p50"]:
            continue
        out.append(f"    S={r['stages']} c={r['concurrency']} {r['label']}: "
                   f"{r['throughput_tok_s'] / b['throughput_tok_s']:.2f}x the throughput of {baseline}, "
                   f"{b['tbt_ms_p50'] / r['tbt_ms_p50']:.2f}x lower time between tokens (p50)")
    return out
