"""common/memory.py: the allocator settings the stage and coordinator processes start with."""
from __future__ import annotations

import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")

PROBE = """
from common.memory import tune_allocator
print(tune_allocator(), tune_allocator())
"""


@glibc
def test_tune_allocator_is_accepted_by_glibc_and_idempotent() -> None:
    # a fresh interpreter, so that nothing else has tuned this process
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["True", "True"]

