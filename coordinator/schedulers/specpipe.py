"""`specpipe`: one layer of a dynamic speculative token tree enters the pipeline every step (arXiv
2504.04104), so that ideally one token commits per pipeline step instead of one per S steps.

Per request:
1. The prompt goes in as a committed chain; the draft proposes children of its last token.
2. While fewer than S micro-batches of the request are in flight, grow the tree (coordinator/tree.py:
   `layer` or `best-first`), inject the chosen nodes as one micro-batch, and let the draft propose their
   children for the next step.
3. When a micro-batch returns, record each node's target token and verify at the root: **hit** -> commit the
   matching child, prune its siblings' subtrees; **miss** -> commit the target's token as a **bonus** node,
   prune everything in flight; the bonus goes into the next micro-batch with its first children.
Commits and prunes are broadcast to every stage (which drop pruned rows they have not computed yet).

Greedy and lossless: every committed token is the target's argmax after the committed prefix.
"""
from __future__ import annotations

from services.batch import Control, Segment

from coordinator.drafts.base import DraftNode, DraftSource
from coordinator.schedulers.base import RequestState, Scheduler
from coordinator.tree import POLICIES, TokenTree, TreeNode


LOOKAHEAD = 1      # spine nodes the draft may expand ahead of injection per step (hybrid, when lagging)


