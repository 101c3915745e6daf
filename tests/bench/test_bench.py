"""`specpipe bench`: results.json holds the documented fields with values consistent with the run; plots are
PNG files; the transformers reference rows are timed."""
from __future__ import annotations

import json

import pytest

from coordinator.bench.common import BenchConfig, load_prompts, percentile
from coordinator.bench.run import run_bench, table
from helpers.reference import hf_greedy

REQUIRED = {"method", "stages", "concurrency", "tbt_ms_mean", "tbt_ms_p50", "tbt_ms_p90", "ttft_ms_mean",
            "tokens_per_step", "hit_rate", "throughput_tok_s", "steps", "tokens", "wall_s"}
PNG = b"\x89PNG\r\n\x1a\n"


def test_percentile_and_prompt_file(tmp_path):
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5 and percentile([5.0], 0.9) == 5.0
    assert len(load_prompts("", 0)) >= 30                          # the shipped set
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_prompts(str(bad), 0)


@pytest.mark.slow
async def test_bench_runs_methods_side_by_side(tiny_model8, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in ([5, 6, 7], [9, 10])))
    cfg = BenchConfig(stages=[2, 4], methods=["pp", "sps", "specpipe"], widths=[4], policies=["hybrid"],
                      stage_time_ms="0", max_new_tokens=6, prompts=str(prompts), num_prompts=0,
                      out=str(tmp_path / "out"), model=str(tiny_model8), sps_ks=[2, 3])
    result = await run_bench(cfg, log=lambda m: None)
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["rows"] == result["rows"] and on_disk["config"]["num_prompts_used"] == 2
    rows = {(r["label"], r["stages"]): r for r in result["rows"]}
    assert set(rows) == {(v, s) for v in ("pp", "sps/k2", "sps/k3", "specpipe/hybrid/w4") for s in (2, 4)}
    for r in rows.values():
        assert REQUIRED <= set(r) and r["tokens"] == 12 and r["requests"] == 2
        assert r["tbt_ms_p50"] <= r["tbt_ms_p90"] and r["wall_s"] > 0
        assert 0.0 <= r["overhead_share"] < 1.0 and r["overhead_ms_per_trip"] >= 0.0
    for s in (2, 4):
        assert rows[("pp", s)]["tokens_per_step"] == pytest.approx(1 / s)
        assert rows[("pp", s)]["hit_rate"] is None and 0 <= rows[("specpipe/hybrid/w4", s)]["hit_rate"] <= 1
    files = [tmp_path / "out" / "tbt.png", tmp_path / "out" / "tbt_vs_stages.png"]
    assert all(f.read_bytes()[:8] == PNG for f in files)
    assert "lower time between tokens than pp" in table(result)


@pytest.mark.slow
async def test_bench_concurrency_sweep(tiny_model8, tmp_path):
    """--concurrency 1,3 --methods cb-pp,specpipe: one row per (method, level) with every request counted,
    throughput over the level's wall time, and the two concurrency plots."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in ([5, 6, 7], [9, 10], [11])))
    cfg = BenchConfig(stages=[2], methods=["cb-pp", "specpipe"], widths=[4], policies=["hybrid"],
                      stage_time_ms="5", max_new_tokens=5, prompts=str(prompts), num_prompts=0,
                      out=str(tmp_path / "out"), model=str(tiny_model8), concurrency=[1, 3], rounds=2,
                      node_budget=8)
    result = await run_bench(cfg, log=lambda m: None)
    rows = {(r["label"], r["concurrency"]): r for r in result["rows"]}
    assert set(rows) == {(v, c) for v in ("cb-pp", "specpipe/hybrid/w4") for c in (1, 3)}
    for (label, c), r in rows.items():
        assert REQUIRED <= set(r) and r["requests"] == 2 * c and r["tokens"] == 5 * 2 * c
        assert r["throughput_tok_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert r["tbt_ms_p50"] <= r["tbt_ms_p90"] and r["ttft_ms_p50"] <= r["ttft_ms_p90"]
        phases = r["ttft_phases_ms"]                    # real processes report where the first token waited
        assert set(phases) == {"queue", "coordinator", "pipeline", "emit"} and min(phases.values()) >= 0
        assert sum(phases.values()) == pytest.approx(r["ttft_ms_mean"])
        assert phases["pipeline"] >= 2 * 5, "two stages of at least 5 ms each"
    assert rows[("cb-pp", 1)]["hit_rate"] is None and rows[("cb-pp", 1)]["tokens_per_step"] == pytest.approx(0.5)
    files = [tmp_path / "out" / n for n in ("throughput_vs_concurrency.png", "tbt_vs_concurrency.png")]
    assert all(f.read_bytes()[:8] == PNG for f in files)
    assert "the throughput of cb-pp" in table(result)


@pytest.mark.slow
async def test_bench_sampling_compares_verifiers(tiny_model8, tmp_path):
    """--temperature with --verifies match,rejection: one row per verifier; rejection ships the rows'
    distributions (vocabulary 256 x 4 bytes each), match one token per row."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}))
    cfg = BenchConfig(stages=[2], methods=["pp", "sps"], widths=[4], policies=["hybrid"], stage_time_ms="0",
                      max_new_tokens=6, prompts=str(prompts), num_prompts=0, out=str(tmp_path / "o"),
                      model=str(tiny_model8), temperature=0.8, verifies=["match", "rejection"])
    rows = {r["label"]: r for r in (await run_bench(cfg, log=lambda m: None))["rows"]}
    assert set(rows) == {"pp", "sps/match", "sps/rejection"}
    match, rejection = rows["sps/match"]["result_bytes_per_step"], rows["sps/rejection"]["result_bytes_per_step"]
    assert 0 < match < 256 * 4 < rejection, "a row's distribution is 1 KiB here; a token a few bytes"
    assert all(r["tokens"] == 6 for r in rows.values())


