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

import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from services.config import parse_draft_time, parse_stage_time

from coordinator.config import CoordinatorConfig
from coordinator.cli.local import LocalStages
from coordinator.core.schedulers.registry import SpecOptions
from coordinator.frontends.service import Coordinator, GenerateInput

OVERRUN = 0.9    # flag a stage whose real compute per step exceeds this share of its emulated time


@dataclass(frozen=True)
class Variant:
    method: str
    width: int | None = None
    policy: str | None = None
    extra: tuple[tuple[str, int | str], ...] = ()     # other SpecOptions fields, e.g. (("sps_k", 4),)

    @property
    def label(self) -> str:
        base = self.method if self.width is None else f"{self.method}/{self.policy}/w{self.width}"
        return base + "".join(f"/{k.split('_')[-1]}{v}" if isinstance(v, int) else f"/{v}" for k, v in self.extra)

    def overrides(self) -> dict:
        """SpecOptions fields this variant sets (the rest keep the server's settings)."""
        out = dict(self.extra)
        if self.width is not None:
            out["width"] = self.width
        if self.policy is not None:
            out["policy"] = self.policy
        return out


@dataclass
class BenchConfig:
    stages: list[int]
    methods: list[str]
    widths: list[int]
    policies: list[str]
    stage_time_ms: str = "120"
    max_new_tokens: int = 32
    prompts: str = ""                  # JSON lines {"prompt": ..., "raw": ...}; empty = shipped set
    num_prompts: int = 4
    out: str = "bench-out"
    model: str = "default"
    draft: str = "quant"
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1
    hf_reference: bool = False         # also time transformers' generate / assisted generate in-process
    sps_ks: list[int] = field(default_factory=list)                    # sweep of sps k (empty: default)
    tree_shapes: list[tuple[int, int]] = field(default_factory=list)   # sweep of tree (nodes, depth)
    concurrency: list[int] = field(default_factory=lambda: [1])   # >1: clients at once (bench_load)
    rounds: int = 2                    # requests per client at each concurrency level
    temperature: float = 0.0           # > 0: sample (prompt i uses seed i + 1 for every variant)
    verifies: list[str] = field(default_factory=list)   # sweep of --verify for specpipe, sps, tree
    node_budget: int = 32              # specpipe, cb-pp: rows per micro-batch shared by requests
    topks: list[int] = field(default_factory=list)          # sweep of specpipe's --topk (empty: default)
    draft_rounds: list[int] = field(default_factory=list)   # sweep of specpipe's --draft-rounds
    draft_time_ms: str = ""            # --simulate: draft cost "A[+B]" ms per call [+ per row], "measured";
                                       # empty: 0.3 x the stage time (services/config.py parse_draft_time)
    variants: list[Variant] = field(default_factory=list)

    @property
    def load(self) -> bool:
        """A concurrency sweep rather than one request at a time."""
        return self.concurrency != [1]

    def __post_init__(self) -> None:
        parse_draft_time(self.draft_time_ms, parse_stage_time(self.stage_time_ms))
        if not self.concurrency or min(self.concurrency) < 1 or self.rounds < 1:
            raise ValueError("concurrency levels and rounds must be at least 1")
        if not self.variants:
            for m in self.methods:
                if m == "specpipe":
                    extras = [tuple(e) for e in itertools.product(
                        *([("topk", k) for k in self.topks] or [None], [("draft_rounds", r) for r in self.draft_rounds]
                          or [None]))]
                    self.variants += [Variant(m, w, p, tuple(x for x in e if x)) for p in self.policies
                                      for w in self.widths for e in extras]
                elif m == "sps" and self.sps_ks:
                    self.variants += [Variant(m, extra=(("sps_k", k),)) for k in self.sps_ks]
                elif m == "tree" and self.tree_shapes:
                    self.variants += [Variant(m, extra=(("tree_nodes", n), ("tree_depth", d)))
                                      for n, d in self.tree_shapes]
                else:
                    self.variants.append(Variant(m))
            if self.verifies:
                self.variants = [w for v in self.variants for w in _with_verifiers(v, self.verifies)]


def _with_verifiers(v: Variant, verifies: list[str]) -> list[Variant]:
    if v.method not in ("specpipe", "sps", "tree"):
        return [v]
    return [Variant(v.method, v.width, v.policy, v.extra + (("verify", ver),)) for ver in verifies]