class SpecPipeScheduler(Scheduler):
    name = "specpipe"

    def __init__(self, num_stages: int, draft: DraftSource, width: int = 16, policy: str = "hybrid",
                 topk: int = 8) -> None:
        super().__init__(num_stages)
        if width < 1 or topk < 1:
            raise ValueError("width and topk must be at least 1")
        if policy not in POLICIES:
            raise ValueError(f"unknown tree policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.draft, self.width, self.policy, self.topk = draft, width, policy, min(topk, width)
        self.trees: dict[str, TokenTree] = {}
        self.pending: dict[str, list[int]] = {}      # request -> injected nodes the draft must expand
        self.begun: set[str] = set()                 # requests whose prompt the draft has seen

    # -- scheduler hooks ----------------------------------------------------------------------------
    def _start(self, state: RequestState) -> None:
        rid, prompt = state.request.request_id, state.request.prompt_ids
        state.count("hits", 0)
        state.count("misses", 0)
        nodes = [state.new_node() for _ in prompt]
        state.committed.extend(nodes)
        n = len(prompt)
        self._broadcast(Control(rid, commit=nodes))
        self._inject([Segment(rid, nodes, [-1] + nodes[:-1], list(range(n)), list(prompt),
                              [False] * (n - 1) + [True])])
        self.trees[rid] = TokenTree(nodes[-1], prompt[-1], n - 1, state.new_node)
        self.pending[rid] = [nodes[-1]]          # the draft prefills and expands the root in work()

    def _on_segment(self, state: RequestState, seg: Segment, outputs: list[int]) -> None:
        tree = self.trees[state.request.request_id]
        out = iter(outputs)
        for node_id, want in zip(seg.node_ids, seg.want_output):
            if want:
                token = next(out)
                if node_id in tree.nodes:
                    tree.nodes[node_id].target_next = token
        if self._verify(state, tree):
            self._fill(state)

    def _finish(self, state: RequestState, reason: str, error: str = "", error_code: int = 0) -> None:
        rid = state.request.request_id
        self.trees.pop(rid, None)
        self.pending.pop(rid, None)
        if rid in self.begun:
            self.begun.discard(rid)
            self.draft.release(rid)
        super()._finish(state, reason, error, error_code)

    # -- verification -------------------------------------------------------------------------------
    def _verify(self, state: RequestState, tree: TokenTree) -> bool:
        """Commit as far as the known target tokens allow. Returns False when the request finished."""
        rid = state.request.request_id
        while (token := tree.root_node.target_next) is not None:
            child = tree.matching_child(tree.root, token)
            if child is not None:
                state.count("hits")
                pruned = tree.commit(child)
                node = child
            else:
                state.count("misses")
                proposed = any(tree.nodes[c].token == token for c in tree.root_node.children)
                state.count("misses_proposed_not_injected" if proposed else "misses_not_proposed")
                node, pruned = tree.restart(token)
            if pruned:
                self.draft.prune(rid, pruned)
            self.draft.commit(rid, [node], [token])
            if not self._commit(state, [node], [token], prune=pruned):
                return False
            if child is None:
                break             # the bonus has no target token yet
        return True

    # -- growth -------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.pending)

    def work(self) -> None:
        """Draft compute, kept out of the event handlers so that injections leave first: expand the
        nodes injected last, then inject the next layer if the pipeline has room."""
        for rid in list(self.pending):
            try:
                self._work_one(rid)
            except Exception as e:        # a failing draft fails its request, not the scheduler
                self.pending.pop(rid, None)
                if rid in self.requests:
                    self._finish(self.requests[rid], "error", error=f"draft failed: {e!r}", error_code=13)

    def _work_one(self, rid: str) -> None:
        state, tree = self.requests[rid], self.trees[rid]
        nodes = [tree.nodes[i] for i in self.pending.pop(rid) if i in tree.nodes]
        if rid not in self.begun:
            self.begun.add(rid)
            self._timed(state, self.draft.begin, rid, state.request.prompt_ids)
        self._expand(state, tree, [n for n in nodes if not n.expanded and n.token not in state.request.eos_ids])
        self._lookahead(state, tree)
        self._fill(state)

    def _lookahead(self, state: RequestState, tree: TokenTree) -> None:
        """hybrid: while the injected tree reaches fewer than S-1 layers below the root (after a re-root),
        let the draft expand the next spine node before it is injected, so the next micro-batch can carry
        two layers and the tree catches up with the pipeline."""
        if self.policy != "hybrid" or tree.lead() >= self.num_stages - 1:
            return
        remaining = state.request.max_new_tokens - len(state.generated)
        for _ in range(LOOKAHEAD):
            nid = tree.spine(tree.root_node.depth + remaining)
            while nid is not None and tree.nodes[nid].expanded:      # follow already expanded spine nodes
                best = max((tree.nodes[c] for c in tree.nodes[nid].children), key=lambda n: n.score, default=None)
                nid = best.id if best is not None and best.depth <= tree.root_node.depth + remaining else None
            if nid is None or tree.nodes[nid].token in state.request.eos_ids:
                return
            state.count("lookahead_nodes")
            self._expand(state, tree, [tree.nodes[nid]])

    def _fill(self, state: RequestState) -> None:
        """Inject the next micro-batch if fewer than S of this request are in flight and the draft has
        expanded everything injected so far; the new nodes then wait for expansion in work()."""
        rid = state.request.request_id
        tree = self.trees[rid]
        if state.in_flight >= self.num_stages or rid in self.pending:
            return
        root = tree.root_node
        if not root.injected:                        # a bonus after a miss goes first, alone
            root.injected = True
            chosen = [root]
        else:
            remaining = state.request.max_new_tokens - len(state.generated)
            chosen = [tree.nodes[i] for i in tree.select(self.policy, self.width, root.depth + remaining)]
        if not chosen:
            return
        parent = {tree.root: state.committed[-2]}
        self._inject([Segment(rid, [n.id for n in chosen], [parent.get(n.id, n.parent) for n in chosen],
                              [n.depth for n in chosen], [n.token for n in chosen], [True] * len(chosen))])
        state.count("nodes_injected", len(chosen))
        self.pending[rid] = [n.id for n in chosen]

    def _expand(self, state: RequestState, tree: TokenTree, nodes: list[TreeNode]) -> None:
        if not nodes:
            return
        rid = state.request.request_id
        parent_of_root = state.committed[-2] if len(state.committed) > 1 else -1
        draft_nodes = [DraftNode(n.id, parent_of_root if n.id == tree.root else n.parent, n.depth, n.token)
                       for n in nodes]
        proposals = self._timed(state, self.draft.expand, rid, draft_nodes, self.topk)
        for n, props in zip(nodes, proposals):
            tree.add_children(n.id, props)

    def _timed(self, state: RequestState, fn, *args):
        before = self.draft.compute_s
        result = fn(*args)
        state.count("draft_ms", (self.draft.compute_s - before) * 1e3)
        return result
