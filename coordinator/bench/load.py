"""`specpipe bench --concurrency 1,4,8,16`: many clients at once (SpecPipe-DB against cb-pp); `--request-rate
0.1,0.5`: requests arriving at random.

At concurrency c, c clients each send `rounds` requests one after another (a closed loop over the prompt
set), so c requests are in the server at all times except at the edges. A client sends its next request
the moment its last one ends, so arrivals come just after a result: the worst case for a pipeline that
keeps every slot full. At request rate R (an open loop), every prompt is sent `rounds` times, at the times
of a seeded Poisson process of R requests per second, whatever the server is doing. Levels run in
increasing order and, within a level, the methods one after another, so drift is shared within a level.
Per (method, level) one row: throughput (tokens of all requests / wall time of the level), time between
tokens p50/p90 over requests (each request's mean gap), time to first token p50/p90, and the stage-compute
overrun flags of common.summarize.
"""
from __future__ import annotations

import asyncio
import time

from coordinator.bench.common import Variant, generate_one, percentile, poisson_arrivals, summarize
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


async def run_rate(coordinator: Coordinator, variant: Variant, prompts: list[dict], rate: float, rounds: int,
                   max_new: int, temperature: float = 0.0) -> tuple[list[dict], float]:
    """Every prompt `rounds` times, each request sent at its Poisson arrival time (seed 0); stats of every
    request and the level's wall time in seconds."""
    work = [prompts[i % len(prompts)] for i in range(len(prompts) * rounds)]
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def send(i: int, at_ms: float) -> dict:
        await asyncio.sleep(max(0.0, started + at_ms / 1e3 - loop.time()))     # the arrival schedule itself
        return await generate_one(coordinator, variant, work[i], max_new, temperature, i + 1)

    runs = await asyncio.gather(*(send(i, t) for i, t in enumerate(poisson_arrivals(len(work), rate))))
    return list(runs), loop.time() - started


def level_name(row: dict) -> str:
    """The load of a row: its concurrency, or its request rate as "R/s"."""
    rate = row.get("request_rate")
    return f"{rate:g}/s" if rate else str(row["concurrency"])


def level_row(variant: Variant, stages: int, concurrency: int | None, runs: list[dict], wall_s: float,
              stage_time: tuple[float, float], request_rate: float | None = None) -> dict:
    """One results.json row of a load level: closed loop (`concurrency` clients) or open (`request_rate`)."""
    row = summarize(variant, stages, runs, stage_time)
    ttfts = [r["ttft_ms"] for r in runs]
    draft_ms = sum(r.get("draft_ms", 0.0) for r in runs)
    row.update(concurrency=concurrency, request_rate=request_rate, wall_s=wall_s,
               throughput_tok_s=row["tokens"] / wall_s if wall_s else 0.0,
               ttft_ms_p50=percentile(ttfts, 0.5), ttft_ms_p90=percentile(ttfts, 0.9),
               draft_share=draft_ms / (wall_s * 1e3) if wall_s else 0.0)
    return row


async def run_levels(coordinator: Coordinator, variants: list[Variant], prompts: list[dict], stages: int,
                     levels: list[int], rounds: int, max_new: int, stage_time: tuple[float, float],
                     log=print, temperature: float = 0.0, rates: list[float] | None = None) -> list[dict]:
    """Closed-loop `levels` of concurrency, or with `rates` open-loop request rates instead."""
    rows = []
    for level in rates or levels:
        for v in variants:
            if rates:
                runs, wall = await run_rate(coordinator, v, prompts, level, rounds, max_new, temperature)
                rows.append(level_row(v, stages, None, runs, wall, stage_time, request_rate=level))
            else:
                runs, wall = await run_level(coordinator, v, prompts, level, rounds, max_new, temperature)
                rows.append(level_row(v, stages, level, runs, wall, stage_time))
            r = rows[-1]
            log(f"  S={stages} {'rate' if rates else 'c'}={level_name(r)} {v.label}: {r['throughput_tok_s']:.2f} "
                f"tok/s, tbt p50 {r['tbt_ms_p50']:.0f} ms p90 {r['tbt_ms_p90']:.0f} ms, ttft p50 "
                f"{r['ttft_ms_p50']:.0f} ms p90 {r['ttft_ms_p90']:.0f} ms ({len(runs)} requests, {wall:.1f} s)")
    return rows


def ratios(rows: list[dict], baseline: str = "cb-pp") -> list[str]:
    """Per (stages, load): each method's throughput, time between tokens and time to first token against the
    baseline."""
    def key(r: dict) -> tuple:
        return r["stages"], r["concurrency"], r.get("request_rate")
    base = {key(r): r for r in rows if r["method"] == baseline}
    out = []
    for r in rows:
        b = base.get(key(r))
        if b is None or r["method"] == baseline or not b["throughput_tok_s"] or not r["tbt_ms_p50"]:
            continue
        ttft = f", time to first token p50 {r['ttft_ms_p50'] / b['ttft_ms_p50']:.2f}x {baseline}'s" \
            if r.get("ttft_ms_p50") and b.get("ttft_ms_p50") else ""
        out.append(f"    S={r['stages']} {'rate' if r.get('request_rate') else 'c'}={level_name(r)} {r['label']}: "
                   f"{r['throughput_tok_s'] / b['throughput_tok_s']:.2f}x the throughput of {baseline}, "
                   f"{b['tbt_ms_p50'] / r['tbt_ms_p50']:.2f}x lower time between tokens (p50){ttft}")
    return out
