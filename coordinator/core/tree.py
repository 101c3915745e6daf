"""The dynamic speculative token tree of one request (docs/architecture.md, "The methods").

The tree hangs below the *root*, the last committed node. Every other node is a draft proposal: a token,
its parent, its depth (= position in the sequence) and its cumulative draft log-probability `score` (sum of
log p along the path from the root's subtree top). A node is a *candidate* until it is injected into the
pipeline; once its micro-batch returns, `target_next` holds the target's greedy token after it.

Growth picks which nodes go into the next micro-batch (`select`):
- `layer` (the paper's): the best `width` children of the deepest injected layer, by score;
- `best-first`: the `width` best nodes by score, where a node may ride in the same micro-batch as its
  parent when the draft has already expanded the parent (the draft runs ahead: `to_expand`), so a
  micro-batch spans several layers and a lagging branch catches up at once;
- `hybrid`: the same, with the spine (the chain of best children) taken first down to the pipeline's
  horizon. The trip baselines keep the one-layer rules (`select_layer`, `select_best_first`).
  The selection methods, with their contract, live in coordinator/core/tree_select.py (`TreeSelection`); the
  growth (the draft's proposals becoming children) in coordinator/core/tree_grow.py (`TreeGrowth`).

Verification at the root, when `target_next(root)` is known: if an injected child carries that token it is
a **hit** — `commit(child)` makes it the root and prunes its siblings' subtrees; otherwise a **miss**: when
the draft proposed that token but it was not injected, `reroot(child)` makes that child the root and keeps
its expanded subtree (warm restart); else `restart(token)` commits the target's token as a fresh **bonus**
node below the root and prunes everything else.

Storage (the control plane's hot path, ~1 ms per pipeline step at width 32, topk 16): the live nodes are
columns of numpy arrays (`NodeArrays`) kept in id order. Ids grow as nodes are made and a child is always
made after its parent, so id order is also parents-before-children, the root (the oldest live node) is
row 0, and an id is found by binary search. The draft's proposals arrive as arrays (`ProposalRows`, one row
per expanded node) and are appended in one step; selection is a partial sort of scores, not a heap over
Python objects. `tree.nodes[i]` is a view of one row for the cold paths and tests.

Worked example (root r = node 0 at depth 4, width 2, layer policy):

    add_children(0, [(a, -0.1), (b, -1.0), (c, -2.0)])   # candidates 1:a 2:b 3:c at depth 5
    select_layer(2)            -> [1, 2]                  # injected; 3 stays a candidate
    add_children(1, [(d, -0.2)]); add_children(2, [(e, -0.1)])
    select_layer(2)            -> [4, 5]                  # d (score -0.3), e (-1.1): depth 6
    target_next(0) = b  -> commit(2) prunes 1 and its subtree (1, 4) and drops candidate 3; root = 2
    target_next(2) = x  -> miss: restart(x) prunes 5, adds bonus 6:x (committed, not yet injected)
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from coordinator.core.tree_columns import NO_TOKEN, NodeArrays, NodeTable, NodeView
from coordinator.core.tree_grow import TreeGrowth
from coordinator.core.tree_select import TreeSelection



@dataclass
class Pruned:
    """Nodes a commit or restart removed that were computed somewhere: `injected` (their rows are on the
    stages) and `expanded` (their rows are in the draft), each in id order. Iterating yields each such id
    once."""
    injected: list[int] = field(default_factory=list)
    expanded: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[int]:
        return iter(dict.fromkeys(self.injected + self.expanded))

    def __len__(self) -> int:
        return len(set(self.injected) | set(self.expanded))


class Hit(NamedTuple):
    """One level of a verified path (`TokenTree.match_path`): at the node above it, the target's token was the
    injected child `child`, the `rank`-th of that node's `children` in the draft's order, `injected` of which
    had gone in; `conf` is that node's calibration bin (coordinator/core/calibration.py)."""
    child: int
    token: int
    rank: int
    injected: int
    children: int
    conf: int