@pytest.mark.slow
def test_hf_reference_rows(tmp_path):
    from coordinator.bench.hf_reference import hf_rows
    from services.model.loader import ensure_default_model
    rows = hf_rows(str(ensure_default_model()), "quant", [{"prompt": "Say hi.", "raw": False}], 6)
    assert [r["label"] for r in rows] == ["hf-generate", "hf-assisted"]
    for r in rows:
        assert r["tokens"] == 6 and r["tbt_ms_mean"] > 0 and r["reference"] is True


def test_simulated_clock_matches_the_latency_model(tiny_model8, tmp_path):
    """pp on the simulated clock: every token is one trip of S stages of `a` ms plus S+1 hops, by hand:
    S=4, a=10 ms, hop 0.3 ms -> 4 * 10 + 5 * 0.3 = 41.5 ms between tokens, and the same to the first token."""
    from coordinator.bench.sim import run_simulated
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}))
    cfg = BenchConfig(stages=[4], methods=["pp", "specpipe"], widths=[4], policies=["hybrid"],
                      stage_time_ms="10", max_new_tokens=8, prompts=str(prompts), num_prompts=0,
                      out=str(tmp_path / "o"), model=str(tiny_model8), draft="quant",
                      control_time="0")   # the latency model alone: no measured time
    rows = {r["label"]: r for r in run_simulated(cfg, log=lambda m: None)["rows"]}
    assert rows["pp"]["tbt_ms_mean"] == pytest.approx(41.5) and rows["pp"]["ttft_ms_mean"] == pytest.approx(41.5)
    assert rows["pp"]["tokens_per_step"] == pytest.approx(0.25) and rows["pp"]["simulated"] is True
    assert rows["specpipe/hybrid/w4"]["tokens"] == 8


def test_specpipe_sweeps_topk_and_draft_rounds_and_rows_split_the_steps():
    from coordinator.bench.common import Variant, summarize
    cfg = BenchConfig(stages=[8], methods=["pp", "specpipe"], widths=[32, 64], policies=["hybrid"],
                      topks=[8, 16], draft_rounds=[2])
    labels = [v.label for v in cfg.variants]
    assert labels == ["pp", "specpipe/hybrid/w32/topk8/rounds2", "specpipe/hybrid/w32/topk16/rounds2",
                      "specpipe/hybrid/w64/topk8/rounds2", "specpipe/hybrid/w64/topk16/rounds2"]
    assert cfg.variants[2].overrides() == {"topk": 16, "draft_rounds": 2, "width": 32, "tree_policy": "hybrid"}
    runs = [{"tbt_ms": 100.0, "ttft_ms": 900.0, "wall_ms": 5000.0, "tokens": 11, "steps": 20, "decode_steps": 10,
             "lag_steps": 2, "refill_steps": 6, "warm_restarts": 1, "hits": 9, "misses": 2},
            {"tbt_ms": 120.0, "ttft_ms": 900.0, "wall_ms": 5000.0, "tokens": 21, "steps": 30, "decode_steps": 30,
             "lag_steps": 4, "refill_steps": 0, "warm_restarts": 0, "hits": 21, "misses": 0}]
    row = summarize(Variant("specpipe", 32, "hybrid"), 8, runs, (120.0, 0.0), cores=2)
    assert row["decode_tokens_per_step"] == pytest.approx((10 + 20) / (10 + 30))
    assert row["tokens_per_step"] == pytest.approx(32 / 50)
    assert (row["lag_steps"], row["refill_steps"], row["warm_restarts"]) == (3.0, 3.0, 0.5)
    assert row["ttft_phases_ms"] is None, "no request reported its phases (as on the simulated clock)"
    phases = [dict(queue=0.0, coordinator=10.0, pipeline=880.0, emit=10.0), dict(queue=100.0, coordinator=30.0,
                                                                               pipeline=760.0, emit=10.0)]
    for r, ph in zip(runs, phases):
        r.update({f"ttft_{k}_ms": v for k, v in ph.items()})
    row = summarize(Variant("specpipe", 32, "hybrid"), 8, runs, (120.0, 0.0), cores=2)
    assert row["ttft_phases_ms"] == {"queue": 50.0, "coordinator": 20.0, "pipeline": 820.0, "emit": 10.0}
    assert sum(row["ttft_phases_ms"].values()) == pytest.approx(row["ttft_ms_mean"])


