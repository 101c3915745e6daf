"""The dynamic speculative token tree of one request (pure Python; DESIGN §2).

The tree hangs below the *root*, the last committed node. Every other node is a draft proposal: a token,
its parent, its depth (= position in the sequence) and its cumulative draft log-probability `score` (sum of
log p along the path from the root's subtree top). A node is a *candidate* until it is injected into the
pipeline; once its micro-batch returns, `target_next` holds the target's greedy token after it.

Growth picks which candidates to inject next:
- `layer` (the paper's): the best `width` children of the deepest injected layer, by score;
- `best-first`: the `width` best candidates at any depth (their parents are already injected);
- `hybrid` (ours): the best child of the deepest layer, so the tree deepens by one every step as the
  pipeline needs, plus the `width - 1` best candidates at any depth.

Verification at the root, when `target_next(root)` is known: if an injected child carries that token it is
a **hit** — `commit(child)` makes it the root and prunes its siblings' subtrees; otherwise a **miss** —
`restart(token)` commits the target's token as a **bonus** node below the root and prunes everything else.

Worked example (root r = node 0 at depth 4, width 2, layer policy):

    add_children(0, [(a, -0.1), (b, -1.0), (c, -2.0)])   # candidates 1:a 2:b 3:c at depth 5
    select_layer(2)            -> [1, 2]                  # injected; 3 stays a candidate
    add_children(1, [(d, -0.2)]); add_children(2, [(e, -0.1)])
    select_layer(2)            -> [4, 5]                  # d (score -0.3), e (-1.1): depth 6
    target_next(0) = b  -> commit(2) prunes 1 and its subtree (1, 4) and drops candidate 3; root = 2
    target_next(2) = x  -> miss: restart(x) prunes 5, adds bonus 6:x (committed, not yet injected)
"""
from __future__ import annotations

from collections.abc import Callable
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

    def spine(self, max_depth: int | None = None) -> int | None:
        """The candidate `select_layer(1)` would take next (without taking it)."""
        deepest = max((n.depth for n in self.nodes.values() if n.injected), default=None)
        pool = [n for n in self.candidates(max_depth) if deepest is not None and n.depth == deepest + 1]
        return min(pool, key=lambda n: (-n.score, n.depth, n.id)).id if pool else None

    def lead(self) -> int:
        """How many layers the injected tree reaches below the root."""
        root = self.root_node.depth
        return max((n.depth for n in self.nodes.values() if n.injected), default=root) - root

    def select_hybrid(self, width: int, max_depth: int | None = None) -> list[int]:
        """The spine node (best child of the deepest layer) — followed, when the draft has already expanded
        it (a lookahead), by its best child in the same micro-batch, so a lagging tree catches up — plus the
        best remaining candidates at any depth."""
        spine = self.select_layer(min(1, width), max_depth)
        while spine and len(spine) < width and self.nodes[spine[-1]].expanded:
            nxt = self.select_layer(1, max_depth)
            if not nxt:
                break
            spine += nxt
        rest = self.select_best_first(width - len(spine), max_depth)
        return sorted(spine + rest, key=lambda i: (self.nodes[i].depth, i))

    def select(self, policy: str, width: int, max_depth: int | None = None) -> list[int]:
        if policy == "layer":
            return self.select_layer(width, max_depth)
        if policy == "best-first":
            return self.select_best_first(width, max_depth)
        if policy == "hybrid":
            return self.select_hybrid(width, max_depth)
        raise ValueError(f"unknown tree policy {policy!r}; choose from {', '.join(POLICIES)}")

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

    def commit(self, child_id: int) -> list[int]:
        """Hit: the child becomes the root. Returns the computed nodes pruned (its siblings' subtrees)."""
        child = self.nodes[child_id]
        if child.parent != self.root:
            raise ValueError(f"node {child_id} is not a child of the root {self.root}")
        pruned = []
        for sib in self.nodes[self.root].children:
            if sib != child_id:
                pruned.extend(self._drop_subtree(sib))
        del self.nodes[self.root]
        child.parent, child.committed = -1, True
        self.root = child_id
        return pruned

    def restart(self, token: int) -> tuple[int, list[int]]:
        """Miss: commit `token` as a new bonus node below the root, pruning everything else.
        Returns (bonus id, computed nodes pruned). The bonus still has to be injected."""
        pruned = []
        for c in self.nodes[self.root].children:
            pruned.extend(self._drop_subtree(c))
        old = self.nodes.pop(self.root)
        bonus = TreeNode(self.new_id(), -1, token, old.depth + 1, committed=True)
        self.nodes = {bonus.id: bonus}
        self.root = bonus.id
        return bonus.id, pruned

    def _drop_subtree(self, node_id: int) -> list[int]:
        """Remove a subtree; return the ids that were computed somewhere — injected (stages) or expanded
        (draft). Candidates that were only proposed never left the coordinator."""
        out, stack = [], [node_id]
        while stack:
            n = self.nodes.pop(stack.pop())
            if n.injected or n.expanded:
                out.append(n.id)
            stack.extend(n.children)
        return out

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