class TokenTree(TreeGrowth, TreeSelection):
    def __init__(self, root_id: int, root_token: int, root_depth: int, new_ids: Callable[[int], int]) -> None:
        """`new_ids(n)` hands out n fresh consecutive node ids (the first is returned), larger than any
        before: the request's id counter (RequestState.new_node)."""
        self.new_ids = new_ids
        self.root = root_id
        self.a = NodeArrays()
        self.a.append(np.array([root_id]), np.array([-1]), np.array([root_token]), np.array([root_depth]),
                      np.zeros(1))
        self.a.injected[0] = True
        self.q: dict[int, torch.Tensor | None] = {}          # rejection verification only
        self.target_p: dict[int, torch.Tensor | None] = {}

    @property
    def nodes(self) -> NodeTable:
        return NodeTable(self)

    @property
    def root_node(self) -> NodeView:
        return NodeView(self, self.root)

    def root_target(self) -> int | None:
        """The target's token after the root (None: not known yet), asked on every result."""
        t = int(self.a.target_next[0])
        return None if t == NO_TOKEN else t

    def row(self, node_id: int, strict: bool = True) -> int:
        """The row of a live node (-1, or KeyError when strict, for an id that is not live)."""
        if node_id == self.root:
            return 0
        i = self.a.where_one(node_id)
        if i < 0 and strict:
            raise KeyError(node_id)
        return i

    def rows(self, node_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of many ids: (rows, live mask); rows where the mask is False are meaningless."""
        rows = self.a.where(node_ids)
        return rows, rows >= 0

    def live(self, node_ids: Sequence[int]) -> np.ndarray:
        """[len(node_ids)] bool: which ids are in the tree."""
        return self.rows(np.asarray(node_ids, np.int64))[1] if len(node_ids) else np.zeros(0, bool)

    def mark_asked(self, node_ids: Sequence[int]) -> None:
        """A draft job will compute these nodes' children: the draft holds their rows from now on (a prune
        names them), and `to_expand` does not offer them again."""
        rows, live = self.rows(np.asarray(node_ids, np.int64))
        rows = rows[live]
        self.a.asked[rows[~self.a.expanded[rows]]] = True     # (an expanded node is named by a prune already)

    def ask(self, rows: np.ndarray, root_parent: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """`mark_asked` by rows (`expand_rows`' answer), for the hot path: returns their `segment_of`."""
        self.a.asked[rows] = True
        return self.segment_of(rows, root_parent)

    def children(self, node_id: int) -> list[int]:
        return self.a.id[self.a.parent == node_id].tolist()

    # -- verification -------------------------------------------------------------------------------
    def set_target_next(self, node_ids: Sequence[int], tokens: Sequence[int]) -> None:
        """The target's tokens after these nodes (a result's output rows); ids no longer live are skipped."""
        if not len(node_ids):
            return
        if len(node_ids) == 1:                    # a plain request's root, a trip's bonus: no column work
            r = self.row(int(node_ids[0]), strict=False)
            if r >= 0:
                self.a.target_next[r] = int(tokens[0])
            return
        rows, live = self.rows(np.asarray(node_ids, np.int64))
        self.a.target_next[rows[live]] = np.asarray(tokens, np.int64)[live]

    def root_rank(self, token: int) -> tuple[int, int]:
        """(the rank of `token` among the root's children in the draft's order, -1 if not proposed; how many
        of them were injected), for the cost rule (coordinator/core/sizing.py)."""
        a = self.a
        mine = a.parent == self.root
        at = (a.token[mine] == token).nonzero()[0]
        return (int(at[0]) if len(at) else -1), int(np.count_nonzero(a.injected[mine]))

    def match_root(self, token: int) -> tuple[int | None, int, int]:
        """Verification at the root in one scan of the parent column: (the injected child carrying the target's
        `token`, else None; `root_rank(token)`). What `matching_child(root, token)` and `root_rank(token)`
        return, for the hot path.

            root 0 with children 1:a (injected), 2:b (injected), 3:c  ->  match_root(b) == (2, 1, 2)
                                                                        match_root(c) == (None, 2, 2)
        """
        a = self.a
        if a.n == 1:                              # the root alone (no speculation): no child at all
            return None, -1, 0
        mine = (a.parent == self.root).nonzero()[0]
        injected = a.injected[mine]
        at = (a.token[mine] == token).nonzero()[0]
        hit = at[injected[at]]
        child = int(a.id[mine[hit[0]]]) if len(hit) else None
        return child, (int(at[0]) if len(at) else -1), int(np.count_nonzero(injected))

    def root_children(self) -> int:
        """How many children the root has (the draft's proposals there, in rank order)."""
        return int(np.count_nonzero(self.a.parent == self.root)) if self.a.n > 1 else 0

    def match_path(self) -> list[Hit]:
        """The hits a result allows, from the root down (greedy or `match` verification): while the target's
        token after a node is known and an injected child carries it, that child, and on from it. Stops at the
        first node whose target token is unknown, or a miss (which `match_root` then handles). The tree is not
        changed: `commit_path` commits them in one step.

            root 0: 1:a (injected), 2:b (injected); 1: 3:c (injected); target after 0 = a, after 1 = c, after 3
            unknown  ->  [Hit(1, a, 0, 2, 2, .), Hit(3, c, 0, 1, 1, .)]
        """
        a, out, row = self.a, [], 0
        while a.n > 1 and (token := int(a.target_next[row])) != NO_TOKEN:
            mine = (a.parent[row + 1:] == a.id[row]).nonzero()[0] + row + 1    # (children come after parents)
            injected = a.injected[mine]
            at = (a.token[mine] == token).nonzero()[0]
            hit = at[injected[at]]
            if not len(hit):
                break
            out.append(Hit(int(a.id[mine[hit[0]]]), token, int(at[0]), int(np.count_nonzero(injected)), len(mine),
                           int(a.conf[row])))
            row = int(mine[hit[0]])
        return out

    def commit_path(self, child_ids: Sequence[int]) -> Pruned:
        """Hits down a path (`match_path`'s children, in order): the last becomes the root and keeps its subtree;
        the others leave the tree committed, as the root does; every other node is pruned. What `commit` of each
        in turn does, in one step."""
        if len(child_ids) == 1:
            return self.commit(child_ids[0])
        rows, live = self.rows(np.asarray(child_ids, np.int64))
        if not live.all() or self.a.parent[rows[0]] != self.root or \
                (self.a.parent[rows[1:]] != self.a.id[rows[:-1]]).any():
            raise ValueError(f"nodes {list(child_ids)} are not a path down from the root {self.root}")
        for node_id in child_ids[:-1]:            # (rejection only: the distributions of the path's nodes)
            self.q.pop(node_id, None)
            self.target_p.pop(node_id, None)
        return self._reroot(int(child_ids[-1]), int(rows[-1]), rows[:-1])

    def matching_child(self, node_id: int, token: int) -> int | None:
        """The injected child of node_id that carries `token`, if any."""
        a = self.a
        if a.n == 1:                              # the root alone (no speculation): no child at all
            return None
        hit = ((a.parent == node_id) & a.injected & (a.token == token)).nonzero()[0]
        return int(a.id[hit[0]]) if len(hit) else None

    def commit(self, child_id: int) -> Pruned:
        """Hit: the injected child becomes the root; its siblings' subtrees are pruned."""
        r = self.row(child_id, strict=False)
        if r < 0 or self.a.parent[r] != self.root:
            raise ValueError(f"node {child_id} is not a child of the root {self.root}")
        return self._reroot(child_id, r)

    def reroot(self, child_id: int) -> Pruned:
        """Warm restart after a miss: the target's token is a child the draft proposed but that was not
        injected. It becomes the root (committed, to be injected) and keeps its already-expanded subtree."""
        if child_id not in self.nodes or self.nodes[child_id].parent != self.root or self.nodes[child_id].injected:
            raise ValueError(f"node {child_id} is not an uninjected child of the root {self.root}")
        return self._reroot(child_id)

    def _reroot(self, child_id: int, r: int | None = None, committed: np.ndarray | None = None) -> Pruned:
        """`child_id` (at row r) becomes the root, keeping its subtree; the old root leaves the tree committed,
        and so do the rows `committed` (the path between them, `commit_path`); every other row is pruned."""
        keep = self._subtree(self.row(child_id) if r is None else r)
        dropped = ~keep
        dropped[0] = False                        # the old root leaves the tree committed, not pruned
        if committed is not None:
            dropped[committed] = False
        pruned = self._pruned(dropped)
        self.q.pop(self.root, None)
        self.target_p.pop(self.root, None)
        self.a.keep(keep.nonzero()[0])
        self.a.parent[0] = -1
        self.root = child_id
        return pruned

    def _subtree(self, top: int) -> np.ndarray:
        """Mask of the rows in the subtree below (and including) row `top`: the rows whose ancestor
        depth[row] - depth[top] layers up is `top`, found by pointer doubling (jumps of 1, 2, 4, ... layers:
        log2 of the tree's height in whole-column steps)."""
        a = self.a
        climb = a.depth - a.depth[top]             # layers from each row up to top's layer
        if not len(climb):
            return np.zeros(0, bool)
        up = self.rows(a.parent)[0]
        up[0] = 0                                  # the root's parent: itself (every jump stops there)
        at = np.arange(len(climb))
        todo = np.maximum(climb, 0)
        for jump in range(int(todo.max()).bit_length()):    # jumps of 2 ** jump layers where that bit is set
            if jump:
                up = up.take(up)
            at = np.where(todo & (1 << jump), up.take(at), at)
        return (climb >= 0) & (at == top)

    def _pruned(self, dropped: np.ndarray) -> Pruned:
        a = self.a
        pruned = Pruned(a.id[dropped & a.injected].tolist(), a.id[dropped & (a.expanded | a.asked)].tolist())
        if self.q or self.target_p:
            for i in a.id[dropped].tolist():
                self.q.pop(i, None)
                self.target_p.pop(i, None)
        return pruned

    def restart(self, token: int) -> tuple[int, Pruned]:
        """Miss: commit `token` as a new bonus node below the root, pruning everything else.
        Returns (bonus id, what was pruned). The bonus still has to be expanded and injected."""
        if self.a.n == 1:                         # the root alone: nothing to prune
            pruned = Pruned()
        else:
            dropped = np.ones(len(self.a.id), bool)
            dropped[0] = False
            pruned = self._pruned(dropped)
        bonus = self.new_ids(1)
        depth = int(self.a.depth[0]) + 1
        self.q.pop(self.root, None)
        self.target_p.pop(self.root, None)
        self.a.reset(bonus, token, depth)
        self.root = bonus
        return bonus, pruned

    # -- queries ------------------------------------------------------------------------------------
    def path_tokens(self, node_id: int) -> list[int]:
        """Tokens from just below the root down to node_id (empty for the root)."""
        out = []
        while node_id != self.root:
            r = self.row(node_id)
            out.append(int(self.a.token[r]))
            node_id = int(self.a.parent[r])
        return out[::-1]

    def live_injected(self) -> list[int]:
        a = self.a
        return a.id[1:][a.injected[1:]].tolist()

    def segment_rows(self, node_ids: Sequence[int], root_parent: int) -> tuple[list[int], list[int], list[int]]:
        """(parents, positions, tokens) of live nodes for a micro-batch or a draft call; the root's parent is
        `root_parent` (the committed node before it)."""
        if len(node_ids) == 1 and node_ids[0] == self.root:      # a plain request's micro-batch
            return [root_parent], [int(self.a.depth[0])], [int(self.a.token[0])]
        rows, _ = self.rows(np.asarray(node_ids, np.int64))
        return self.segment_of(rows, root_parent)[1:]

    def segment_of(self, rows: np.ndarray, root_parent: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """(ids, parents, positions, tokens) of live rows (`select_rows`' or `expand_rows`' answer), as
        `segment_rows` gives for ids."""
        a = self.a
        parents = a.parent[rows].tolist()
        if parents and min(parents) < 0:           # the root's row (the only parent -1)
            parents[parents.index(-1)] = root_parent
        return a.id[rows].tolist(), parents, a.depth[rows].tolist(), a.token[rows].tolist()
