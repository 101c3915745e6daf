"""Selection in a token tree (coordinator/core/tree.py `TokenTree`): which nodes go into the next micro-batch,
and which the draft expands next. `TokenTree` takes these methods from `TreeSelection`; they read and mark the
tree's columns (`a`, coordinator/core/tree_columns.py) and find rows with its `row` / `rows`.

Contract. Every rule ranks nodes by (-score, depth, id) — `to_expand` by (-score, not injected, depth, id) —
marks what it picks injected (`select*`; `to_expand` marks nothing: the scheduler marks it asked) and returns
ids parents-before-children, by (depth, id):
- `select(policy, width, max_depth, horizon)`: SpecPipe's growth per micro-batch. `layer` (the paper's): the
  best `width` candidates one layer below the deepest injected one (`select_layer`); `best-first`: the best
  `width` nodes not yet injected, a node riding with its parent when the draft has already expanded the parent
  (`select_ahead`); `hybrid`: the same with the spine (the chain of best children) first, `horizon` layers
  deep. An uninjected root (a bonus) always comes first. The trip baselines call the one-layer rules
  `select_layer` and `select_best_first` (the candidates: uninjected nodes whose parent is injected).
- `to_expand(count, ...)`: the draft's run-ahead, the `count` best nodes neither expanded nor asked (the spine's
  tip first with `spine_lead`), below `max_depth` and not carrying a token in `skip`.
- `select_rows` / `expand_rows`: the same choices as rows, for the scheduler's hot path, which reads them with
  `TokenTree.segment_of` / `TokenTree.ask` instead of looking each id up again.
Nothing is pushed onto a heap: `_best` is a partial sort of the score column, then an exact lexsort among the
survivors (ties at the k-th score included), so a step costs a few whole-column numpy operations.

Worked example (root 0 injected; 1 expanded; width 3):

    0 -> 1 (-0.1, expanded) -> 3 (-0.3)        select_best_first(3) -> [1, 2]     (3: its parent is not in)
      -> 2 (-0.5)                               select_ahead(3)      -> [1, 2, 3]  (3 rides with 1)
                                                to_expand(2)         -> [2, 3]     (1 is expanded already)
"""
from __future__ import annotations

import numpy as np

from coordinator.core.tree_columns import NO_ROW, NodeArrays, NodeView
from coordinator.core.vocabulary import TREE_POLICIES, TreePolicy


