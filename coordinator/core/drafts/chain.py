"""Chained draft rounds: a job's later rounds chosen by the draft itself, so the coordinator makes and applies
one job per step instead of one per round.

Why. Beside GPU stages the draft runs `rounds` rounds a step (coordinator/core/schedulers/specpipe.py). Made
one by one, each round costs the coordinator a call (`draft_next`: apply the last round, choose the next) that
starts cold after the draft's forward: at width 32 x 3 rounds, ~2.9 calls and ~0.9 ms of its ~1.2 ms a step.
Chained, the coordinator makes the first round as before and hands the draft, with it, what it needs to choose
the next rounds the way the tree would (`TreeSelection.expand_rows`): the next-best usable nodes of the tree
(`frontier`, in rank order) and the rule's parameters. After each round the draft scores the children it
proposed (parent's score + log-prob), takes the best `width` of them and the frontier by (-score, not injected,
depth, id), the spine's tip first, and runs the next round; what it did not take is the frontier of the rounds
after (as many nodes as they can take). Absent results in between, the rounds expand the
same nodes as rounds made one by one; a result meanwhile is handled as for any job (what it pruned is dropped
when the job is applied, and the draft frees it with the queued prune: the frontier is marked asked so a prune
names it).

Cut. A result that comes back while a chain runs wants the rounds done so far: the scheduler sets the job's
`cut` flag (coordinator/core/drafts/job.py) and the chain stops at the end of its round (`record`: the job
checks the flag before `choose`, so a cut chain chooses nothing in vain); the rounds not run are
due again and chosen from the tree as the result left it. A draft slow against the stages is cut after every
first round, which is rounds made one by one.

Ids. The draft computes the children it chose, so their ids are fixed before the tree has them: the job
reserves a block of the request's ids (`first`), and the children of the i-th node of round r are
first + (r * width + i) * topk + j, j = 0..topk-1 (ids grow with rows, as the tree keeps them; a round with
fewer nodes leaves gaps). Only a restart makes a node while the job runs, and no node of the job stays in the
tree then (a committed one leaves it too): so the block is above every live id when the job is applied. The
children the draft made below a node that left the tree meanwhile never reach it; the scheduler has the draft
prune them (their ids are the block's, never committed).

Worked example (width 2, topk 2, frontier [f: -0.9]): round 1 expands [a: -0.1, b: -0.5]; the draft proposes
a -> (x: -0.2, y: -2.0), b -> (z: -0.1, w: -3.0). Scores: x -0.3, y -2.1, z -0.6, w -3.5, f -0.9: round 2
expands [x, z]; their children are ids first + 4..7.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordinator.core.drafts.base import DraftNodes
from coordinator.core.proposals import ProposalRows
from coordinator.core.tree_columns import UNKNOWN


@dataclass
class ChainRound:
    """One round the draft ran: the nodes it expanded and the ids their children get."""
    node_ids: np.ndarray        # [m] int64
    proposals: ProposalRows     # [m, k]
    child_ids: np.ndarray       # [m, k] int64


@dataclass
class ChainGrowth:
    """Every round of a chain as the tree's new rows, made on the draft's side so the coordinator adds them in
    one step (`TreeGrowth.add_grown`): the children of every valid cell, round after round (ids ascending),
    and the nodes each round expanded.

        round 1 expands [5] (depth 9, score -0.2), children 40: a (-0.1), 41: b (-2.0); round 2 expands [40],
        children 42: c (-0.3), 43: d (-0.9)  ->  ids [40, 41, 42, 43], parents [5, 5, 40, 40], depths
        [10, 10, 11, 11], scores [-0.3, -2.2, -0.6, -1.2], expanded [5, 40], best [0, 2], made_at [-1, 0]
        (indices into ids), parent_at [0, 0, 1, 1] (into expanded)
    """
    first: int                  # the chain's first reserved id: an expanded node below it is the tree's
    rounds: int                 # the rounds done
    expanded: np.ndarray        # [e] int64, the nodes the rounds expanded, in order
    bins: np.ndarray            # [e] int8, their calibration bins (UNKNOWN: the draft's own scores)
    best: np.ndarray            # [e] int64, the index in `ids` of each one's first best child (-1: none)
    made_at: np.ndarray         # [e] int64, the index in `ids` of each one made by a round before (-1: the tree's)
    ids: np.ndarray             # [c] int64, the children, ascending
    parents: np.ndarray         # [c] int64
    parent_at: np.ndarray       # [c] int64, the index in `expanded` of each one's parent
    tokens: np.ndarray          # [c] int64
    depths: np.ndarray          # [c] int64
    scores: np.ndarray          # [c] float64, cumulative


# The candidates of a round's choice (the children just proposed, then the frontier) as the rows of one float64
# matrix [6, n], so that joining, ranking and taking them are one numpy call each: ids, tokens and depths are exact
# in a float64 (below 2 ** 53). The first four rows are the rank's keys, least significant first (np.lexsort):
# (-score, not injected, depth, id).
ID, DEPTH, FRESH, NEG, PARENT, TOKEN = range(6)


def candidates(ids: np.ndarray, parents: np.ndarray, depths: np.ndarray, tokens: np.ndarray, scores: np.ndarray,
               injected: np.ndarray) -> np.ndarray:
    """Nodes as candidate columns: [6, n] float64 (rows ID, DEPTH, FRESH, NEG, PARENT, TOKEN)."""
    c = np.empty((6, len(ids)))
    c[ID], c[DEPTH], c[NEG], c[PARENT], c[TOKEN] = ids, depths, -scores, parents, tokens
    c[FRESH] = np.logical_not(injected)
    return c


@dataclass
class Chain:
    """A request's chained rounds, the first included, the later ones chosen by the draft (module docstring).
    Made under the scheduler's lock; read and advanced only on the draft's side while the job runs."""
    rounds: int                 # rounds in all, the first included
    width: int
    topk: int
    first: int                  # the first reserved id
    max_depth: int              # nodes at this depth or deeper are not expanded
    skip: frozenset[int]        # tokens with no children (EOS)
    tip_limit: int              # the spine's tip is taken first while its depth is below this (-1: no spine)
    # the round being computed: [m] each
    ids: np.ndarray             # int64
    depths: np.ndarray          # int64
    scores: np.ndarray          # float64, cumulative
    tip: int                    # index in the round of the spine's tip (-1: none)
    frontier: np.ndarray        # [6, f] float64, `candidates`: the next-best nodes, in rank order
    asked: np.ndarray = field(init=False)    # [f0] int64, the tree's frontier as made (its nodes are marked asked)
    done: list[ChainRound] = field(default_factory=list)
    grown: list[tuple[np.ndarray, ...]] = field(default_factory=list)   # per round, `ChainGrowth`'s columns
    _sizes: tuple[int, int] = (0, 0)         # children and expanded nodes in `grown`
    _last: tuple = ()                        # what `record` saw of the last round, for `choose`

    def __post_init__(self) -> None:
        self.asked = self.frontier_ids

    @property
    def frontier_ids(self) -> np.ndarray:
        """[f] int64, the ids of the nodes carried to the rounds after the next."""
        return self.frontier[ID].astype(np.int64)

    def step(self, proposals: ProposalRows) -> DraftNodes | None:
        """The round just computed proposed these children (one row per node of the round, as given): record
        them with their ids, and return the next round's nodes (None: the chain is done). `record`, then
        `choose`."""
        return self.choose() if self.record(proposals) else None

    def record(self, proposals: ProposalRows) -> bool:
        """Record the round's children with their ids (and their part of `growth`); whether a round follows (one
        is left and a node to expand: a usable child or the frontier). `choose` picks it: a job checks its `cut`
        in between, so a cut chain chooses nothing in vain."""
        r = len(self.done)
        m, k = proposals.tokens.shape
        child_ids = self.first + (r * self.width + np.arange(m))[:, None] * self.topk + np.arange(k)
        self.done.append(ChainRound(self.ids, proposals, child_ids))
        full = proposals.full
        valid = None if full else proposals.valid()
        scores = self.scores[:, None] + proposals.logps           # [m, k] cumulative
        parents, depths = np.repeat(self.ids, k), np.repeat(self.depths + 1, k)      # [m * k] each
        self._grow(proposals, valid, scores, child_ids, parents, depths)
        if len(self.done) >= self.rounds or not m:
            self._last = ()
            return False
        usable = depths < self.max_depth                          # [m * k] children the next round may expand
        if valid is not None:
            usable &= valid.ravel()
        for token in self.skip:
            usable &= proposals.tokens.ravel() != token
        self._last = (proposals, valid, scores, child_ids, parents, depths, usable)
        return bool(usable.any()) or self.frontier.shape[1] > 0

    def choose(self) -> DraftNodes | None:
        """The next round's nodes after the one `record` took (None: no node left to expand)."""
        assert self._last, "choose follows a record that said a round follows"
        proposals, valid, scores, child_ids, parents, depths, usable = self._last
        m, k = child_ids.shape
        full = valid is None
        cells = candidates(child_ids.ravel(), parents, depths, proposals.tokens.ravel(), scores.ravel(),
                           np.zeros(m * k, bool))                # the children (none injected yet)
        tip = -1                                                  # the spine goes on through the tip's best child
        if self.tip >= 0:
            row = scores[self.tip] if full else np.where(valid[self.tip], scores[self.tip], -np.inf)
            c = self.tip * k + int(row.argmax())
            if usable[c] and cells[DEPTH, c] < self.tip_limit:
                tip = c
                usable[c] = False
        pool = np.concatenate((cells, self.frontier), axis=1)
        ranked = np.concatenate((usable.nonzero()[0], np.arange(m * k, pool.shape[1])))
        ranked = ranked[np.lexsort(pool[:NEG + 1, ranked])]       # (-score, not injected, depth, id)
        take = self.width - (tip >= 0)
        rows = np.concatenate(([tip], ranked[:take])) if tip >= 0 else ranked[:take]
        if not len(rows):
            return None
        rows = rows[np.lexsort(pool[:DEPTH + 1, rows])]             # parents first: (depth, id)
        # the rest, in rank order, is the frontier of the rounds after the next (as many as they can take)
        self.frontier = pool[:, ranked[take:take + (self.rounds - len(self.done) - 1) * self.width]]
        chosen = pool[:, rows]
        ids, depths, parents, tokens = chosen[[ID, DEPTH, PARENT, TOKEN]].astype(np.int64)
        self.ids, self.depths, self.scores = ids, depths, -chosen[NEG]
        self.tip = int(np.flatnonzero(rows == tip)[0]) if tip >= 0 else -1
        return DraftNodes([], ids.tolist(), parents.tolist(), depths.tolist(), tokens.tolist())

    def _grow(self, proposals: ProposalRows, valid: np.ndarray | None, scores: np.ndarray, child_ids: np.ndarray,
              parents: np.ndarray, depths: np.ndarray) -> None:
        """The round's part of `growth`: what `TreeGrowth.add_chained` would append for it. `valid` is None for a
        top-k (every cell a proposal); `parents`, `depths`: every cell's, row-major."""
        m, k = child_ids.shape
        cells, nodes = self._sizes                               # children and nodes of the rounds before
        bins = proposals.bins if proposals.bins is not None else np.full(m, UNKNOWN, np.int8)
        if proposals.full:                                       # (a top-k: every cell a child, row-major)
            best = np.arange(cells, cells + m * k, k) + scores.argmax(axis=1)      # the first best of each row
            self.grown.append((self.ids, bins, best, child_ids.ravel(), parents,
                               np.repeat(np.arange(nodes, nodes + m), k), proposals.tokens.ravel(), depths,
                               scores.ravel()))
            self._sizes = (cells + m * k, nodes + m)
            return
        which = np.nonzero(valid)                                # row-major: id order
        col = np.where(valid, scores, -np.inf).argmax(axis=1)    # the first best of each row
        cell = (np.cumsum(valid.ravel()) - 1 + cells).reshape(valid.shape)
        best = np.where(valid.any(axis=1), cell[np.arange(m), col], -1)
        self.grown.append((self.ids, bins, best, child_ids[which], self.ids[which[0]], which[0] + nodes,
                           proposals.tokens[which], self.depths[which[0]] + 1, scores[which]))
        self._sizes = (cells + len(which[0]), nodes + m)

    def growth(self) -> ChainGrowth:
        """The rounds done, as the tree's new rows in one piece (`ChainGrowth`)."""
        kinds = (np.int64, np.int8, np.int64, np.int64, np.int64, np.int64, np.int64, np.int64, float)
        expanded, bins, best, ids, parents, parent_at, tokens, depths, scores = \
            [np.concatenate(c) for c in zip(*self.grown)] if self.grown else [np.zeros(0, t) for t in kinds]
        made = expanded >= self.first
        made_at = np.full(len(expanded), -1, np.int64)
        made_at[made] = np.searchsorted(ids, expanded[made])
        return ChainGrowth(self.first, len(self.grown), expanded, bins, best, made_at, ids, parents, parent_at,
                           tokens, depths, scores)
