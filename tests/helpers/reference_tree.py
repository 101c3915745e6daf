"""The token tree as it was before its columns moved into arrays (one Python object per node, a heap per
selection, a sort per draft round), kept as the oracle of tests/core/test_tree_oracle.py: the array tree must
make the same choices, ids and prunes.

The original contract:

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

Verification at the root, when `target_next(root)` is known: if an injected child carries that token it is
a **hit** — `commit(child)` makes it the root and prunes its siblings' subtrees; otherwise a **miss**: when
the draft proposed that token but it was not injected, `reroot(child)` makes that child the root and keeps
its expanded subtree (warm restart); else `restart(token)` commits the target's token as a fresh **bonus**
node below the root and prunes everything else.

Worked example (root r = node 0 at depth 4, width 2, layer policy):

    add_children(0, [(a, -0.1), (b, -1.0), (c, -2.0)])   # candidates 1:a 2:b 3:c at depth 5
    select_layer(2)            -> [1, 2]                  # injected; 3 stays a candidate
    add_children(1, [(d, -0.2)]); add_children(2, [(e, -0.1)])
    select_layer(2)            -> [4, 5]                  # d (score -0.3), e (-1.1): depth 6
    target_next(0) = b  -> commit(2) prunes 1 and its subtree (1, 4) and drops candidate 3; root = 2
    target_next(2) = x  -> miss: restart(x) prunes 5, adds bonus 6:x (committed, not yet injected)
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

POLICIES = ("layer", "best-first", "hybrid")


@dataclass
class TreeNode:
    id: int
    parent: int
    token: int
    depth: int
    score: float = 0.0                 # cumulative draft log-probability (for ranking)
    injected: bool = False
    committed: bool = False
    expanded: bool = False             # the draft has proposed this node's children
    target_next: int | None = None     # the target's token after this node (greedy or its seeded sample)
    children: list[int] = field(default_factory=list)       # in the order the draft proposed them
    q: torch.Tensor | None = None          # [vocab] draft's warped log-probs here (rejection verification)
    target_p: torch.Tensor | None = None   # [vocab] target's warped log-probs here (rejection verification)


@dataclass
class Pruned:
    """Nodes a commit or restart removed that were computed somewhere: `injected` (their rows are on the
    stages) and `expanded` (their rows are in the draft). Iterating yields each such id once."""
    injected: list[int] = field(default_factory=list)
    expanded: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[int]:
        return iter(dict.fromkeys(self.injected + self.expanded))

    def __len__(self) -> int:
        return len(set(self.injected) | set(self.expanded))


class TokenTree:
    def __init__(self, root_id: int, root_token: int, root_depth: int, new_id: Callable[[], int]) -> None:
        self.new_id = new_id
        self.nodes: dict[int, TreeNode] = {}
        self.root = root_id
        self.nodes[root_id] = TreeNode(root_id, -1, root_token, root_depth, injected=True, committed=True)

    @property
    def root_node(self) -> TreeNode:
        return self.nodes[self.root]

    # -- growth -------------------------------------------------------------------------------------
    def add_children(self, parent_id: int, proposals: list[tuple[int, float]]) -> list[int]:
        """Add the draft's proposals (token, log-prob) below a node; returns the new candidate ids."""
        parent = self.nodes[parent_id]
        parent.expanded = True
        have = {self.nodes[c].token for c in parent.children}
        ids = []
        for token, logp in proposals:
            if token in have:
                continue
            have.add(token)
            node = TreeNode(self.new_id(), parent_id, token, parent.depth + 1, parent.score + logp)
            self.nodes[node.id] = node
            parent.children.append(node.id)
            ids.append(node.id)
        return ids

    def candidates(self, max_depth: int | None = None) -> list[TreeNode]:
        """Nodes not yet injected whose parent is injected (none while the root itself is not injected)."""
        return [n for n in self.nodes.values() if not n.injected and n.id != self.root
                and self.nodes[n.parent].injected and (max_depth is None or n.depth <= max_depth)]

    def select_layer(self, width: int, max_depth: int | None = None) -> list[int]:
        """The best `width` children of the deepest injected layer (the root counts as a layer)."""
        deepest = max((n.depth for n in self.nodes.values() if n.injected), default=None)
        if deepest is None:
            return []
        pool = [n for n in self.candidates(max_depth) if n.depth == deepest + 1]
        return self._take(pool, width)

    def select_best_first(self, width: int, max_depth: int | None = None) -> list[int]:
        return self._take(self.candidates(max_depth), width)

    def lead(self) -> int:
        """How many layers the injected tree reaches below the root."""
        root = self.root_node.depth
        return max((n.depth for n in self.nodes.values() if n.injected), default=root) - root

    def select(self, policy: str, width: int, max_depth: int | None = None, horizon: int = 1) -> list[int]:
        """SpecPipe's growth per micro-batch: `layer` one layer (the paper's rule); `best-first` multi-layer
        best-first (`select_ahead`); `hybrid` the same with the spine first, `horizon` layers deep."""
        if policy == "layer":
            return self.select_layer(width, max_depth)
        if policy == "best-first":
            return self.select_ahead(width, max_depth)
        if policy == "hybrid":
            return self.select_ahead(width, max_depth, spine_lead=horizon)
        raise ValueError(f"unknown tree policy {policy!r}; choose from {', '.join(POLICIES)}")

    def select_ahead(self, width: int, max_depth: int | None = None, spine_lead: int = 0) -> list[int]:
        """Multi-layer growth (SpecPipe's micro-batches): up to `width` nodes, best-first by score over the
        candidates *and* the already-proposed children of nodes taken in the same call, so one micro-batch may
        span several layers and a branch that fell behind catches up at once. An uninjected root (a bonus)
        comes first. With `spine_lead` > 0 the spine — the chain of best children from the root — is taken
        first down to `spine_lead` layers below the root, so the tree always reaches the pipeline's horizon.

        Scores never increase along a path, so the result is the best `width` nodes of the subtree that hangs
        below the injected part, connected to it. Worked example (root 0 injected, width 3):

            0 -> 1 (-0.1, expanded) -> 3 (-0.3)        select_best_first(3) -> [1, 2]     (3 not eligible)
              -> 2 (-0.5)                               select_ahead(3)      -> [1, 3, 2]  (3 rides with 1)
        """
        chosen: list[TreeNode] = []
        heap: list[tuple[float, int, int]] = []

        def take(n: TreeNode) -> None:
            n.injected = True
            chosen.append(n)
            for c in n.children:
                child = self.nodes[c]
                if not child.injected and (max_depth is None or child.depth <= max_depth):
                    heapq.heappush(heap, (-child.score, child.depth, child.id))

        root = self.root_node
        if width > 0 and not root.injected:
            take(root)
        else:
            for n in self.candidates(max_depth):
                heapq.heappush(heap, (-n.score, n.depth, n.id))
        if spine_lead > 0:
            node = root
            while len(chosen) < width and node.children and node.depth < root.depth + spine_lead:
                node = max((self.nodes[c] for c in node.children), key=lambda n: (n.score, -n.id))
                if max_depth is not None and node.depth > max_depth:
                    break
                if not node.injected:
                    take(node)
        while heap and len(chosen) < width:
            _, _, nid = heapq.heappop(heap)
            if not self.nodes[nid].injected:
                take(self.nodes[nid])
        chosen.sort(key=lambda n: (n.depth, n.id))       # parents before children
        return [n.id for n in chosen]

    def to_expand(self, count: int, max_depth: int | None = None, skip: frozenset[int] = frozenset(),
                  spine_lead: int = 0, injected_only: bool = False) -> list[TreeNode]:
        """The draft's next work (run-ahead): the `count` best nodes not yet expanded, injected or not, whose
        children could still be used (depth below `max_depth`; tokens in `skip`, e.g. EOS, have none). With
        `spine_lead` > 0 the tip of the spine comes first while it is fewer than `spine_lead` layers below the
        root. `injected_only`: only nodes already injected (the one-layer rule). Every node's parent is
        expanded (that is where it came from), so the draft can compute any of them."""
        def usable(n: TreeNode) -> bool:
            return not n.expanded and n.token not in skip and (max_depth is None or n.depth < max_depth) \
                and (n.injected or not injected_only)
        first: list[TreeNode] = []
        tip = self._spine_tip(spine_lead)
        if tip is not None and usable(tip):
            first.append(tip)
        pool = [n for n in self.nodes.values() if usable(n) and n is not tip]
        pool.sort(key=lambda n: (-n.score, not n.injected, n.depth, n.id))
        return sorted(first + pool[:max(0, count - len(first))], key=lambda n: (n.depth, n.id))

    def _spine_tip(self, lead: int) -> TreeNode | None:
        """The first unexpanded node on the chain of best children from the root, if within `lead` layers."""
        node = self.root_node
        while node.expanded and node.children:
            node = max((self.nodes[c] for c in node.children), key=lambda n: (n.score, -n.id))
        return node if node.depth - self.root_node.depth < lead and not node.expanded else None

    def _take(self, pool: list[TreeNode], width: int) -> list[int]:
        pool.sort(key=lambda n: (-n.score, n.depth, n.id))
        chosen = sorted(pool[:width], key=lambda n: (n.depth, n.id))   # parents before children
        for n in chosen:
            n.injected = True
        return [n.id for n in chosen]

    # -- verification -------------------------------------------------------------------------------
    def matching_child(self, node_id: int, token: int) -> int | None:
        """The injected child of node_id that carries `token`, if any."""
        for c in self.nodes[node_id].children:
            child = self.nodes[c]
            if child.injected and child.token == token:
                return c
        return None

    def commit(self, child_id: int) -> Pruned:
        """Hit: the injected child becomes the root; its siblings' subtrees are pruned."""
        child = self.nodes[child_id]
        if child.parent != self.root:
            raise ValueError(f"node {child_id} is not a child of the root {self.root}")
        return self._reroot(child)

    def reroot(self, child_id: int) -> Pruned:
        """Warm restart after a miss: the target's token is a child the draft proposed but that was not
        injected. It becomes the root (committed, to be injected) and keeps its already-expanded subtree."""
        child = self.nodes[child_id]
        if child.parent != self.root or child.injected:
            raise ValueError(f"node {child_id} is not an uninjected child of the root {self.root}")
        return self._reroot(child)

    def _reroot(self, child: TreeNode) -> Pruned:
        pruned = Pruned()
        for sib in self.nodes[self.root].children:
            if sib != child.id:
                self._drop_subtree(sib, pruned)
        del self.nodes[self.root]
        child.parent, child.committed = -1, True
        self.root = child.id
        return pruned

    def restart(self, token: int) -> tuple[int, Pruned]:
        """Miss: commit `token` as a new bonus node below the root, pruning everything else.
        Returns (bonus id, what was pruned). The bonus still has to be expanded and injected."""
        pruned = Pruned()
        for c in self.nodes[self.root].children:
            self._drop_subtree(c, pruned)
        old = self.nodes.pop(self.root)
        bonus = TreeNode(self.new_id(), -1, token, old.depth + 1, committed=True)
        self.nodes = {bonus.id: bonus}
        self.root = bonus.id
        return bonus.id, pruned

    def _drop_subtree(self, node_id: int, pruned: Pruned) -> None:
        """Remove a subtree, noting the nodes computed somewhere: injected (stages) or expanded (draft).
        Candidates that were only proposed never left the coordinator."""
        stack = [node_id]
        while stack:
            n = self.nodes.pop(stack.pop())
            if n.injected:
                pruned.injected.append(n.id)
            if n.expanded:
                pruned.expanded.append(n.id)
            stack.extend(n.children)

    # -- queries ------------------------------------------------------------------------------------
    def path_tokens(self, node_id: int) -> list[int]:
        """Tokens from just below the root down to node_id (empty for the root)."""
        out = []
        while node_id != self.root:
            n = self.nodes[node_id]
            out.append(n.token)
            node_id = n.parent
        return out[::-1]

    def live_injected(self) -> list[int]:
        return [n.id for n in self.nodes.values() if n.injected and not n.committed]