def test_the_simulated_clock_runs_a_closed_loop_of_clients(tiny_model8, tiny_hf8):
    """`clients` = c: c requests at time 0, each later one arriving when an earlier one finishes (pp, S=2,
    a=10 ms, hop 0.3 ms: one request of 2 tokens takes 2 trips of 2 * 10 + 3 * 0.3 = 20.9 ms)."""
    import torch

    from coordinator.engine.loops.simulated import SimulatedPipeline
    from coordinator.core.schedulers.pp import PPScheduler
    from coordinator.core.schedulers.base import Request
    from services.model.shard import load_shard
    from services.runner import StageRunner
    runner = StageRunner(load_shard(str(tiny_model8), 0, None, torch.float32, "cpu"), 0)
    reqs = [Request(f"r{i}", [5 + i, 6, 7], 2) for i in range(4)]
    out = SimulatedPipeline([runner], (10.0, 0.0), num_stages=2, hop_ms=0.3).run(PPScheduler(2), reqs, clients=1)
    for i, r in enumerate(reqs):
        o = out[r.request_id]
        assert o.tokens == hf_greedy(tiny_hf8, r.prompt_ids, 2)
        assert o.end_ms - o.start_ms == pytest.approx(2 * 20.9)
        if i:
            assert o.start_ms == pytest.approx(out[reqs[i - 1].request_id].end_ms)     # one after another
    runner2 = StageRunner(load_shard(str(tiny_model8), 0, None, torch.float32, "cpu"), 0)
    two = SimulatedPipeline([runner2], (10.0, 0.0), num_stages=2, hop_ms=0.3).run(PPScheduler(2), reqs, clients=2)
    starts = sorted(o.start_ms for o in two.values())
    ends = sorted(o.end_ms for o in two.values())
    assert starts[:2] == [0.0, 0.0] and starts[2] == pytest.approx(ends[0]) and starts[3] == pytest.approx(ends[1])


def test_simulated_concurrency_sweep_rows(tiny_model8, tmp_path):
    from coordinator.bench.sim import run_simulated
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in ([5, 6, 7], [9, 9], [3, 4, 5, 6])))
    cfg = BenchConfig(stages=[4], methods=["cb-pp", "specpipe"], widths=[4], policies=["hybrid"],
                      stage_time_ms="10+0.5", max_new_tokens=6, prompts=str(prompts), num_prompts=0,
                      out=str(tmp_path / "o"), model=str(tiny_model8), draft="quant", concurrency=[1, 3], rounds=2)
    rows = run_simulated(cfg, log=lambda m: None)["rows"]
    assert [(r["concurrency"], r["method"]) for r in rows] == [(1, "cb-pp"), (1, "specpipe"), (3, "cb-pp"),
                                                                (3, "specpipe")]
    for r in rows:
        assert r["requests"] == 2 * r["concurrency"] and r["tokens"] == 6 * r["requests"]
        assert r["throughput_tok_s"] > 0 and r["ttft_ms_p90"] >= r["ttft_ms_p50"] > 0 and r["simulated"] is True
    by = {(r["concurrency"], r["method"]): r for r in rows}
    assert by[(3, "cb-pp")]["throughput_tok_s"] > by[(1, "cb-pp")]["throughput_tok_s"]   # batching pays


def test_request_rates_are_checked():
    base = dict(stages=[8], methods=["cb-pp"], widths=[4], policies=["hybrid"])
    with pytest.raises(ValueError, match="above 0"):
        BenchConfig(**base, request_rates=[1.0, 0.0])
    with pytest.raises(ValueError, match="not with --concurrency"):
        BenchConfig(**base, request_rates=[1.0], concurrency=[1, 4])
    assert BenchConfig(**base, request_rates=[0.5]).load and not BenchConfig(**base).load
    from coordinator.bench.run import config_from_args
    from coordinator.cli.main import build_parser
    args = build_parser().parse_args(["bench", "--methods", "cb-pp,specpipe", "--request-rate", "0.5, 2"])
    assert config_from_args(args).request_rates == [0.5, 2.0]
    with pytest.raises(ValueError, match="--request-rate '0.5,x' is not a comma-separated list"):
        config_from_args(build_parser().parse_args(["bench", "--request-rate", "0.5,x"]))


