"""Every `>>>` example in the packages runs, and says what it shows (doctest)."""
from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WITH_EXAMPLES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for pkg in ("coordinator", "services", "common", "client") for p in (ROOT / pkg).rglob("*.py")
    if ">>> " in p.read_text())


def test_the_packages_have_examples():
    assert len(WITH_EXAMPLES) >= 15, WITH_EXAMPLES


@pytest.mark.parametrize("module", WITH_EXAMPLES)
def test_examples_run(module):
    result = doctest.testmod(importlib.import_module(module),
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{module} has `>>> ` text that doctest does not find"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {module} fail"
