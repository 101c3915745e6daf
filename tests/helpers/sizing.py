"""Observations for the cost rule (coordinator/core/sizing.py) as a pipeline with given costs would give them."""
from __future__ import annotations

import random

from coordinator.core.sizing import Sizer


def teach(sizer: Sizer, stage: tuple[float, float], hop: float, draft: tuple[float, float], ctl: float,
          tokens: float, ranks: list[int], injected: int = 4) -> None:
    """Observations as a pipeline with these costs (ms) would give them, speculating."""
    for rows in (1, 32, 256):
        sizer.observe_stage(rows, stage[0] + stage[1] * rows)
        sizer.observe_draft(rows, draft[0] + draft[1] * rows)
    for _ in range(8):
        sizer.observe_hop(hop)
        sizer.observe_control(ctl)
        sizer.observe_tokens(tokens)
    for rank in ranks:
        sizer.observe_root(rank, injected)


def pace(sizer: Sizer, ms_per_token: float, results: int = 40) -> None:
    """Results one token apart, `ms_per_token` apart, under the choice in use."""
    for t in range(results):
        sizer.observe_result(ms_per_token * (t + 1), 1)


def ranks(counts: list[int]) -> list[int]:
    """Ranks as seen at roots: counts[r] times rank r (the last entry: not proposed, -1)."""
    *proposed, unproposed = counts
    ranks = [r for r, n in enumerate(proposed) for _ in range(n)] + [-1] * unproposed
    random.Random(0).shuffle(ranks)                   # (in time order the oldest fade most)
    return ranks