def test_simulated_request_rate_sweep_rows_and_plots(tiny_model8, tmp_path):
    """--request-rate 5,500 --rounds 2 over 3 prompts: per (rate, method) a row of all 6 requests, open loop;
    at 500 requests per second they arrive nearly at once and queue, so cb-pp's time to first token is longer
    than at 5 per second (mean gap 200 ms, an idle pipeline for most)."""
    from coordinator.bench.plots import plot
    from coordinator.bench.sim import run_simulated
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in ([5, 6, 7], [9, 9], [3, 4, 5, 6])))
    cfg = BenchConfig(stages=[4], methods=["cb-pp", "specpipe"], widths=[4], policies=["hybrid"],
                      stage_time_ms="10+0.5", max_new_tokens=6, prompts=str(prompts), num_prompts=0,
                      out=str(tmp_path / "o"), model=str(tiny_model8), draft="quant", request_rates=[5.0, 500.0],
                      rounds=2)
    result = run_simulated(cfg, log=lambda m: None)
    rows = result["rows"]
    assert [(r["request_rate"], r["method"]) for r in rows] == [(5.0, "cb-pp"), (5.0, "specpipe"),
                                                                (500.0, "cb-pp"), (500.0, "specpipe")]
    for r in rows:
        assert r["concurrency"] is None and r["requests"] == 6 and r["tokens"] == 36
        assert r["throughput_tok_s"] > 0 and r["ttft_ms_p90"] >= r["ttft_ms_p50"] > 0
    by = {(r["request_rate"], r["method"]): r for r in rows}
    assert by[(500.0, "cb-pp")]["ttft_ms_p50"] > by[(5.0, "cb-pp")]["ttft_ms_p50"]
    assert result["config"]["request_rates"] == [5.0, 500.0]
    (tmp_path / "o").mkdir()
    files = plot(result, tmp_path / "o")
    assert [f.name for f in files] == ["throughput_vs_rate.png", "tbt_vs_rate.png"]
    assert all(f.read_bytes()[:8] == PNG for f in files)
    text = table(result)
    assert "rate=500/s specpipe/hybrid/w4" in text and "time to first token p50" in text


@pytest.mark.slow
async def test_bench_request_rate_over_real_stages(tiny_model8, tmp_path):
    """--request-rate 20 --rounds 1 over real stage processes: each of the 3 prompts once, at Poisson times."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in ([5, 6, 7], [9, 10], [11])))
    cfg = BenchConfig(stages=[2], methods=["cb-pp", "specpipe"], widths=[4], policies=["hybrid"],
                      stage_time_ms="5", max_new_tokens=5, prompts=str(prompts), num_prompts=0,
                      out=str(tmp_path / "out"), model=str(tiny_model8), request_rates=[20.0], rounds=1,
                      node_budget=8)
    result = await run_bench(cfg, log=lambda m: None)
    for r in result["rows"]:
        assert REQUIRED <= set(r) and r["request_rate"] == 20.0 and r["concurrency"] is None
        assert r["requests"] == 3 and r["tokens"] == 15
        assert r["throughput_tok_s"] == pytest.approx(r["tokens"] / r["wall_s"])
    files = [tmp_path / "out" / n for n in ("throughput_vs_rate.png", "tbt_vs_rate.png")]
    assert all(f.read_bytes()[:8] == PNG for f in files)
    assert "rate=20/s specpipe" in table(result)


def test_a_simulated_run_shows_where_its_step_goes(tmp_path):
    from coordinator.bench.plots import plot, step_parts
    row = {"label": "specpipe", "stages": 8, "simulated": True, "tbt_ms_mean": 8.0, "tbt_ms_p90": 9.0,
           "tokens_per_step": 0.7, "decode_tokens_per_step": 0.8, "emulated_stage_ms": 5.8,
           "control_ms_per_step_p50": 1.2, "draft_ms_per_step_p50": 3.3}
    assert step_parts(row, 0.5) == {"stage": 5.8, "hop": 0.5, "control": 1.2, "draft": 3.3, "step": 8.0 * 0.8}
    files = plot({"config": {"hop_ms": 0.5, "stage_time_ms": "5+0.025", "emulated_stage_time": True},
                  "rows": [row, {**row, "label": "pp", "control_ms_per_step_p50": 0.05,
                                 "draft_ms_per_step_p50": None}]}, tmp_path)
    assert [f.name for f in files] == ["tbt.png", "step_time.png"]
    assert (tmp_path / "step_time.png").read_bytes().startswith(PNG)
