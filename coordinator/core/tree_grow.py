"""Growth of a token tree (coordinator/core/tree.py `TokenTree`): the draft's proposals become children.
`TokenTree` takes these methods from `TreeGrowth`; they append to the tree's columns (`a`,
coordinator/core/tree_columns.py), find rows with its `row` / `rows` and take ids from its `new_ids`.

Contract. A node's children are appended in one piece, below every live id (ids grow with rows), each scored
by its parent's score plus its log-prob, and the parent is marked expanded (no longer asked) with its best
child (`best_row`: the first best score of its row):
- `add_children_many(parents, proposals)`: the general path; a token already below the parent, or repeated in
  its row, is skipped; ids from `new_ids`.
- `add_asked(nodes, proposals, first, asked_at)`: a draft job's proposals for the nodes it asked; a node
  pruned meanwhile is skipped with its row.
- `add_chained(nodes, proposals, child_ids)`: a chained round's (coordinator/core/drafts/chain.py), with the
  ids the draft gave the children.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from coordinator.core.proposals import ProposalRows
from coordinator.core.tree_columns import NO_ROW, UNKNOWN, NodeArrays

if TYPE_CHECKING:
    from coordinator.core.drafts.chain import ChainGrowth


class TreeGrowth:
    """The growth methods of `TokenTree` (module docstring); the tree provides `a`, `rows`, `new_ids`."""
    a: NodeArrays
    new_ids: Callable[[int], int]
    rows: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]

    def add_children(self, parent_id: int, proposals: Sequence[tuple[int, float]]) -> list[int]:
        """Add the draft's proposals (token, log-prob) below a node; returns the new candidate ids."""
        return self.add_children_many([parent_id], [list(proposals)]).tolist()

    def add_children_many(self, parent_ids: Sequence[int] | np.ndarray,
                          proposals: ProposalRows | Sequence[Sequence[tuple[int, float]]]) -> np.ndarray:
        """Children for several nodes at once (row i of `proposals` below parent_ids[i], best first); a
        token that is already a child of that node, or repeated in its row, is skipped (the first wins).
        Ids are handed out row by row in proposal order. Marks every parent expanded; returns the new ids.

            add_children_many([4, 5], ProposalRows.of([[(7, -0.1), (8, -1.0)], [(9, -0.2)]]))
            -> [n, n+1, n+2]: 7 and 8 below 4, 9 below 5 (scores: parent's + log-prob)
        """
        rows = proposals if isinstance(proposals, ProposalRows) else ProposalRows.of(proposals)
        parent_ids = np.asarray(parent_ids, np.int64)
        if len(parent_ids) != rows.tokens.shape[0]:
            raise ValueError(f"{len(parent_ids)} parents for {rows.tokens.shape[0]} rows of proposals")
        prow, live = self.rows(parent_ids)
        if not live.all():
            raise KeyError(f"not in the tree: {parent_ids[~live].tolist()}")
        fresh = (self.a.best_row[prow] == NO_ROW).all() and len(set(parent_ids.tolist())) == len(parent_ids)
        m, k = rows.tokens.shape
        self._expanded(prow, rows)
        if fresh and rows.distinct and (rows.counts == k).all():      # a draft's top-k: every cell is a child
            return self._add_full(parent_ids, prow, rows)
        valid = rows.valid()
        if not fresh or rows.has_repeats():
            valid = self._first_proposals(parent_ids, rows, valid)
        total = int(valid.sum())
        if total == 0:
            return np.zeros(0, np.int64)
        first = self.new_ids(total)
        if first <= self.a.id[-1]:
            raise ValueError(f"new node id {first} is not above every live id (last {int(self.a.id[-1])})")
        ids = np.arange(first, first + total, dtype=np.int64)
        n = self.a.n                                                        # the first new row
        scores = self.a.score[prow][:, None] + rows.logps                    # [m, k] cumulative
        which = np.nonzero(valid)                                          # row-major: proposal order
        self.a.append(ids, parent_ids[which[0]], rows.tokens[which], self.a.depth[prow][which[0]] + 1,
                      scores[which])                     # rows of the old nodes do not move
        # the best child of each parent: the first best score in its row (ids, and rows, grow along a row)
        ranked = np.where(valid, scores, -np.inf)
        col = ranked.argmax(axis=1)
        got = valid.any(axis=1)
        cell_row = (np.cumsum(valid.ravel()) - 1 + n).reshape(valid.shape)
        best = cell_row[np.arange(len(col)), col]
        if fresh:
            self.a.best_row[prow[got]] = best[got]
        else:
            for r, b, sc in zip(prow[got].tolist(), best[got].tolist(), ranked.max(axis=1)[got].tolist()):
                self._offer_best(r, b, sc)
        return ids

    def add_chained(self, node_ids: np.ndarray, proposals: ProposalRows, child_ids: np.ndarray) -> list[int]:
        """A chained round's proposals (coordinator/core/drafts/chain.py): row i below node_ids[i], each valid
        cell's child with the id the draft gave it (`child_ids` [m, k], ascending row-major, above every live
        id). A node no longer live (pruned, or a child of a row dropped before) is skipped with its row; the
        nodes must not have been expanded. Returns the ids that got their rows."""
        prow, live = self.rows(node_ids)
        if not live.all():
            node_ids, prow, child_ids = node_ids[live], prow[live], child_ids[live]
            proposals = proposals.select(live.nonzero()[0])
        if not len(node_ids):
            return []
        a = self.a
        if a.expanded[prow].any():
            raise ValueError(f"chained nodes expanded already: {node_ids[a.expanded[prow]].tolist()}")
        self._expanded(prow, proposals)
        valid = proposals.valid()
        if int(child_ids.min()) <= int(a.id[-1]):
            raise ValueError(f"chained child id {int(child_ids.min())} is not above every live id")
        n = a.n
        scores = a.score[prow][:, None] + proposals.logps                  # [m, k] cumulative
        which = np.nonzero(valid)                                          # row-major: id order
        a.append(child_ids[which], node_ids[which[0]], proposals.tokens[which], a.depth[prow][which[0]] + 1,
                 scores[which])
        got = valid.any(axis=1)
        col = np.where(valid, scores, -np.inf).argmax(axis=1)             # the first best of each row
        cell_row = (np.cumsum(valid.ravel()) - 1 + n).reshape(valid.shape)
        a.best_row[prow[got]] = cell_row[np.arange(len(col)), col][got]
        return node_ids.tolist()

    def add_grown(self, grown: ChainGrowth) -> tuple[list[int], np.ndarray] | None:
        """A chained job's rounds in one step (coordinator/core/drafts/chain.py `ChainGrowth`, built on the draft's
        side): what `add_chained` of each round in turn does. A node of the tree the job expanded that a result
        pruned meanwhile is skipped with its children and everything the rounds made below them. Returns (the
        expanded ids that got their children, the ids the rounds made and expanded that the tree did not get),
        or None (nothing changed: then the rounds go in one by one) where a live node it expanded was expanded
        already or the children's ids are not above every live id.

            expanded [5, 40] (40: a child of 5 made in round 1); 5 pruned by a result meanwhile -> 40 and its
            children are skipped too -> ([], [40])
        """
        a = self.a
        old = grown.made_at < 0                            # the tree's nodes (the others: children of a round)
        prow, live = self.rows(grown.expanded[old])
        if a.expanded[prow[live]].any() or (len(grown.ids) and int(grown.ids[0]) <= int(a.id[-1])):
            return None
        n, made = a.n, ~old
        if live.all():                                     # (the common case: every cell goes in as it is)
            a.append(grown.ids, grown.parents, grown.tokens, grown.depths, grown.scores)
            rows = np.empty(len(grown.expanded), np.int64)
            rows[old] = prow
            rows[made] = n + grown.made_at[made]
            self._grown(rows, grown.bins, grown.best, n)
            return grown.expanded.tolist(), grown.expanded[:0]
        kept = np.ones(len(grown.expanded), bool)          # each expanded node: still in the tree
        kept[old] = live
        for _ in range(grown.rounds):                      # a made node stays where its parent does, rounds down
            kept[made] = kept[grown.parent_at[grown.made_at[made]]]
        keep = kept[grown.parent_at]                       # [c] the cells that go in
        at = np.cumsum(keep) - 1                           # [c] a kept cell's index among them
        a.append(grown.ids[keep], grown.parents[keep], grown.tokens[keep], grown.depths[keep], grown.scores[keep])
        rows = np.empty(len(grown.expanded), np.int64)
        rows[old] = prow
        rows[made] = n + at[grown.made_at[made]]
        best = grown.best[kept]
        self._grown(rows[kept], grown.bins[kept], np.where(best >= 0, at[best], -1), n)
        return grown.expanded[kept].tolist(), grown.expanded[made & ~kept]

    def _grown(self, rows: np.ndarray, bins: np.ndarray, best: np.ndarray, n: int) -> None:
        """Rows just expanded by `add_grown`: their calibration bins, and their best children (`best`: an index
        among the children appended from row n; -1: none)."""
        a = self.a
        a.expanded[rows] = True
        a.asked[rows] = False
        a.conf[rows] = bins
        has = best >= 0
        a.best_row[rows[has]] = n + best[has]

    def add_asked(self, node_ids: Sequence[int], proposals: ProposalRows | Sequence[Sequence[tuple[int, float]]],
                  first: int = 0, asked_at: tuple[int, np.ndarray] | None = None) -> list[int]:
        """A draft job's proposals for nodes it asked (`ask`): row first + i of `proposals` below node_ids[i]
        (the rows before `first` are not this tree's). A node pruned while the job ran is skipped with its
        row. Returns the ids that got their rows (`add_children_many` for the rest of the contract).
        `asked_at`: (`a.layout`, the nodes' rows) when they were asked; while no row has moved since, those
        rows are used as they are (no lookup: nothing was pruned either, a prune moves rows; another tree, of a
        request id used again, has another stamp).

            ask rows of 5, 7; a result prunes 7; add_asked([5, 7], rows) -> [5]: 5's children added, 7's dropped
        """
        a = self.a
        ids = np.asarray(node_ids, np.int64)
        kept = asked_at is not None and not first and asked_at[0] == a.layout and len(asked_at[1]) == len(ids)
        prow, live = (asked_at[1], None) if kept else self.rows(ids)
        if not kept and (first or not live.all()):
            at = live.nonzero()[0]
            ids = ids[at]
            proposals = proposals.select(at + first) if isinstance(proposals, ProposalRows) else \
                [proposals[i + first] for i in at.tolist()]
        elif isinstance(proposals, ProposalRows) and proposals.distinct and len(ids) == proposals.tokens.shape[0] \
                and (proposals.full or (proposals.counts == proposals.tokens.shape[1]).all()) and a.asked[prow].all():
            # the hot path: a top-k for nodes still asked (`ask` marks distinct rows never expanded; expanding
            # clears the mark), so none has a child yet
            self._expanded(prow, proposals)
            self._add_full(ids, prow, proposals)
            return node_ids if isinstance(node_ids, list) else ids.tolist()
        self.add_children_many(ids, proposals)
        return ids.tolist()

    def _add_full(self, parent_ids: np.ndarray, prow: np.ndarray, rows: ProposalRows) -> np.ndarray:
        """The hot path of add_children_many: fresh parents, every cell of every row a distinct child."""
        m, k = rows.tokens.shape
        if m * k == 0:
            return np.zeros(0, np.int64)
        first = self.new_ids(m * k)
        if first <= self.a.id[-1]:
            raise ValueError(f"new node id {first} is not above every live id (last {int(self.a.id[-1])})")
        ids = np.arange(first, first + m * k, dtype=np.int64)
        n = self.a.n                                                        # the first new row
        scores = self.a.score[prow][:, None] + rows.logps                    # [m, k] cumulative
        self.a.append(ids, parent_ids.repeat(k), rows.tokens.ravel(), (self.a.depth[prow] + 1).repeat(k),
                      scores.ravel())
        self.a.best_row[prow] = np.arange(n, n + m * k, k) + scores.argmax(axis=1)   # the first best of each row
        return ids

    def _expanded(self, prow: np.ndarray, rows: ProposalRows) -> None:
        """These rows' children are in: expanded, no longer asked, with the calibration bin of their
        proposals (coordinator/core/calibration.py; UNKNOWN when the proposals were not calibrated)."""
        a = self.a
        a.expanded[prow] = True
        a.asked[prow] = False
        a.conf[prow] = UNKNOWN if rows.bins is None else rows.bins

    def _offer_best(self, r: int, cand: int, score: float) -> None:
        """Make row `cand` the best child of row r if it beats the current one by (score, -id) (rows are in
        id order: -row orders as -id)."""
        old = int(self.a.best_row[r])
        if old != NO_ROW and (self.a.score[old], -old) >= (score, -cand):
            return
        self.a.best_row[r] = cand

    def _first_proposals(self, parent_ids: np.ndarray, rows: ProposalRows, valid: np.ndarray) -> np.ndarray:
        """The cold path of add_children_many: drop tokens already below the parent (or earlier in the rows
        of the same parent), by hand."""
        have: dict[int, set[int]] = {}
        out = valid.copy()
        for i, pid in enumerate(parent_ids.tolist()):
            seen = have.setdefault(pid, set(self.a.token[self.a.parent == pid].tolist()))
            for j in valid[i].nonzero()[0].tolist():
                tok = int(rows.tokens[i, j])
                if tok in seen:
                    out[i, j] = False
                seen.add(tok)
        return out
