"""`specpipe bench --repeats N` (coordinator/bench/repeats.py): the median run reported, every run's figures kept,
specpipe's side-by-side ratio taken run by run — on hand-made rows."""
from __future__ import annotations

import json

import pytest

from coordinator.bench.common import BenchConfig
from coordinator.bench.repeats import combine, side_by_side, spreads


def _row(label: str, method: str, tbt: float, tput: float = 100.0, concurrency: int = 1, ctl: float | None = None):
    return {"label": label, "method": method, "stages": 8, "concurrency": concurrency, "tbt_ms_mean": tbt,
            "tbt_ms_p50": tbt - 0.1, "throughput_tok_s": tput, "control_ms_per_step_p50": ctl}


def _run(spec_tbt: float, pi_tbt: float, spec_tput: float = 100.0, cb_tput: float = 50.0) -> dict:
    return {"config": {"repeats": 3}, "rows": [
        _row("pipeinfer", "pipeinfer", pi_tbt), _row("specpipe/hybrid/wauto", "specpipe", spec_tbt, ctl=spec_tbt / 3),
        _row("cb-pp", "cb-pp", 9.0, cb_tput, concurrency=8),
        _row("specpipe/hybrid/wauto", "specpipe", 4.0, spec_tput, concurrency=8)]}


def test_the_median_run_is_reported_with_every_runs_figures():
    runs = [_run(2.6, 3.7, 300.0), _run(2.5, 3.8, 320.0), _run(2.8, 3.7, 310.0)]
    rows = combine(runs)["rows"]
    pipeinfer, spec, _, loaded = rows
    assert spec["tbt_ms_mean"] == 2.6 and spec["control_ms_per_step_p50"] == pytest.approx(2.6 / 3)   # run 1's row
    assert spec["runs"]["tbt_ms_mean"] == [2.6, 2.5, 2.8]
    assert spec["runs"]["tbt_ms_p50"] == pytest.approx([2.5, 2.4, 2.7])
    assert pipeinfer["tbt_ms_mean"] == 3.7 and pipeinfer["runs"]["tbt_ms_mean"] == [3.7, 3.8, 3.7]
    assert loaded["throughput_tok_s"] == 310.0, "under load the median by throughput: 300, 320, 310 -> 310"
    assert combine(runs[:2])["rows"][1]["tbt_ms_mean"] == 2.5, "an even count: the lower middle run"
    assert combine(runs[:1]) is runs[0], "one run: as it is"


def test_ratios_are_taken_within_each_run_and_their_median_reported():
    rows = combine([_run(2.6, 3.7, 300.0), _run(2.5, 3.8, 320.0), _run(2.8, 3.7, 310.0)])["rows"]
    lines = side_by_side(rows)
    one = [line for line in lines if "against pipeinfer" in line]
    # 3.7 / 2.6 = 1.423, 3.8 / 2.5 = 1.52, 3.7 / 2.8 = 1.321: the median of these, not 3.7 / 2.6 of the medians
    assert len(one) == 1 and "1.42x, 1.52x, 1.32x lower time between tokens (median 1.42x, spread 1.32-1.52x)" in one[0]
    load = [line for line in lines if "against cb-pp" in line]
    assert len(load) == 1 and "6.00x, 6.40x, 6.20x the throughput (median 6.20x" in load[0]
    assert not any("against pipeinfer" in line and "c=8" in line for line in lines)
    assert len(lines) == 2, "one client against one client, load against load only"
    assert any("3 runs, time between tokens 2.60, 2.50, 2.80 ms; control p50 0.87, 0.83, 0.93 ms" in line
               for line in spreads(rows))
    assert side_by_side(_run(2.6, 3.7)["rows"]) == [] and spreads(_run(2.6, 3.7)["rows"]) == []


def test_runs_with_other_rows_are_refused():
    other = _run(2.5, 3.8)
    other["rows"] = other["rows"][:2]
    with pytest.raises(ValueError, match="run 2 has other rows"):
        combine([_run(2.6, 3.7), other])
    with pytest.raises(ValueError, match="no bench run"):
        combine([])
    with pytest.raises(ValueError, match="--repeats 0 must be at least 1"):
        BenchConfig(stages=[2], methods=["pp"], widths=[8], policies=["hybrid"], repeats=0)


def test_the_cli_runs_the_bench_n_times_and_reports_each_run(tiny_model8, tmp_path, capsys, monkeypatch):
    """Through `specpipe bench`: two runs on the deterministic clock (no control time charged) give the same
    figures twice: pp's 4 x 10 + 5 x 0.3 = 41.5 ms between tokens, by hand."""
    import torch

    import coordinator.cli.main as cli
    # (in this process: no logging set up on the captured stderr, which later tests would log to once closed;
    # nor this process's allocator and torch threads changed)
    monkeypatch.setattr(cli, "configure", lambda **kw: None)
    monkeypatch.setattr(cli, "tune_allocator", lambda: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    main = cli.main
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}))
    out = tmp_path / "o"
    assert main(["bench", "--simulate", "--stages", "4", "--methods", "pp,specpipe", "--widths", "4",
                 "--stage-time-ms", "10", "--max-new-tokens", "8", "--prompts", str(prompts), "--num-prompts", "0",
                 "--out", str(out), "--model", str(tiny_model8), "--control-time", "0", "--repeats", "2"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["config"]["repeats"] == 2
    pp, spec = result["rows"]
    assert pp["runs"]["tbt_ms_mean"] == pytest.approx([41.5, 41.5])
    assert spec["runs"]["tbt_ms_mean"][0] == spec["runs"]["tbt_ms_mean"][1] == spec["tbt_ms_mean"]
    text = capsys.readouterr().out
    assert "S=4 pp: 2 runs, time between tokens 41.50, 41.50 ms" in text
    assert "S=4 specpipe/hybrid/w4 against pp, 2 runs:" in text