def load_prompts(path: str, n: int) -> list[dict]:
    text = Path(path).read_text() if path else \
        resources.files("coordinator.bench").joinpath("data/prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for i, r in enumerate(rows):
        text_ok = isinstance(r.get("prompt"), str) and r["prompt"]
        ids_ok = isinstance(r.get("prompt_token_ids"), list) and r["prompt_token_ids"]
        if not (text_ok or ids_ok):
            raise ValueError(f"prompt file line {i + 1}: needs a non-empty 'prompt' (text) or 'prompt_token_ids'")
    return rows[:n] if n > 0 else rows


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(variant: Variant, stages: int, runs: list[dict], stage_time: tuple[float, float],
              cores: int | None = None) -> dict:
    """One row of results.json from the runs' stats. `cores` (default: this machine's) bounds the real
    compute per step the machine can keep up with: past cores x the emulated step, the row is machine-bound."""
    tbts = [r["tbt_ms"] for r in runs]
    tokens = sum(r["tokens"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    hits = sum(r.get("hits", 0) for r in runs)
    misses = sum(r.get("misses", 0) for r in runs)
    wall = sum(r["wall_ms"] for r in runs) / 1e3
    batches = sum(r.get("batches", 0) for r in runs) or 1
    compute = [sum(r.get(f"stage{i}_compute_ms", 0.0) for r in runs) / batches for i in range(stages)]
    rows = sum(r.get("stage0_rows_computed", 0) for r in runs) / batches
    emulated = stage_time[0] + stage_time[1] * rows
    flagged = [i for i, c in enumerate(compute) if emulated > 0 and c > OVERRUN * emulated]
    cores = _cores() if cores is None else cores
    per_step = sum(compute) + sum(r.get("draft_ms", 0.0) for r in runs) / batches   # stages' + draft's compute
    machine_bound = per_step > cores * emulated if emulated > 0 else None            # None: no emulated time
    return {"method": variant.method, "label": variant.label, "width": variant.width, "tree_policy": variant.policy,
            "stages": stages, "concurrency": 1, "requests": len(runs),
            "tbt_ms_mean": statistics.fmean(tbts) if tbts else 0.0, "tbt_ms_p50": percentile(tbts, 0.5),
            "tbt_ms_p90": percentile(tbts, 0.9),
            "ttft_ms_mean": statistics.fmean(r["ttft_ms"] for r in runs) if runs else 0.0,
            "tokens_per_step": tokens / steps if steps else 0.0,
            "decode_tokens_per_step": (sum(r["tokens"] - 1 for r in runs) / decode_steps
                                       if (decode_steps := sum(r.get("decode_steps", 0) for r in runs)) else 0.0),
            "lag_steps": sum(r.get("lag_steps", 0) for r in runs) / max(len(runs), 1),
            "refill_steps": sum(r.get("refill_steps", 0) for r in runs) / max(len(runs), 1),
            "warm_restarts": sum(r.get("warm_restarts", 0) for r in runs) / max(len(runs), 1),
            "hit_rate": hits / (hits + misses) if variant.method != "pp" and hits + misses else None,
            "hits": hits, "misses": misses,
            "throughput_tok_s": tokens / wall if wall else 0.0, "steps": steps, "tokens": tokens, "wall_s": wall,
            "draft_share": sum(r.get("draft_ms", 0.0) for r in runs) / (wall * 1e3) if wall else 0.0,
            "rows_per_step": rows, "stage_compute_ms": compute, "emulated_stage_ms": emulated,
            "overhead_share": _mean([r["overhead_share"] for r in runs if "overhead_share" in r]),
            "overhead_ms_per_trip": _mean([r["overhead_ms_mean"] for r in runs if "overhead_ms_mean" in r]),
            "result_bytes_per_step": sum(r.get("result_bytes", 0.0) for r in runs) / batches,
            "compute_overrun_stages": flagged, "compute_ms_per_step": per_step, "machine_bound": machine_bound,
            "machine_cores": cores}


async def run_bench(cfg: BenchConfig, log=print) -> dict:
    prompts = load_prompts(cfg.prompts, cfg.num_prompts)
    stage_time = parse_stage_time(cfg.stage_time_ms)
    out_rows = []
    for num_stages in cfg.stages:
        stages = LocalStages(num_stages, model=cfg.model, dtype=cfg.dtype, device=cfg.device,
                             threads=cfg.threads, stage_time_ms=cfg.stage_time_ms)
        stages.start()
        coordinator = None
        try:
            await stages.wait_ready()
            coordinator = await Coordinator.connect(CoordinatorConfig(
                stages=tuple(stages.addresses), model=cfg.model, draft=cfg.draft, draft_device=cfg.device,
                max_new_tokens_cap=1 << 20,
                node_budget=cfg.node_budget, max_active=max(cfg.concurrency), max_queue=max(cfg.concurrency)))
            runs: dict[Variant, list[dict]] = {v: [] for v in cfg.variants}
            await _one(coordinator, cfg.variants[0], prompts[0], 4)            # warm-up, not counted
            if cfg.load:
                from coordinator.bench.load import run_levels
                out_rows += await run_levels(coordinator, cfg.variants, prompts, num_stages, cfg.concurrency,
                                             cfg.rounds, cfg.max_new_tokens, stage_time, log, cfg.temperature)
                continue
            for pi, prompt in enumerate(prompts):
                for v in cfg.variants:                                          # interleaved
                    stats = await _one(coordinator, v, prompt, cfg.max_new_tokens, cfg.temperature, pi + 1)
                    runs[v].append(stats)
                    log(f"  S={num_stages} prompt {pi + 1}/{len(prompts)} {v.label}: "
                        f"tbt {stats['tbt_ms']:.1f} ms, {stats['tokens_per_step']:.2f} tok/step")
            out_rows += [summarize(v, num_stages, runs[v], stage_time) for v in cfg.variants]
        finally:
            if coordinator is not None:
                await coordinator.close()
            stages.stop()
    result = {"config": {k: v for k, v in asdict(cfg).items() if k != "variants"} | {
        "variants": [v.label for v in cfg.variants], "num_prompts_used": len(prompts),
        "emulated_stage_time": cfg.stage_time_ms != "0", "machine_cores": _cores(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, "rows": out_rows}
    if cfg.hf_reference:
        from coordinator.bench.hf_reference import hf_rows
        log("  transformers reference (generate, assisted generate) in this process")
        result["rows"] += hf_rows(cfg.model, cfg.draft, prompts, cfg.max_new_tokens, cfg.device, cfg.threads)
    return write_results(result, cfg.out)


def write_results(result: dict, out_dir: str) -> dict:
    """DIR/results.json and the PNG plots."""
    from coordinator.bench.plots import plot
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    result["plots"] = [str(p) for p in plot(result, out)]
    return result


async def _one(coordinator: Coordinator, v: Variant, prompt: dict, max_new: int, temperature: float = 0.0,
               seed: int = 0) -> dict:
    inp = GenerateInput(prompt=prompt.get("prompt", ""), prompt_token_ids=list(prompt.get("prompt_token_ids", [])),
                        raw=bool(prompt.get("raw", False)), max_new_tokens=max_new, temperature=temperature,
                        seed=seed, method=v.method, ignore_eos=True, spec_overrides=v.overrides())
    last = None
    async for chunk in coordinator.generate(inp):
        last = chunk
    return dict(last.stats)


def table(result: dict) -> str:
    rows = result["rows"]
    head = f"{'S':>3} {'c':>3} {'variant':<34} {'tbt ms':>8} {'p90':>8} {'ttft ms':>8} {'tok/step':>9} {'dec/stp':>8} " \
           f"{'hit':>6} {'tok/s':>7} {'draft%':>7} {'ovh%':>6}  flags"
    lines = [head, "-" * len(head)]
    for r in rows:
        hit = f"{r['hit_rate']:.2f}" if r["hit_rate"] is not None else "-"
        flag = f"compute>{OVERRUN:.0%} of emulated at stages {r['compute_overrun_stages']}" \
            if r["compute_overrun_stages"] else ""
        if r.get("machine_bound"):
            flag += ("; " if flag else "") + machine_bound_flag(r)
        tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] is not None else "-"
        ovh = f"{100 * r['overhead_share']:.1f}%" if r.get("overhead_share") is not None else "-"
        lines.append(f"{r['stages']:>3} {r['concurrency']:>3} {r['label']:<34} {r['tbt_ms_mean']:>8.1f} "
                     f"{r['tbt_ms_p90']:>8.1f} "
                     f"{r['ttft_ms_mean']:>8.0f} {tps:>9} {r.get('decode_tokens_per_step') or 0:>8.2f} {hit:>6} "
                     f"{r['throughput_tok_s']:>7.2f} {100 * r['draft_share']:>6.1f}% {ovh:>6}  {flag}")
    from coordinator.bench.load import ratios
    lines += ratios(rows)
    base = {r["stages"]: r["tbt_ms_mean"] for r in rows if r["method"] == "pp" and r["concurrency"] == 1}
    for r in rows:
        if r["method"] != "pp" and r["concurrency"] == 1 and r["stages"] in base and r["tbt_ms_mean"]:
            lines.append(f"    S={r['stages']} {r['label']}: {base[r['stages']] / r['tbt_ms_mean']:.2f}x lower "
                         "time between tokens than pp")
    return "\n".join(lines)


def machine_bound_flag(r: dict) -> str:
    return (f"machine-bound: compute {r['compute_ms_per_step']:.0f} ms/step > {r['machine_cores']} cores x "
            f"{r['emulated_stage_ms']:.0f} ms")


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _cores() -> int:
    import os
    return os.cpu_count() or 0


def main_args(p) -> None:
    p.add_argument("--stages", default="8", help="comma-separated pipeline depths")
    p.add_argument("--methods", default="pp,specpipe")
    p.add_argument("--widths", default=str(SpecOptions().width), help="comma-separated widths for specpipe")
    p.add_argument("--tree-policies", default="hybrid", help="comma-separated: layer,best-first,hybrid")
    p.add_argument("--topks", default="", help="comma-separated children per node to sweep for specpipe")
    p.add_argument("--draft-rounds", default="", help="comma-separated draft calls per step to sweep for specpipe")
    p.add_argument("--stage-time-ms", default="120")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--prompts", default="", help="JSON lines {\"prompt\": ..., \"raw\": false} (or "
                   "\"prompt_token_ids\"); default: the shipped prompt set")
    p.add_argument("--num-prompts", type=int, default=4, help="how many prompts to use (0 = all)")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--model", default="default")
    p.add_argument("--draft", default="quant", choices=["quant", "quant+ngram", "ngram", "model", "none"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sps-k", default="", help="comma-separated k values to sweep for sps")
    p.add_argument("--tree-nodes", default="", help="comma-separated node budgets to sweep for tree")
    p.add_argument("--tree-depth", default="", help="comma-separated depths to sweep for tree (with --tree-nodes)")
    p.add_argument("--concurrency", default="1",
                   help="comma-separated numbers of clients at once, e.g. 1,4,8,16 (with cb-pp,specpipe)")
    p.add_argument("--rounds", type=int, default=2, help="requests per client at each concurrency level")
    p.add_argument("--node-budget", type=int, default=32,
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
    p.add_argument("--hf-reference", action="store_true",
                   help="also time transformers' generate and generate(assistant_model=<quant draft>) in-process")


def config_from_args(a) -> BenchConfig:
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    strs = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    return BenchConfig(stages=ints(a.stages), methods=strs(a.methods), widths=ints(a.widths),
                       policies=strs(a.tree_policies), stage_time_ms=a.stage_time_ms,
                       max_new_tokens=a.max_new_tokens, prompts=a.prompts, num_prompts=a.num_prompts,
                       out=a.out, model=a.model, draft=a.draft, dtype=a.dtype, device=a.device, threads=a.threads,
                       hf_reference=a.hf_reference, sps_ks=ints(a.sps_k), concurrency=ints(a.concurrency),
                       rounds=a.rounds, node_budget=a.node_budget, temperature=a.temperature,
                       verifies=strs(a.verifies), topks=ints(a.topks), draft_rounds=ints(a.draft_rounds), draft_time_ms=getattr(a, "draft_time_ms", None) or "",
                       tree_shapes=[(n, d) for n in ints(a.tree_nodes) for d in ints(a.tree_depth or "6")])


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
