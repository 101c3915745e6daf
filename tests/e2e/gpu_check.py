"""`make gpu-check`: the checks that need a GPU, in one run, with one summary (issue 17).

1. Shard equivalence: our stages (2 shards) against transformers' own greedy decoding, same model, dtype and
   device — tokens in agreement and the first position where they part (bf16: reassociation can flip a
   near-tie; fp32: must be identical).
2. Every method over 1, 2 and 4 stage processes on this one GPU, against the same transformers reference.
3. A short `specpipe bench` with real GPU stage time (no emulation): time between tokens of pp and specpipe.
Writes DIR/gpu_check.json and prints the summary. Exit status 0 when every fp32 comparison is exact (bf16
comparisons are reported, not judged), 2 when there is no CUDA device (unless --device cpu, the smoke mode
that CI runs on the tiny model).

    make gpu-check                               # default model, bf16, cuda
    python tests/e2e/gpu_check.py --device cpu --dtype float32 --model PATH --quick
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from coordinator.config import CoordinatorConfig  # noqa: E402
from coordinator.engine.loops.inprocess import InProcessPipeline  # noqa: E402
from coordinator.engine.local import LocalStages  # noqa: E402
from coordinator.core.schedulers.base import Request  # noqa: E402
from coordinator.core.schedulers.pp import PPScheduler  # noqa: E402
from coordinator.core.vocabulary import METHODS  # noqa: E402
from coordinator.frontends.service import Coordinator, GenerateInput  # noqa: E402
from services.config import parse_dtype  # noqa: E402
from services.model.loader import resolve_model, stderr_log  # noqa: E402
from services.model.shard import even_split, load_shard  # noqa: E402
from services.runner import StageRunner  # noqa: E402

PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365], [1, 4093, 198, 4898, 536, 7680, 1381, 98, 47, 2]]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def reference(model: str, dtype: torch.dtype, device: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    del hf
    return out


def shard_check(model: str, dtype: torch.dtype, device: str, prompts: list[list[int]], n: int,
                want: list[list[int]]) -> dict:
    from transformers import AutoConfig
    layers = AutoConfig.from_pretrained(model).num_hidden_layers
    runners = [StageRunner(load_shard(model, a, b, dtype, device), i) for i, (a, b) in enumerate(even_split(layers, 2))]
    reqs = [Request(f"r{i}", p, n) for i, p in enumerate(prompts)]
    out = InProcessPipeline(runners).run(PPScheduler(2), reqs)
    got = [out[r.request_id].tokens for r in reqs]
    return {"agree": sum(g == w for g, w in zip(got, want)), "of": len(want),
            "first_difference": [first_difference(g, w) for g, w in zip(got, want)]}


async def methods_check(model: str, dtype: str, device: str, depths: list[int], methods: list[str],
                        prompts: list[list[int]], n: int, want: list[list[int]]) -> list[dict]:
    rows = []
    for depth in depths:
        stages = LocalStages(depth, model=model, dtype=dtype, device=device)
        stages.start()
        try:
            await stages.wait_ready()
            coord = await Coordinator.connect(CoordinatorConfig(stages=tuple(stages.addresses), model=model,
                                                                draft_device=device, max_new_tokens_cap=4096))
            try:
                for method in methods:
                    got, tbt = [], []
                    for p in prompts:
                        toks, tbt_ms = [], 0.0
                        async for c in coord.generate(GenerateInput(prompt_token_ids=p, max_new_tokens=n,
                                                                    method=method, ignore_eos=True)):
                            toks += c.token_ids
                            tbt_ms = c.stats.tbt_ms if c.stats else tbt_ms
                        got.append(toks)
                        tbt.append(tbt_ms)
                    rows.append({"stages": depth, "method": method, "agree": sum(g == w for g, w in zip(got, want)),
                                 "of": len(want), "first_difference": [first_difference(g, w) for g, w in zip(got, want)],
                                 "tbt_ms": round(sum(tbt) / len(tbt), 2)})
                    print(f"  S={depth} {method:10s} agree {rows[-1]['agree']}/{len(want)}  tbt {rows[-1]['tbt_ms']} ms",
                          flush=True)
            finally:
                await coord.close()
        finally:
            stages.stop()
    return rows


def bench(model: str, dtype: str, device: str, out: Path, quick: bool) -> dict:
    cmd = [sys.executable, "-m", "coordinator.cli.main", "bench", "--model", model, "--dtype", dtype, "--device", device,
           "--stages", "2" if quick else "4", "--stage-time-ms", "0", "--methods", "pp,specpipe",
           "--num-prompts", "1" if quick else "4", "--max-new-tokens", "8" if quick else "32", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    rows = json.loads((out / "results.json").read_text())["rows"]
    return {r["method"]: round(r["tbt_ms_mean"], 2) for r in rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quick", action="store_true", help="S in {1, 2}, pp and specpipe, 8 tokens (smoke test)")
    p.add_argument("--out", default="out/gpu-check")
    a = p.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    started = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(a.model, log=stderr_log)
    dtype = parse_dtype(a.dtype)
    n = 8 if a.quick else 32
    prompts = [[t % 250 + 3 for t in q] for q in PROMPTS] if a.quick else PROMPTS
    want = reference(model, dtype, a.device, prompts, n)
    summary = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
               "dtype": a.dtype, "model": model, "tokens": n}
    summary["shards_vs_transformers"] = shard_check(model, dtype, a.device, prompts, n, want)
    print("shards vs transformers:", summary["shards_vs_transformers"], flush=True)
    methods = ["pp", "specpipe"] if a.quick else list(METHODS)
    summary["methods"] = asyncio.run(methods_check(model, a.dtype, a.device, [1, 2] if a.quick else [1, 2, 4],
                                                   methods, prompts, n, want))
    summary["bench_tbt_ms"] = bench(model, a.dtype, a.device, out / "bench", a.quick)
    summary["seconds"] = round(time.monotonic() - started, 1)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    exact = summary["shards_vs_transformers"]["agree"] == len(want) and all(r["agree"] == r["of"] for r in summary["methods"])
    if a.dtype == "float32" and not exact:
        print("gpu-check: fp32 output differs from transformers", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
