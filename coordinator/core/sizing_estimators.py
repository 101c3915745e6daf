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
- `Coverage(largest, smallest)`: the ranks the target's token took among the draft's proposals at the roots, and the
  smallest topk (MIN_TOPK = 2, 4, 8, 16, ...; from CHAIN_TOPK = 1 where stages share the draft's cores) whose first
  ranks hold COVER of those the largest topk proposes (the rule's step 4). Under a topk below the largest a rank
  beyond it reads "not proposed": the counts are a survival estimate under that censoring (Kaplan-Meier), so every
  root counts at any topk, and a topk can come down from 8 to 4 without measuring at 16 again. The topk in use is
  kept until its coverage is below COVER by HOLD_Z standard errors. What lies beyond the topk in use cannot be seen,
  so below the largest the roots left unproposed are also checked against what the counts allow (S(topk), and 1 -
  COVER more): more than that by SHIFT_Z standard deviations of a binomial count is a shift, the counts are
  forgotten (`add` returns True) and the largest topk measures them again (COVER_SEEN roots).

Worked example:

    line = Line(); line.add(1, 5.0); line.add(32, 5.8)   # buckets 0 and 5
    line.coefficients() -> (4.97, 0.026);  line(16) -> 5.39
    pace = Pace(0.5); pace.add(2, 10.0); pace.add(1, 10.0)  # tokens 0.5*2 + 1 = 2, ms 0.5*10 + 10 = 15
    pace.rate -> 0.133 tokens per ms
    cov = Coverage(16)   # ranks 0, 1, 2, 3, 4, 5, 6 seen 72, 15, 6, 3, 2, 1, 1 times at topk 16, mixed in time
    cov.topk(16) -> 4    # (72 + 15 + 6 + 3) / 100 = 0.96 >= COVER (fading aside); a flat draft keeps 16
"""
from __future__ import annotations

import math

import numpy as np

COVER = 0.90          # Coverage: the smallest topk whose first ranks hold this share of the proposed ones
COVER_SEEN = 32       # ... once this many roots were counted (and below the largest, before a shift)
MIN_TOPK = 2          # ... from this one up, doubling: a hedge below every node (coordinator/core/calibration.py),
CHAIN_TOPK = 1        # or from this one where the draft's rows take the stages' cores (`Coverage(smallest=)`)
FADE = 0.995          # rank counts fade by this much per root that could see them
FADE_BELOW = 0.99     # below the largest topk, unproposed roots and what the counts allow of them fade by this
SHIFT_Z = 3.0         # ... and a shift is this many standard deviations more unproposed than allowed
HOLD_Z = 2.0          # ... the topk in use is kept until its ranks hold COVER less this many standard errors


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
    """Which topk covers the ranks the target takes among the draft's proposals (module docstring).

    A discrete survival estimate under censoring (Kaplan-Meier): at a root under topk k, ranks 0..k-1 can be
    seen and "not proposed" only says rank >= k. `hits[r]` counts roots whose target took rank r, `risk[r]`
    those at which rank r could be seen and had not been taken before it; rank r's hazard is hits / risk, and
    P(rank >= k) = S(k) = prod over r < k of (1 - hazard). Counts fade only where a root could see them, so
    ranks beyond the topk in use keep what was last seen of them.

        topk 16, 100 roots: ranks 0..6 taken 72, 15, 6, 3, 2, 1, 1 times -> S(4) = 0.04, S(16) = 0,
        coverage(4) = (1 - S(4)) / (1 - S(16)) = 0.96 -> topk 4
        then at topk 4 a quarter of the roots go unproposed: S(4) climbs towards 0.25, coverage(4) falls
        below COVER by more than HOLD_Z standard errors (0.06 at 100 roots), and the ranks last seen beyond 4
        (all by rank 6) make it 8 (or, sooner, the shift check forgets the counts and topk 16 measures again)
    """

    def __init__(self, largest: int, ranks: int = 64, smallest: int = MIN_TOPK) -> None:
        self.largest = min(largest, ranks)
        self.smallest = min(smallest, self.largest)   # the smallest topk chosen
        self.hits = np.zeros(self.largest)        # fading, by rank: roots whose target took it
        self.risk = np.zeros(self.largest)        # fading, by rank: roots that could see it, not taken before
        self.below = np.zeros(3)                  # below the largest, fading: unproposed, allowed, variance
        self.below_seen = 0                       # ... roots seen below it since the counts were last forgotten

    def add(self, rank: int, topk: int) -> bool:
        """A root's target had `rank` among the proposals under `topk` (-1 or >= topk: not among them). True
        when, below the largest, more roots go unproposed than the counts allow (a shift): forgotten."""
        seen = min(topk, self.largest)
        if seen < self.largest and self._shifted(rank < 0 or rank >= seen, seen):
            self.hits[:], self.risk[:], self.below[:], self.below_seen = 0, 0, 0, 0
            return True
        self.hits[:seen] *= FADE
        self.risk[:seen] *= FADE
        if 0 <= rank < seen:
            self.hits[rank] += 1
            self.risk[:rank + 1] += 1
        else:
            self.risk[:seen] += 1
        return False

    def _shifted(self, unproposed: bool, topk: int) -> bool:
        """The ranks beyond topk cannot be seen below the largest, so what was last seen of them may be stale:
        a shift is more roots unproposed than the counts expect (S(topk)) and 1 - COVER more, by SHIFT_Z
        standard deviations of a binomial count (fading by FADE_BELOW)."""
        q = min(self.survival(topk) + 1 - COVER, 1.0)
        self.below *= FADE_BELOW
        self.below += (float(unproposed), q, q * (1 - q))
        self.below_seen += 1
        excess = self.below[0] - self.below[1]
        return self.below_seen >= COVER_SEEN and excess > SHIFT_Z * math.sqrt(self.below[2])

    def survival(self, k: int) -> float:
        """S(k): the share of roots whose target is not among the first k ranks (1.0 before any root)."""
        hazard = np.divide(self.hits[:k], self.risk[:k], out=np.zeros(k), where=self.risk[:k] > 0)
        return float(np.prod(1 - hazard))

    def covered(self, k: int) -> float:
        """The share of the target's tokens proposed at the largest topk that the first k ranks hold."""
        proposed = 1 - self.survival(self.largest)
        return (1 - self.survival(min(k, self.largest))) / proposed if proposed > 0 else 0.0

    def topk(self, current: int) -> int:
        """The smallest of `smallest`, 2 `smallest`, ... whose first ranks hold COVER of those proposed; the one in
        use is kept until it holds less than COVER by HOLD_Z standard errors (chance does not move it); the
        largest until COVER_SEEN roots were seen."""
        roots = self.risk[0]
        if roots < COVER_SEEN:
            return self.largest
        if current < self.largest:
            held = self.covered(current)
            if held >= COVER - HOLD_Z * math.sqrt(COVER * (1 - COVER) / roots):
                smaller = current // 2
                return smaller if smaller >= self.smallest and self.covered(smaller) >= COVER else current
        k = self.smallest
        while k < self.largest and self.covered(k) < COVER:
            k *= 2
        return min(k, self.largest)
