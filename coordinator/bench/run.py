"""`specpipe bench`: methods side by side over one local pipeline, interleaved prompt by prompt so that
machine drift hits every method alike. Writes DIR/results.json, PNG plots (coordinator/bench/plots.py) and prints a table.

Each variant (method, width, tree policy) runs every prompt alone (concurrency 1). Per variant it reports
time between tokens (mean, p50, p90 over requests), time to first token, tokens per pipeline step, hit rate,
throughput, and every stage's real compute per step next to the emulated stage time: when compute takes
most of the emulated time, the machine — not the modelled GPU stage — sets the pace, and the row is flagged.
Likewise when all stages' compute plus the draft's, per step, exceeds what the machine's cores can do in one
emulated step (`compute_ms_per_step` > cores x emulated stage time: `machine_bound`).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from services.config import parse_stage_time

from coordinator.bench.common import (OVERRUN, BenchConfig, Regime, Variant, generate_one, load_prompts,
                                      machine_cores, summarize)
from coordinator.bench.load import level_name, ratios, run_levels
from coordinator.bench.repeats import side_by_side, spreads
from coordinator.config import CoordinatorConfig
from coordinator.core.vocabulary import DRAFTS, Method
from coordinator.engine.local import LocalStages
from coordinator.core.schedulers.registry import Speculation
from coordinator.frontends.service import Coordinator, ModelParts


async def run_bench(cfg: BenchConfig, log=print) -> dict:
    """One bench over real processes, written to cfg.out (`measure_bench`, then `write_results`)."""
    return write_results(await measure_bench(cfg, log), cfg.out)


async def measure_bench(cfg: BenchConfig, log=print) -> dict:
    """One bench over real processes: the result, not written."""
    prompts = load_prompts(cfg.prompts, cfg.num_prompts)
    stage_time = parse_stage_time(cfg.stage_time_ms)
    out_rows = []
    # every request of a level may be in the server at once (an open loop does not wait for the server)
    load_cap = len(prompts) * cfg.rounds if cfg.request_rates else max(cfg.concurrency)
    for num_stages in cfg.stages:
        stages = LocalStages(num_stages, model=cfg.model, dtype=cfg.dtype, device=cfg.device,
                             threads=cfg.threads, stage_time_ms=cfg.stage_time_ms)
        config = CoordinatorConfig(stages=tuple(stages.plan()), model=cfg.model, draft=cfg.draft,
                                   draft_device=cfg.device, max_new_tokens_cap=1 << 20,
                                   node_budget=cfg.node_budget, max_active=load_cap, max_queue=load_cap)
        loading = asyncio.ensure_future(asyncio.to_thread(ModelParts.load, config))   # beside the stages' start
        coordinator = None
        try:
            stages.start()
            await stages.wait_ready()
            coordinator = await Coordinator.connect(config, await loading)
            runs: dict[Variant, list[dict]] = {v: [] for v in cfg.variants}
            await generate_one(coordinator, cfg.variants[0], prompts[0], 4)            # warm-up, not counted
            for v in cfg.variants:          # each cost rule learns this machine first, as `specpipe run` does
                await coordinator.warm_up(cfg.warmup_tokens, v.method, v.overrides())
            if cfg.load:
                out_rows += await run_levels(coordinator, cfg.variants, prompts, num_stages, cfg.concurrency,
                                             cfg.rounds, cfg.max_new_tokens, stage_time, log, cfg.temperature,
                                             rates=cfg.request_rates)
                continue
            for pi, prompt in enumerate(prompts):
                for v in cfg.variants:                                          # interleaved
                    stats = await generate_one(coordinator, v, prompt, cfg.max_new_tokens, cfg.temperature, pi + 1)
                    runs[v].append(stats)
                    log(f"  S={num_stages} prompt {pi + 1}/{len(prompts)} {v.label}: "
                        f"tbt {stats['tbt_ms']:.1f} ms, {stats['tokens_per_step']:.2f} tok/step")
            out_rows += [summarize(v, num_stages, runs[v], stage_time) for v in cfg.variants]
        finally:
            if coordinator is not None:
                await coordinator.close()
            stages.stop()
            await asyncio.gather(loading, return_exceptions=True)     # (a stage failed: no load left running)
    result = {"config": {k: v for k, v in asdict(cfg).items() if k != "variants"} | {
        "variants": [v.label for v in cfg.variants], "num_prompts_used": len(prompts),
        "emulated_stage_time": cfg.stage_time_ms != "0", "machine_cores": machine_cores(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, "rows": out_rows}
    if cfg.hf_reference:
        from coordinator.bench.hf_reference import hf_rows
        log("  transformers reference (generate, assisted generate) in this process")
        result["rows"] += hf_rows(cfg.model, cfg.draft, prompts, cfg.max_new_tokens, cfg.device, cfg.threads)
    return result


def write_results(result: dict, out_dir: str) -> dict:
    """DIR/results.json and the PNG plots."""
    from coordinator.bench.plots import plot
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    result["plots"] = [str(p) for p in plot(result, out)]
    return result


def table(result: dict) -> str:
    rows = result["rows"]
    head = f"{'S':>3} {'c':>3} {'variant':<34} {'tbt ms':>8} {'p90':>8} {'ttft ms':>8} {'tok/step':>9} {'dec/stp':>8} " \
           f"{'hit':>6} {'tok/s':>7} {'draft%':>7} {'ovh%':>6} {'ctl ms':>7} {'warm':>6}  flags"
    lines = [head, "-" * len(head)]
    for r in rows:
        hit = f"{r['hit_rate']:.2f}" if r["hit_rate"] is not None else "-"
        flag = f"compute>{OVERRUN:.0%} of emulated at stages {r['compute_overrun_stages']}" \
            if r["compute_overrun_stages"] else ""
        if r.get("machine_bound"):
            flag += ("; " if flag else "") + machine_bound_flag(r)
        tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] is not None else "-"
        ovh = f"{100 * r['overhead_share']:.1f}%" if r.get("overhead_share") is not None else "-"
        ctl = f"{r['control_ms_per_step_p50']:.2f}" if r.get("control_ms_per_step_p50") is not None else "-"
        warm = f"{r['control_warm_ms_per_step_p50']:.2f}" if r.get("control_warm_ms_per_step_p50") is not None \
            else "-"
        lines.append(f"{r['stages']:>3} {level_name(r):>3} {r['label']:<34} {r['tbt_ms_mean']:>8.1f} "
                     f"{r['tbt_ms_p90']:>8.1f} "
                     f"{r['ttft_ms_mean']:>8.0f} {tps:>9} {r.get('decode_tokens_per_step') or 0:>8.2f} {hit:>6} "
                     f"{r['throughput_tok_s']:>7.2f} {100 * r['draft_share']:>6.1f}% {ovh:>6} {ctl:>7} {warm:>6}  "
                     f"{flag}")
    lines += ratios(rows) + spreads(rows) + side_by_side(rows)
    base = {r["stages"]: r["tbt_ms_mean"] for r in rows if r["method"] == Method.PP and r["concurrency"] == 1}
    for r in rows:
        if r["method"] != Method.PP and r["concurrency"] == 1 and r["stages"] in base and r["tbt_ms_mean"]:
            lines.append(f"    S={r['stages']} {r['label']}: {base[r['stages']] / r['tbt_ms_mean']:.2f}x lower "
                         "time between tokens than pp")
    return "\n".join(lines)


def machine_bound_flag(r: dict) -> str:
    return (f"machine-bound: compute {r['compute_ms_per_step']:.0f} ms/step > {r['machine_cores']} cores x "
            f"{r['emulated_stage_ms']:.0f} ms")


def main_args(p) -> None:
    p.add_argument("--regime", default=Regime.CPU.value, choices=[r.value for r in Regime],
                   help="time-model preset: cpu = 120 ms stage steps (stages 8, draft 0.3 x stage, hop 0.3 ms); "
                        "gpu (with --simulate) = a 70B model over 8 H100-class stages: stage 5+0.025 ms, draft "
                        "1.5+0.005 ms, hop 0.5 ms. Flags given explicitly win")
    p.add_argument("--stages", default=None, help="comma-separated pipeline depths (default 8)")
    p.add_argument("--methods", default="pp,specpipe")
    p.add_argument("--widths", default=str(Speculation.width), help="comma-separated widths for specpipe")
    p.add_argument("--tree-policies", default="hybrid", help="comma-separated: layer,best-first,hybrid")
    p.add_argument("--topks", default="", help="comma-separated children per node to sweep for specpipe")
    p.add_argument("--draft-rounds", default="", help="comma-separated draft calls per step to sweep for specpipe")
    p.add_argument("--draft-chains", default="", help="comma-separated 1 (a step's rounds in one job), 0 (a job "
                   "per round) to sweep for specpipe (default: --draft-chain's)")
    p.add_argument("--calibrations", default="", help="comma-separated 1 (the tree ranked by the draft's measured "
                   "acceptance), 0 (by its probability) to sweep for specpipe (default: --calibrate's)")
    p.add_argument("--stage-time-ms", default=None, help="emulated stage time A or A+B ms per step [+ per row] "
                   "(default: the regime's, 120)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--prompts", default="", help="JSON lines {\"prompt\": ..., \"raw\": false} (or "
                   "\"prompt_token_ids\"); default: the shipped prompt set")
    p.add_argument("--num-prompts", type=int, default=4, help="how many prompts to use (0 = all)")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--model", default="default")
    p.add_argument("--draft", default="quant", choices=DRAFTS)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sps-k", default="", help="comma-separated k values to sweep for sps")
    p.add_argument("--tree-nodes", default="", help="comma-separated node budgets to sweep for tree")
    p.add_argument("--tree-depth", default="", help="comma-separated depths to sweep for tree (with --tree-nodes)")
    p.add_argument("--concurrency", default="1",
                   help="comma-separated numbers of clients at once, e.g. 1,4,8,16 (with cb-pp,specpipe)")
    p.add_argument("--rounds", type=int, default=2, help="requests per client at each concurrency level (with "
                   "--request-rate: times each prompt is sent per rate)")
    p.add_argument("--request-rate", default="",
                   help="comma-separated request rates per second to sweep instead of --concurrency: an open loop, "
                        "each prompt sent --rounds times at seeded Poisson arrival times")
    p.add_argument("--node-budget", type=int, default=Speculation.node_budget,
                   help="specpipe, cb-pp: rows per micro-batch shared by the requests in it")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (prompt i uses seed i + 1 for every variant)")
    p.add_argument("--verifies", default="", help="comma-separated: match,rejection (specpipe, sps, tree)")
    p.add_argument("--simulate", action="store_true",
                   help="simulated clock: real model outputs, modelled stage time (fast sweeps of S)")
    p.add_argument("--draft-time-ms", default=None,
                   help="with --simulate: what the draft costs the coordinator, 'A' or 'A+B' = A ms per draft "
                        "model call + B ms per row it computes (e.g. 36+0.075), or 'measured' = its measured "
                        "CPU time; default 0.3 x --stage-time-ms (ngram drafts are free)")
    p.add_argument("--hop-ms", type=float, default=None, help="with --simulate: each hop's time (default: the "
                   "regime's, 0.3)")
    p.add_argument("--control-time", default="measured", choices=["measured", "0"],
                   help="with --simulate: charge the coordinator's own measured time per event (tree, "
                        "verification, dispatch; everything but the draft model's forward), or not (0)")
    p.add_argument("--hf-reference", action="store_true",
                   help="also time transformers' generate and generate(assistant_model=<quant draft>) in-process")
    p.add_argument("--warmup-tokens", type=int, default=64,
                   help="real processes: before the measured prompts, warm each variant's cost rule up with a "
                        "generation of up to this many tokens, ended once the rule has decided (as `specpipe run` "
                        "does; 0: the first prompts pay the rule's exploration)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole bench this many times: each row is the median run's (time between tokens; "
                        "throughput under load) with every run's figures, and specpipe's ratio to each other "
                        "method run by run (side by side within each run) with their median and spread")


def config_from_args(a) -> BenchConfig:
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    strs = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    preset = Regime(getattr(a, "regime", Regime.CPU.value)).preset
    given = lambda name: getattr(a, name, None) if getattr(a, name, None) is not None else preset[name]  # noqa: E731
    return BenchConfig(stages=ints(given("stages")), methods=strs(a.methods), widths=ints(a.widths),
                       policies=strs(a.tree_policies), stage_time_ms=given("stage_time_ms"),
                       max_new_tokens=a.max_new_tokens, prompts=a.prompts, num_prompts=a.num_prompts,
                       out=a.out, model=a.model, draft=a.draft, dtype=a.dtype, device=a.device, threads=a.threads,
                       hf_reference=a.hf_reference, warmup_tokens=getattr(a, "warmup_tokens", 64),
                       sps_ks=ints(a.sps_k), concurrency=ints(a.concurrency),
                       rounds=a.rounds, node_budget=a.node_budget, temperature=a.temperature,
                       request_rates=_rates(a.request_rate),
                       verifies=strs(a.verifies), topks=ints(a.topks), draft_rounds=ints(a.draft_rounds),
                       draft_chains=ints(a.draft_chains), calibrations=ints(a.calibrations),
                       draft_time_ms=given("draft_time_ms"), hop_ms=given("hop_ms"),
                       control_time=getattr(a, "control_time", "measured"), repeats=getattr(a, "repeats", 1),
                       tree_shapes=[(n, d) for n in ints(a.tree_nodes) for d in ints(a.tree_depth or "6")])


def _rates(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--request-rate {text!r} is not a comma-separated list of requests per second, "
                         "e.g. 0.5,1,2") from None


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
