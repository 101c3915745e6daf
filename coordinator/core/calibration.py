"""What a draft's guess is worth: the tree's scores from the draft's *measured* acceptance, not its probability.

Greedy verification keeps a child when it carries the target's argmax. A draft's probability is a poor
estimate of that: a near copy of the target (the `quant` draft) spreads its probability as the target does,
yet its first choice is the target's argmax far more often than its probability says. Measured on
SmolLM2-135M and its int8 copy (the shipped prompts, 32 x 64 greedy tokens, teacher-forced), by the draft's
first-choice probability p1:

    p1 in [0, 0.3): first choice right 85%, second 12%     p1 in [0.5, 0.7): first 98.5%, second 1.5%
    p1 in [0.3, 0.5): first choice right 93%, second 7%    p1 >= 0.7: first choice right every time

Ranked by raw cumulative log-probabilities, the tree spends its rows on siblings of nodes the draft was sure
of (its spine, p1 = 0.4 a step, looks no better than a sibling at 0.3) and stops deepening the spine: in the
GPU regime the pipeline then commits one token a step where it could commit three. Ranked by measured
acceptance, the spine goes deep and the tree hedges where the draft is truly unsure.

The estimate for a child of rank r (0: the draft's first choice) below a node whose first choice the draft
gave probability p1 (bin b of `EDGES`) shrinks, bin by bin, towards the rate of rank r over every bin, and
that towards the child's own draft probability p:

    pooled(r) = (sum_b hits[b, r] + PRIOR * p) / (sum_b seen[b, r] + PRIOR)
    P(b, r)   = (hits[b, r] + PRIOR * pooled(r)) / (seen[b, r] + PRIOR)

`seen[b, r]` counts verifications at nodes of bin b that had an r-th child, `hits[b, r]` those where the
target's token was that child. With no data a score is the draft's own log-probability (the tree ranks as it
did without calibration); the pooled rate is learnt within a few verifications, each bin's own as its
verifications come in. Scores along a row are made non-increasing (a row stays best first).

Worked example (PRIOR 4, fading aside): 20 verifications so far, all at nodes of bin [0.3, 0.4) with two children,
19 won by the first child and 1 by the second. A first child at p = 0.35: pooled (19 + 1.4) / 24 = 0.85, and its bin
has the same counts, so P = (19 + 4 * 0.85) / 24 = 0.933; its sibling at p = 0.2: pooled (1 + 0.8) / 24 = 0.075, P =
(1 + 0.3) / 24 = 0.054. A first child at p = 0.95 (a bin not seen yet): pooled (19 + 3.8) / 24 = 0.95, P = 0.95.

Only greedy requests verified by `match` are calibrated (sampling has its own scores: drafts/model.py).
The `Calibration` (owned by one scheduler, across its requests) learns; a job carries a frozen
`CalibrationTable` to the draft's thread, which rescores the draft's proposals as they come out of each call
(coordinator/core/drafts/job.py), so the chained rounds choose their nodes by the same scores as the tree.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coordinator.core.proposals import ProposalRows
from coordinator.core.tree_columns import UNKNOWN      # a node's bin before a calibrated expansion (its `conf`)

EDGES = np.asarray([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99])   # bins of the first choice's p1
BINS = len(EDGES) + 1
RANKS = 16             # children per node the table keeps (the cost rule's largest topk)
PRIOR = 4.0            # weight of the draft's own probability, in verifications
FADE = 0.999           # a bin's counts fade by this at each of its verifications: ~1000 of them remembered


@dataclass(frozen=True)
class CalibrationTable:
    """A frozen copy of the counts, for a job on the draft's thread."""
    hits: np.ndarray       # [BINS, RANKS] float64
    seen: np.ndarray       # [BINS, RANKS] float64
    pooled_hits: np.ndarray   # [RANKS] float64, hits summed over the bins
    pooled_seen: np.ndarray   # [RANKS] float64

    def apply(self, rows: ProposalRows) -> ProposalRows:
        """The rows rescored by measured acceptance (module docstring), each row's bin recorded in `bins`.

            the worked example's counts: logps [log 0.35, log 0.2] -> [log 0.933, log 0.054]
        """
        m, k = rows.tokens.shape
        if m == 0 or k == 0:
            return rows
        valid = rows.valid()
        p = np.exp(rows.logps)                                   # (-inf -> 0: padding)
        bins = np.searchsorted(EDGES, p[:, 0], side="right").astype(np.int8)      # [m]
        kk = min(k, RANKS)
        est = np.empty((m, k))
        pooled = (self.pooled_hits[:kk] + PRIOR * p[:, :kk]) / (self.pooled_seen[:kk] + PRIOR)
        est[:, :kk] = (self.hits[bins, :kk] + PRIOR * pooled) / (self.seen[bins, :kk] + PRIOR)
        est[:, kk:] = p[:, kk:]                                  # (beyond the table: the draft's own)
        with np.errstate(divide="ignore"):
            logps = np.log(est)
        logps = np.minimum.accumulate(np.where(valid, logps, -np.inf), axis=1)    # best first, padding -inf
        return ProposalRows(rows.tokens, logps, rows.counts, rows.distinct, rows.full, bins)


class Calibration:
    """Verification counts per (bin of the draft's first-choice probability, rank): what `CalibrationTable`
    scores by. One per scheduler; `observe` at each greedy verification of a calibrated node."""

    def __init__(self) -> None:
        self.hits = np.zeros((BINS, RANKS))     # [BINS, RANKS] verifications won by the rank-r child
        self.seen = np.zeros((BINS, RANKS))     # [BINS, RANKS] verifications at nodes with an r-th child
        self._table: CalibrationTable | None = None

    def observe(self, conf: int, rank: int, children: int) -> None:
        """A verification at a node of bin `conf` with `children` children, the target's token the rank-th
        of them (-1: none of them). A node of unknown bin (expanded uncalibrated) teaches nothing. The bin's
        counts fade first (FADE), so a draft that drifts with the workload is followed; a bin not seen keeps
        what it had."""
        if conf == UNKNOWN or children <= 0:
            return
        self.hits[conf] *= FADE
        self.seen[conf] *= FADE
        seen = min(children, RANKS)
        self.seen[conf, :seen] += 1
        if 0 <= rank < seen:                    # (a rank beyond the children given is not one of them)
            self.hits[conf, rank] += 1
        self._table = None

    def table(self) -> CalibrationTable:
        """The counts as they are now, frozen (made again only after an `observe`)."""
        if self._table is None:
            self._table = CalibrationTable(self.hits.copy(), self.seen.copy(), self.hits.sum(axis=0),
                                           self.seen.sum(axis=0))
        return self._table

    def rates(self) -> np.ndarray:
        """[BINS, RANKS] the measured rates (NaN where nothing was seen): for logs and tests."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.hits / self.seen