class TreeSelection:
    """The selection methods of `TokenTree` (module docstring); the tree provides `a`, `row` and `rows`."""
    a: NodeArrays

    def candidates(self, max_depth: int | None = None) -> list[NodeView]:
        """Nodes not yet injected whose parent is injected (none while the root itself is not injected)."""
        return [NodeView(self, i) for i in self.a.id[self._candidate_mask(max_depth)].tolist()]

    def _candidate_mask(self, max_depth: int | None) -> np.ndarray:
        a = self.a
        prow, _ = self.rows(a.parent)
        mask = ~a.injected & a.injected[prow]
        mask[0] = False
        if max_depth is not None:
            mask &= a.depth <= max_depth
        return mask

    def select_layer(self, width: int, max_depth: int | None = None) -> list[int]:
        """The best `width` children of the deepest injected layer (the root counts as a layer)."""
        return self.a.id[self._layer_rows(width, max_depth)].tolist()

    def _layer_rows(self, width: int, max_depth: int | None) -> np.ndarray:
        a = self.a
        if not a.injected.any():
            return np.zeros(0, np.int64)
        deepest = int(a.depth[a.injected].max())
        return self._take(self._candidate_mask(max_depth) & (a.depth == deepest + 1), width)

    def select_best_first(self, width: int, max_depth: int | None = None) -> list[int]:
        return self.a.id[self._take(self._candidate_mask(max_depth), width)].tolist()

    def lead(self) -> int:
        """How many layers the injected tree reaches below the root."""
        return int(self.a.depth[self.a.injected].max(initial=self.a.depth[0])) - int(self.a.depth[0])

    def select(self, policy: str, width: int, max_depth: int | None = None, horizon: int = 1) -> list[int]:
        """SpecPipe's growth per micro-batch: `layer` one layer (the paper's rule); `best-first` multi-layer
        best-first (`select_ahead`); `hybrid` the same with the spine first, `horizon` layers deep."""
        return self.a.id[self.select_rows(policy, width, max_depth, horizon)].tolist()

    def select_rows(self, policy: str, width: int, max_depth: int | None = None, horizon: int = 1) -> np.ndarray:
        """`select`, as the chosen rows (parents first), for the hot path."""
        if policy == TreePolicy.LAYER:
            return self._layer_rows(width, max_depth)
        if policy == TreePolicy.BEST_FIRST:
            return self._ahead_rows(width, max_depth)
        if policy == TreePolicy.HYBRID:
            return self._ahead_rows(width, max_depth, spine_lead=horizon)
        raise ValueError(f"unknown tree policy {policy!r}; choose from {', '.join(TREE_POLICIES)}")

    def select_ahead(self, width: int, max_depth: int | None = None, spine_lead: int = 0) -> list[int]:
        """Multi-layer growth (SpecPipe's micro-batches): up to `width` nodes, best-first by score over the
        candidates *and* the already-proposed children of nodes taken in the same call, so one micro-batch may
        span several layers and a branch that fell behind catches up at once. An uninjected root (a bonus)
        comes first. With `spine_lead` > 0 the spine — the chain of best children from the root — is taken
        first down to `spine_lead` layers below the root, so the tree always reaches the pipeline's horizon.

        Scores never increase along a path, so the result is the best `width` nodes of the subtree that hangs
        below the injected part, connected to it: the best by (-score, depth, id) of all nodes not injected
        (a node's parent always ranks before it). Worked example (root 0 injected, width 3):

            0 -> 1 (-0.1, expanded) -> 3 (-0.3)        select_best_first(3) -> [1, 2]     (3 not eligible)
              -> 2 (-0.5)                               select_ahead(3)      -> [1, 2, 3]  (3 rides with 1)
        """
        return self.a.id[self._ahead_rows(width, max_depth, spine_lead)].tolist()

    def _ahead_rows(self, width: int, max_depth: int | None = None, spine_lead: int = 0) -> np.ndarray:
        a = self.a
        chosen: list[int] = []
        if width > 0 and not a.injected[0]:
            a.injected[0] = True
            chosen.append(0)
        if spine_lead > 0:
            r, limit = 0, int(a.depth[0]) + spine_lead
            best_row, depth, injected = a.best_row, a.depth, a.injected
            while len(chosen) < width and best_row[r] != NO_ROW and depth[r] < limit:
                r = best_row[r]
                if max_depth is not None and depth[r] > max_depth:
                    break
                if not injected[r]:
                    injected[r] = True
                    chosen.append(r)
        left = width - len(chosen)
        if left > 0:
            pool = ~a.injected if max_depth is None else ~a.injected & (a.depth <= max_depth)
            best = self._best(pool.nonzero()[0], left)
            a.injected[best] = True
            chosen += best.tolist()
        return self.parents_first(np.asarray(chosen, np.int64))

    def to_expand(self, count: int, max_depth: int | None = None, skip: frozenset[int] = frozenset(),
                  spine_lead: int = 0, injected_only: bool = False) -> np.ndarray:
        """The draft's next work (run-ahead): ids of the `count` best nodes not yet expanded, injected or
        not, whose children could still be used (depth below `max_depth`; tokens in `skip`, e.g. EOS, have
        none), parents first. With `spine_lead` > 0 the tip of the spine comes first while it is fewer than
        `spine_lead` layers below the root. `injected_only`: only nodes already injected (the one-layer
        rule). Ranked by (-score, not injected, depth, id). Every node's parent is expanded (that is where
        it came from), so the draft can compute any of them."""
        return self.a.id[self.expand_rows(count, max_depth, skip, spine_lead, injected_only)]

    def expand_rows(self, count: int, max_depth: int | None = None, skip: frozenset[int] = frozenset(),
                    spine_lead: int = 0, injected_only: bool = False) -> np.ndarray:
        """`to_expand`, as rows (parents first), for the hot path."""
        ranked, _ = self.expand_ranked(count, max_depth, skip, spine_lead, injected_only)
        return self.parents_first(ranked)

    def expand_ranked(self, count: int, max_depth: int | None = None, skip: frozenset[int] = frozenset(),
                      spine_lead: int = 0, injected_only: bool = False) -> tuple[np.ndarray, bool]:
        """`expand_rows` in rank order (the spine's tip first), and whether the tip came first: a chained
        job's first round and its frontier (coordinator/core/drafts/chain.py)."""
        a = self.a
        usable = ~a.expanded & ~a.asked
        for token in skip:
            usable &= a.token != token
        if max_depth is not None:
            usable &= a.depth < max_depth
        if injected_only:
            usable &= a.injected
        first: list[int] = []
        tip = self._spine_tip(spine_lead)
        if tip is not None and usable[tip]:
            first.append(tip)
            usable[tip] = False
        rows = usable.nonzero()[0]
        best = self._best(rows, max(0, count - len(first)), injected_first=True)
        return (np.concatenate((np.asarray(first, np.int64), best)) if first else best), bool(first)

    def _spine_tip(self, lead: int) -> int | None:
        """The row of the first unexpanded node on the chain of best children from the root, if within
        `lead` layers."""
        a = self.a
        r, best, expanded = 0, a.best_row, a.expanded
        while expanded[r] and best[r] != NO_ROW:
            r = best[r]
        r = int(r)
        return r if a.depth[r] - a.depth[0] < lead and not a.expanded[r] else None

    def _best(self, rows: np.ndarray, k: int, injected_first: bool = False) -> np.ndarray:
        """The k best of `rows` by (-score, [not injected,] depth, id): a partial sort by score, then the
        exact order among the survivors (ties at the k-th score included)."""
        if k <= 0 or not len(rows):
            return np.zeros(0, np.int64)
        a = self.a
        neg = -a.score[rows]
        if len(rows) > k:
            part = neg.copy()                      # (the method: np.partition's wrapper costs a call)
            part.partition(k - 1)
            keep = neg <= part[k - 1]
            rows, neg = rows[keep], neg[keep]
        # (rows are in id order: the row itself is the id's tie-break)
        keys = (rows, a.depth[rows]) + ((~a.injected[rows],) if injected_first else ()) + (neg,)
        return rows[np.lexsort(keys)[:k]]

    def parents_first(self, rows: np.ndarray) -> np.ndarray:
        """Rows by (depth, id): parents before children (rows are in id order)."""
        return rows[np.lexsort((rows, self.a.depth[rows]))]

    def _take(self, mask: np.ndarray, width: int) -> np.ndarray:
        """The best `width` rows of the mask, marked injected, parents first."""
        best = self._best(mask.nonzero()[0], width)
        self.a.injected[best] = True
        return self.parents_first(best)
