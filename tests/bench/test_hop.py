"""`specpipe bench-hop`: one stage hop over real gRPC between two processes, and its report."""
from __future__ import annotations

import json

import pytest

from coordinator.bench.hop import main as hop_main
from coordinator.cli.main import build_parser

pytestmark = pytest.mark.grpc


def hop(*argv: str) -> int:
    """`specpipe bench-hop ARGV` without the CLI's logging set-up (it would bind the test's captured stderr)."""
    return hop_main(build_parser().parse_args(["bench-hop", *argv]))


def test_bench_hop_reports_every_part_of_a_hop(capsys):
    assert hop("--rows", "3", "--hidden", "16", "--dtype", "bfloat16", "--count", "4", "--warmup", "1",
               "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["rows"], result["hidden"], result["dtype"], result["count"]) == (3, 16, "bfloat16", 4)
    assert result["bytes"] == 3 * 16 * 2 and result["allocator"] == "tuned"
    for part in ("encode_ms", "wire_ms", "decode_ms", "hop_ms"):
        assert 0 <= result[part]["p50"] <= result[part]["p99"], part
    assert result["hop_ms"]["p99"] >= result["wire_ms"]["p50"]     # a hop holds its wire time


def test_bench_hop_refuses_a_hop_without_rows():
    with pytest.raises(ValueError, match="--rows and --hidden must be >= 1"):
        hop("--rows", "0")
