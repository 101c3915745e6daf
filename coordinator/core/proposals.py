"""The draft's proposals for several nodes, as arrays: what a draft call hands the tree in one piece.

Row i holds the children proposed below the i-th expanded node, best first: `counts[i]` (token, log-prob)
pairs in columns 0..counts[i]-1; the columns past them are padding. A model draft fills the arrays
straight from its top-k (one transfer per call, no Python object per child); sources that propose a few
tokens by hand (n-gram) keep giving lists, which `of` turns into rows.

    rows = ProposalRows.of([[(7, -0.1), (8, -1.2)], [(9, -0.5)]])
    rows.tokens -> [[7, 8], [9, 0]]    rows.counts -> [2, 1]    rows[1] -> [(9, -0.5)]
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class ProposalRows(Sequence):
    tokens: np.ndarray     # [m, k] int64
    logps: np.ndarray      # [m, k] float64, each token's score: the draft's log-probability, or calibrated (`bins`)
    counts: np.ndarray     # [m] int64, proposals in each row (<= k)
    distinct: bool = False  # no row repeats a token (a top-k), so `has_repeats` need not look
    full: bool = False      # every row holds k proposals (`full`), so `counts` need not be looked at
    bins: np.ndarray | None = None   # [m] int8, each row's calibration bin when the logps are calibrated
    # (coordinator/core/calibration.py); None: the draft's own log-probabilities

    @classmethod
    def of(cls, rows: Sequence[Sequence[tuple[int, float]]]) -> "ProposalRows":
        k = max((len(r) for r in rows), default=0)
        tokens = np.zeros((len(rows), k), np.int64)
        logps = np.full((len(rows), k), -np.inf)
        for i, r in enumerate(rows):
            if r:
                tokens[i, :len(r)] = [t for t, _ in r]
                logps[i, :len(r)] = [s for _, s in r]
        return cls(tokens, logps, np.asarray([len(r) for r in rows], np.int64))

    @classmethod
    def topk(cls, tokens: np.ndarray, logps: np.ndarray) -> "ProposalRows":
        """Every column of every row is a proposal, no row repeating a token (a top-k): `full`. (Not named
        `full`: a method of the field's name would be the field's default, true for every other row.)"""
        return cls(tokens.astype(np.int64, copy=False), logps.astype(np.float64, copy=False),
                   np.full(tokens.shape[0], tokens.shape[1], np.int64), distinct=True, full=True)

    def valid(self) -> np.ndarray:
        """[m, k] bool: which cells are proposals."""
        return np.arange(self.tokens.shape[1]) < self.counts[:, None]

    def has_repeats(self) -> bool:
        """Some row proposes a token twice."""
        k = self.tokens.shape[1]
        if k < 2 or self.distinct:
            return False
        filler = -1 - np.arange(k, dtype=np.int64)             # distinct, never a token
        t = np.sort(np.where(self.valid(), self.tokens, filler), axis=1)
        return bool((t[:, 1:] == t[:, :-1]).any())

    def select(self, rows: Sequence[int] | np.ndarray) -> "ProposalRows":
        rows = np.asarray(rows, np.int64)
        return ProposalRows(self.tokens[rows], self.logps[rows], self.counts[rows], self.distinct, self.full,
                            None if self.bins is None else self.bins[rows])

    def __getitem__(self, i):                                   # a row as (token, log-prob) pairs
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = int(self.counts[i])
        return list(zip(self.tokens[i, :n].tolist(), self.logps[i, :n].tolist()))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __iter__(self) -> Iterator[list[tuple[int, float]]]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ProposalRows, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"ProposalRows({list(self)!r})"
