"""What the bench's runners share: the variants and the configuration of a run, the prompts, one request
through a coordinator, and the row of results.json that a variant's runs make (`summarize`).

run.py (one request at a time), load.py (many clients at once), sim.py (the simulated clock) and
hf_reference.py (transformers' own generate) import this module; it imports none of them.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import statistics
from dataclasses import dataclass, field
from enum import Enum
from importlib import resources
from pathlib import Path

from services.config import parse_draft_time, parse_stage_time

from coordinator.core.schedulers.registry import Speculation
from coordinator.core.stats import TTFTPhase
from coordinator.core.vocabulary import Method
from coordinator.engine.meter import quantile
from coordinator.frontends.service import Coordinator, GenerateInput

OVERRUN = 0.9    # flag a stage whose real compute per step exceeds this share of its emulated time


@dataclass(frozen=True)
class Variant:
    method: str
    width: int | None = None
    policy: str | None = None
    extra: tuple[tuple[str, int | str], ...] = ()     # other Speculation fields, e.g. (("sps_k", 4),)

    @property
    def label(self) -> str:
        width = "auto" if self.width == 0 else self.width      # 0: the cost rule sizes it
        base = self.method if self.width is None else f"{self.method}/{self.policy}/w{width}"
        return base + "".join(f"/{k.split('_')[-1]}{v}" if isinstance(v, int) else f"/{v}" for k, v in self.extra)

    def overrides(self) -> dict:
        """Speculation fields this variant sets (the rest keep the server's settings)."""
        out = dict(self.extra)
        if self.width is not None:
            out["width"] = self.width
        if self.policy is not None:
            out["tree_policy"] = self.policy
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
    warmup_tokens: int = 64            # real processes: each cost rule's warm-up before the measured prompts
    sps_ks: list[int] = field(default_factory=list)                    # sweep of sps k (empty: default)
    tree_shapes: list[tuple[int, int]] = field(default_factory=list)   # sweep of tree (nodes, depth)
    concurrency: list[int] = field(default_factory=lambda: [1])   # >1: clients at once (bench_load)
    rounds: int = 2                    # requests per client at each concurrency level; with request_rates,
                                       # each prompt is sent this many times per rate
    request_rates: list[float] = field(default_factory=list)   # open loop: Poisson arrivals, requests/s
    temperature: float = 0.0           # > 0: sample (prompt i uses seed i + 1 for every variant)
    verifies: list[str] = field(default_factory=list)   # sweep of --verify for specpipe, sps, tree
    node_budget: int = Speculation.node_budget     # specpipe, cb-pp: rows per micro-batch shared by requests
    topks: list[int] = field(default_factory=list)          # sweep of specpipe's --topk (empty: default)
    draft_rounds: list[int] = field(default_factory=list)   # sweep of specpipe's --draft-rounds
    draft_chains: list[int] = field(default_factory=list)   # sweep of specpipe's --draft-chain (1 on, 0 off)
    calibrations: list[int] = field(default_factory=list)   # sweep of specpipe's --calibrate (1 on, 0 off)
    draft_time_ms: str = ""            # --simulate: draft cost "A[+B]" ms per call [+ per row], "measured";
                                       # empty: 0.3 x the stage time (services/config.py parse_draft_time)
    hop_ms: float = 0.3                # --simulate: each hop's time
    control_time: str = "measured"     # --simulate: charge the coordinator's measured control time, or "0"
    repeats: int = 1                   # the whole bench this many times, the median run reported (bench/repeats.py)
    variants: list[Variant] = field(default_factory=list)

    @property
    def load(self) -> bool:
        """A sweep of load (concurrency levels or request rates) rather than one request at a time."""
        return self.concurrency != [1] or bool(self.request_rates)

    @property
    def control_scale(self) -> float:
        return parse_control_time(self.control_time)

    def __post_init__(self) -> None:
        parse_draft_time(self.draft_time_ms, parse_stage_time(self.stage_time_ms))
        parse_control_time(self.control_time)
        if not self.hop_ms >= 0:
            raise ValueError(f"--hop-ms {self.hop_ms!r} must be 0 or more")
        if self.repeats < 1:
            raise ValueError(f"--repeats {self.repeats} must be at least 1")
        if not self.concurrency or min(self.concurrency) < 1 or self.rounds < 1:
            raise ValueError("concurrency levels and rounds must be at least 1")
        if self.request_rates and (self.concurrency != [1] or not all(r > 0 for r in self.request_rates)):
            raise ValueError("request rates must be above 0 requests per second, and not with --concurrency")
        if not self.variants:
            for m in self.methods:
                if m == Method.SPECPIPE:
                    extras = [tuple(e) for e in itertools.product(
                        *([("topk", k) for k in self.topks] or [None], [("draft_rounds", r) for r in self.draft_rounds]
                          or [None], [("draft_chain", c) for c in self.draft_chains] or [None],
                          [("calibrate", c) for c in self.calibrations] or [None]))]
                    self.variants += [Variant(m, w, p, tuple(x for x in e if x)) for p in self.policies
                                      for w in self.widths for e in extras]
                elif m == Method.SPS and self.sps_ks:
                    self.variants += [Variant(m, extra=(("sps_k", k),)) for k in self.sps_ks]
                elif m == Method.TREE and self.tree_shapes:
                    self.variants += [Variant(m, extra=(("tree_nodes", n), ("tree_depth", d)))
                                      for n, d in self.tree_shapes]
                else:
                    self.variants.append(Variant(m))
            if self.verifies:
                self.variants = [w for v in self.variants for w in _with_verifiers(v, self.verifies)]


class Regime(str, Enum):
    """Time-model presets of `specpipe bench` (`--regime`); a flag given explicitly wins over its preset."""
    CPU = "cpu"
    GPU = "gpu"

    @property
    def preset(self) -> dict[str, str | float]:
        """CPU: this project's historical setting, 120 ms per stage step (a CPU-scale number).
        GPU: a 70B model in bf16 over 8 stages of one H100-class GPU each — ~17.5 GB of weights per stage
        read once per step at ~3 TB/s: 5 ms per step + 0.025 ms per tree row; a ~1B draft (Llama-3.2-1B for
        Llama-3.1-70B): 1.5 ms per call + 0.005 ms per row; 0.5 ms per hop (512 KiB of hidden states
        through gRPC). Figures from public bandwidth numbers, not measured on a GPU here."""
        if self is Regime.GPU:
            return {"stages": "8", "stage_time_ms": "5+0.025", "draft_time_ms": "1.5+0.005", "hop_ms": 0.5}
        return {"stages": "8", "stage_time_ms": "120", "draft_time_ms": "", "hop_ms": 0.3}


def parse_control_time(text: str) -> float:
    """`--control-time`: 'measured' -> 1.0 (the coordinator's measured time is charged), '0' -> 0.0.

    >>> parse_control_time("measured"), parse_control_time("0")
    (1.0, 0.0)
    """
    value = (text or "").strip().lower()
    if value in ("measured", "0"):
        return 1.0 if value == "measured" else 0.0
    raise ValueError(f"--control-time {text!r} is neither 'measured' nor '0'")


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


percentile = quantile      # linear interpolation between order statistics (0 for no data)


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
    cores = machine_cores() if cores is None else cores
    per_step = sum(compute) + sum(r.get("draft_ms", 0.0) for r in runs) / batches   # stages' + draft's compute
    machine_bound = per_step > cores * emulated if emulated > 0 else None            # None: no emulated time
    return {"method": variant.method, "label": variant.label, "width": variant.width, "tree_policy": variant.policy,
            "stages": stages, "concurrency": 1, "requests": len(runs),
            "tbt_ms_mean": statistics.fmean(tbts) if tbts else 0.0, "tbt_ms_p50": percentile(tbts, 0.5),
            "tbt_ms_p90": percentile(tbts, 0.9),
            "ttft_ms_mean": statistics.fmean(r["ttft_ms"] for r in runs) if runs else 0.0,
            "ttft_phases_ms": ttft_phases(runs),
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
            "machine_cores": cores, **per_step_costs(runs),
            # the cost rule's last width and topk per request (0: none)
            "sized_widths": [int(r["sized_width"]) for r in runs if "sized_width" in r],
            "sized_topks": [int(r["sized_topk"]) for r in runs if "sized_topk" in r]}


def per_step_costs(runs: list[dict]) -> dict[str, float | None]:
    """Control and draft ms per pipeline step (per result handled), median and p90 over the requests (each
    request's own mean); the simulated clock replaces these with its per-step distribution
    (coordinator/engine/meter.py)."""
    out: dict[str, float | None] = {}
    for part in ("control", "draft"):
        xs = [r[f"{part}_ms"] / r["batches"] for r in runs if r.get("batches") and f"{part}_ms" in r]
        out[f"{part}_ms_per_step_p50"] = percentile(xs, 0.5) if xs else None
        out[f"{part}_ms_per_step_p90"] = percentile(xs, 0.9) if xs else None
    return out


async def generate_one(coordinator: Coordinator, v: Variant, prompt: dict, max_new: int, temperature: float = 0.0,
                       seed: int = 0) -> dict:
    """One request, as the bench sends it (the variant's method and settings, no end at EOS): its final stats."""
    inp = GenerateInput(prompt=prompt.get("prompt", ""), prompt_token_ids=list(prompt.get("prompt_token_ids", [])),
                        raw=bool(prompt.get("raw", False)), max_new_tokens=max_new, temperature=temperature,
                        seed=seed, method=v.method, ignore_eos=True, spec_overrides=v.overrides())
    last = None
    async for chunk in coordinator.generate(inp):
        last = chunk
    return last.stats.as_dict()


def ttft_phases(runs: list[dict]) -> dict[str, float] | None:
    """Mean milliseconds per phase of the time to first token (coordinator/engine/live.py TTFTPhase; they add
    up to `ttft_ms_mean`), over requests that report them: real processes do, the simulated clock does not
    (None)."""
    keys = [f"ttft_{p.value}_ms" for p in TTFTPhase]
    timed = [r for r in runs if all(k in r for k in keys)]
    if not timed:
        return None
    return {p.value: statistics.fmean(r[k] for r in timed) for p, k in zip(TTFTPhase, keys)}


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def machine_cores() -> int:
    return os.cpu_count() or 0


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """n arrival times in ms of a Poisson process of `rate_per_s` requests per second, the first at 0
    (gaps drawn from Exp(rate), seeded: the same n, rate and seed give the same times).

        poisson_arrivals(3, 2.0) -> [0.0, t1, t2] with mean gap 500 ms
    """
    if n < 0 or not rate_per_s > 0:
        raise ValueError(f"need n >= 0 and a rate above 0 requests per second, got {n}, {rate_per_s!r}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate_per_s) * 1e3
        times.append(t)
    return times
