"""The tiers, by marker (declared in pyproject.toml): `make test` runs everything but `timing` (wall-clock
checks, `make test-timing`); `make test-fast`, the edit loop, runs `-m "not slow and not timing and (not grpc
or smoke)"` — it leaves out what is `slow` and what runs real gRPC servers or processes (`grpc`) except the
few `smoke` tests among those.

A test matrix keeps its breadth in `make test` and one case per value of each axis in `make test-fast`:

    @pytest.mark.parametrize("draft, num_stages", matrix(["quant", "ngram", "right"], [1, 2, 4, 8]))
    # 12 cases; fast: (quant, 1), (ngram, 2), (right, 4), (quant, 8) — the diagonal, wrapping round
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import pytest


def matrix(*axes: Sequence[Any], fast: Iterable[tuple[Any, ...]] | None = None) -> list[Any]:
    """Every combination of the axes as parameters, the rows of `fast` (default: the diagonal, case i being
    (axis[i % len(axis)] for each axis), i < the longest axis) unmarked and every other one marked slow."""
    cases = list(itertools.product(*axes))
    longest = max(len(a) for a in axes)
    keep = set(fast) if fast is not None else {tuple(a[i % len(a)] for a in axes) for i in range(longest)}
    assert keep <= set(cases), f"fast cases outside the matrix: {keep - set(cases)}"
    return [pytest.param(*case, marks=() if case in keep else pytest.mark.slow) for case in cases]
