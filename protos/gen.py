"""The only generator of protos/*_pb2*.py. Run from anywhere: `python protos/gen.py`.

Module names follow the .proto path relative to the repository root (`-I .`), so the generated code
imports `protos.common_pb2` absolutely and works from a fresh clone without a build step.
"""
from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").glob("*.proto"))


def main() -> int:
    args = ["grpc_tools.protoc", "-I", str(ROOT), f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", *PROTOS]
    rc = protoc.main(args)
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
