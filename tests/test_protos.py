"""The committed generated code is exactly what protos/gen.py produces."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_regenerating_protos_changes_nothing(tmp_path):
    work = tmp_path / "repo"
    (work / "protos").mkdir(parents=True)
    for f in (ROOT / "protos").glob("*.proto"):
        shutil.copy(f, work / "protos" / f.name)
    shutil.copy(ROOT / "protos" / "gen.py", work / "protos" / "gen.py")
    subprocess.run([sys.executable, str(work / "protos" / "gen.py")], check=True)
    generated = sorted(p.name for p in (work / "protos").iterdir() if "_pb2" in p.name)
    committed = sorted(p.name for p in (ROOT / "protos").iterdir() if "_pb2" in p.name)
    assert generated == committed
    for name in generated:
        assert (work / "protos" / name).read_bytes() == (ROOT / "protos" / name).read_bytes(), \
            f"protos/{name} is stale: run `make protos` and commit"


def test_message_size_limits_are_explicit():
    from common.grpc_server import channel_options, server_options
    for opts in (channel_options(1234), server_options(1234)):
        d = dict(opts)
        assert d["grpc.max_send_message_length"] == 1234 and d["grpc.max_receive_message_length"] == 1234
