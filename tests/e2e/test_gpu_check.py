"""`make gpu-check` stays ready to run: its smoke mode (CPU, fp32, the tiny model with a byte tokenizer, S in
{1, 2}, pp and specpipe, and a short bench) must pass here, where every comparison is exact."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.reference import byte_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_check_runs_in_smoke_mode(tiny_model8, tmp_path):
    model = tmp_path / "tiny8-chat"
    shutil.copytree(tiny_model8, model)
    byte_tokenizer().save_pretrained(model)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "gpu_check.py"), "--device", "cpu",
                          "--dtype", "float32", "--model", str(model), "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["shards_vs_transformers"]["agree"] == 2
    assert [(r["stages"], r["method"], r["agree"]) for r in summary["methods"]] == [
        (1, "pp", 2), (1, "specpipe", 2), (2, "pp", 2), (2, "specpipe", 2)]
    assert set(summary["bench_tbt_ms"]) == {"pp", "specpipe"} and all(v > 0 for v in summary["bench_tbt_ms"].values())
