"""Programs for common/forkserver.py's tests to fork: each reports what it sees as a process.

    launch("helpers.forked:report", ["a"], env, log, preload=("helpers.forked",))   # exits 3
"""
from __future__ import annotations

import json
import os
import sys
import time

IMPORTED_IN = os.getpid()           # the fork server's pid when it preloaded this module


def report(argv: list[str]) -> int:
    """Print (to stdout, and a line to stderr) the argv, working directory, environment variable
    FORKED_GREETING, session, parent, and the process that imported this module; exit 3."""
    print(json.dumps({"argv": argv, "cwd": os.getcwd(), "greeting": os.environ.get("FORKED_GREETING"),
                      "pid": os.getpid(), "sid": os.getsid(0), "ppid": os.getppid(),
                      "imported_in": IMPORTED_IN}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    return 3


def sleep(argv: list[str]) -> int:
    """Print this process's parent, then sleep until killed (at most argv[0] seconds)."""
    print(json.dumps({"ppid": os.getppid()}), flush=True)
    time.sleep(float(argv[0]))
    return 0
