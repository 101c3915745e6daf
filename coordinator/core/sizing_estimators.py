"""What the cost rule (coordinator/core/sizing.py `Sizer`) measures with: small online estimators, each fed
one sample at a time from the scheduler's events, none with a clock of its own.

- `Ewma(alpha)`: an exponentially weighted mean; `value` is None until the first sample, `n` counts samples.
- `Line(alpha)`: y ~ a + b * x for a cost against rows (a stage step, a draft round). Samples go into
  buckets of x by powers of two (int(log2 x)), each bucket an exponentially weighted mean of (x, y), and the
  line is least squares over the bucket means, so a rare large x (a prompt chunk) keeps its say beside many
  small ones. The fit is cached until the next sample. Contract: one bucket -> flat (a = its mean y, b = 0:
  fewer rows are not cheaper without evidence); a slope below 0 (noise) -> flat at the mean y; an intercept
  below 0 -> through the origin (a = 0, b = sum(x y) / sum(x x)); no sample -> (0, 0), `known` False.
- `Pace(decay)`: committed tokens per ms as measured, fading sums of tokens and of the time between results
  (`rate` = tokens / ms, 0 before any time).
- `Costs`: what a pipeline step costs in one mode (speculating or not): the stage `Line`, the hop and
  control `Ewma`s; `known` once the stage line has a sample and the hop four.
- `Coverage(largest)`: the ranks the target's token took among the draft's proposals at the roots, and the
  smallest topk (4, 8, 16, ...) whose first ranks hold COVER of them (the rule's step 4). Only ranks seen
  while the largest topk was in use are counted (below it a rank beyond topk reads "not proposed": censored);
  below it the share not proposed is watched, and when it exceeds what the counts said by 1 - COVER they are
  forgotten (`add` returns True) and `topk` is the largest until COVER_SEEN ranks are seen again.

Worked example:

    line = Line(); line.add(1, 5.0); line.add(32, 5.8)   # buckets 0 and 5
    line.coefficients() -> (4.97, 0.026);  line(16) -> 5.39
    pace = Pace(0.5); pace.add(2, 10.0); pace.add(1, 10.0)  # tokens 0.5*2 + 1 = 2, ms 0.5*10 + 10 = 15
    pace.rate -> 0.133 tokens per ms
    cov = Coverage(16)   # ranks 0, 1, 2, 3, 4, 5, 6 seen 72, 15, 6, 3, 2, 1, 1 times at topk 16, mixed in time
    cov.topk() -> 4      # (72 + 15 + 6 + 3) / 100 = 0.96 >= COVER (fading aside); a flat draft keeps 16
"""
from __future__ import annotations

import math

import numpy as np

COVER = 0.95          # Coverage: the smallest topk whose first ranks hold this share of the proposed ones
COVER_SEEN = 32       # ... once this many ranks were seen at the largest topk
MIN_TOPK = 4          # ... from this one up, doubling
FADE = 0.995          # ranks fade by this much per rank seen


class Ewma:
    """An exponentially weighted mean; None until the first sample."""

    def __init__(self, alpha: float) -> None:
        self.alpha, self.value, self.n = alpha, None, 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.n += 1


class Line:
    """y ~ a + b * x, least squares over buckets of x (powers of two), each bucket an exponentially weighted
    mean: a prefill chunk of 200 rows seen once keeps its say beside a thousand 32-row steps. With a single
    bucket the line is flat (the cautious guess: narrowing buys nothing until rows are seen to cost).

        line = Line(); line.add(1, 5.0); line.add(32, 5.8)  ->  line(16) = 5.39 (a = 4.97, b = 0.026)
    """

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.buckets: dict[int, tuple[float, float]] = {}      # bucket -> (mean x, mean y)
        self._fit: tuple[float, float] | None = None            # (a, b), until the next sample

    def add(self, x: float, y: float) -> None:
        key = int(math.log2(max(x, 1.0)))
        old = self.buckets.get(key)
        self.buckets[key] = (x, y) if old is None else \
            (old[0] + self.alpha * (x - old[0]), old[1] + self.alpha * (y - old[1]))
        self._fit = None

    @property
    def known(self) -> bool:
        return bool(self.buckets)

    def coefficients(self) -> tuple[float, float]:
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        xs = np.array([v[0] for v in self.buckets.values()])
        ys = np.array([v[1] for v in self.buckets.values()])
        if len(xs) < 2:                   # one bucket: flat (fewer rows are not cheaper without evidence)
            return (float(ys[0]), 0.0) if len(xs) else (0.0, 0.0)
        mx, my = xs.mean(), ys.mean()
        b = float(((xs - mx) * (ys - my)).sum() / ((xs - mx) ** 2).sum())
        if b < 0:                         # noise: the cost does not fall with rows
            return float(my), 0.0
        a = float(my - b * mx)
        if a < 0:                         # nothing is cheaper than free: through the origin instead
            return 0.0, float((xs * ys).sum() / (xs * xs).sum())
        return a, b

    def __call__(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


class Pace:
    """Committed tokens per ms as measured: fading sums of tokens and of the time between results."""

    def __init__(self, decay: float) -> None:
        self.decay, self.tokens, self.ms, self.n = decay, 0.0, 0.0, 0

    def add(self, tokens: int, ms: float) -> None:
        self.tokens = self.decay * self.tokens + tokens
        self.ms = self.decay * self.ms + ms
        self.n += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0


class Costs:
    """What a pipeline step costs in one mode (speculating or not: on a machine whose stages share cores the
    stages run slower beside the draft than alone)."""

    def __init__(self) -> None:
        self.stage, self.hop, self.ctl = Line(), Ewma(0.1), Ewma(0.1)

    @property
    def known(self) -> bool:
        return self.stage.known and self.hop.n >= 4


class Coverage:
    """Which topk covers the ranks the target takes among the draft's proposals (module docstring)."""

    def __init__(self, largest: int, ranks: int = 64) -> None:
        self.largest = largest
        self.full = np.zeros(ranks + 1)           # fading counts by rank at the largest topk; [-1]: not proposed
        self.unproposed = Ewma(0.05)              # below it: 1 where the target was not proposed

    def add(self, rank: int, topk: int) -> bool:
        """A root's target had `rank` among the proposals (-1: not among them) under `topk`. True when the
        ranks have moved (below the largest topk, more go unproposed than the counts allow): forgotten."""
        if topk >= self.largest:
            self.full *= FADE
            self.full[rank if 0 <= rank < len(self.full) - 1 else -1] += 1
            return False
        self.unproposed.add(float(rank < 0))
        total = self.full.sum()
        expected = 1 - self.full[:topk].sum() / total if total > 0 else 0.0
        if self.unproposed.n < COVER_SEEN or self.unproposed.value <= expected + (1 - COVER):
            return False
        self.full[:] = 0
        self.unproposed = Ewma(0.05)
        return True

    def topk(self) -> int:
        """The smallest of MIN_TOPK, 2 MIN_TOPK, ... whose first ranks hold COVER of those proposed (ranks below
        the largest); the largest until COVER_SEEN ranks were seen."""
        proposed = self.full[:self.largest].sum()
        if self.full.sum() < COVER_SEEN or proposed <= 0:
            return self.largest
        k = MIN_TOPK
        while k < self.largest and self.full[:k].sum() < COVER * proposed:
            k *= 2
        return min(k, self.largest)
