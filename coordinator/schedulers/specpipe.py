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

With several requests (SpecPipe-DB) every micro-batch carries the next rows of all ready requests under
a shared node budget (coordinator/schedulers/batching.py): each request's width is
min(width, node_budget // requests held), so trees narrow as load grows, and the draft expands the nodes
of all requests in one batched call.

Greedy and lossless: every committed token is the target's argmax after the committed prefix.
"""
from __future__ import annotations

from services.batch import Segment
from services.sampling import uniform

from coordinator.drafts.base import DraftNode, DraftSource
from coordinator.schedulers.base import RequestState
from coordinator.schedulers.batching import BatchingScheduler
from coordinator.tree import POLICIES, TokenTree, TreeNode
from coordinator.verify import VERIFIERS, verify_children


LOOKAHEAD = 1      # spine nodes the draft may expand ahead of injection per step (hybrid, when lagging)


class SpecPipeScheduler(BatchingScheduler):
    name = "specpipe"

    def __init__(self, num_stages: int, draft: DraftSource, width: int = 16, policy: str = "hybrid",
                 topk: int = 8, node_budget: int = 32, verify: str = "match") -> None:
        super().__init__(num_stages, node_budget)
        if width < 1 or topk < 1:
            raise ValueError("width and topk must be at least 1")
        if policy not in POLICIES:
            raise ValueError(f"unknown tree policy {policy!r}; choose from {', '.join(POLICIES)}")
        if verify not in VERIFIERS:
            raise ValueError(f"unknown verifier {verify!r}; choose from {', '.join(VERIFIERS)}")
        self.verify = verify
        self.draft, self.width, self.policy, self.topk = draft, width, policy, min(topk, width)
        self.trees: dict[str, TokenTree] = {}
        self.pending: dict[str, list[int]] = {}      # request -> injected nodes the draft must expand
        self.begun: set[str] = set()                 # requests whose prompt the draft has seen
        # committed nodes whose rows the draft never computed (a miss at a root whose result came back before
        # the draft expanded it): they go in front of the request's next draft call, parents first
        self.unseen: dict[str, list[DraftNode]] = {}

    @property
    def kv_rows_per_batch(self) -> int:
        return self.width + 1

    # -- scheduler hooks ----------------------------------------------------------------------------
    def _admitted(self, state: RequestState) -> None:
        rid, prompt = state.request.request_id, state.request.prompt_ids
        state.count("hits", 0)
        state.count("misses", 0)
        root = state.committed[-1]
        self.trees[rid] = TokenTree(root, prompt[-1], len(prompt) - 1, state.new_node)
        self.pending[rid] = [root]          # the draft prefills and expands the root in work()

    def _ready(self, state: RequestState) -> bool:
        return state.request.request_id not in self.pending and state.in_flight < self.num_stages

    def _next_rows(self, state: RequestState, share: int) -> Segment | None:
        """The bonus after a miss alone, else the tree's next growth, at most min(width, share) nodes;
        the chosen nodes then wait for the draft's expansion in work()."""
        rid = state.request.request_id
        tree = self.trees[rid]
        root = tree.root_node
        if not root.injected:
            root.injected = True
            chosen = [root]
        else:
            remaining = state.request.max_new_tokens - len(state.generated)
            width = min(self.width, share)
            chosen = [tree.nodes[i] for i in tree.select(self.policy, width, root.depth + remaining)]
        if not chosen:
            return None
        parent = {tree.root: state.root_parent}
        state.count("nodes_injected", len(chosen))
        self.pending[rid] = [n.id for n in chosen]
        return Segment(rid, [n.id for n in chosen], [parent.get(n.id, n.parent) for n in chosen],
                       [n.depth for n in chosen], [n.token for n in chosen], [True] * len(chosen))

    def _on_segment(self, state: RequestState, seg: Segment, outputs: list[int], logprobs=None) -> None:
        tree = self.trees[state.request.request_id]
        rejection = self._rejection(state)
        i = 0
        for node_id, want in zip(seg.node_ids, seg.want_output):
            if want:
                node = tree.nodes.get(node_id)
                if node is not None:
                    node.target_next = outputs[i]
                    if rejection and logprobs is not None:
                        node.target_p = logprobs[i]
                i += 1
        self._verify(state, tree)

    def _rejection(self, state: RequestState) -> bool:
        """This request samples and is verified by rejection (the last stage ships distributions)."""
        return self.verify == "rejection" and not state.request.sampling.greedy

    def _wants_logprobs(self, segments: list[Segment]) -> bool:
        return any(self._rejection(self.requests[s.request_id]) for s in segments)

    def _finish(self, state: RequestState, reason: str, error: str = "", error_code: int = 0) -> None:
        rid = state.request.request_id
        self.trees.pop(rid, None)
        self.pending.pop(rid, None)
        self.unseen.pop(rid, None)
        if rid in self.begun:
            self.begun.discard(rid)
            self.draft.release(rid)
        super()._finish(state, reason, error, error_code)

    # -- verification -------------------------------------------------------------------------------
    def _verify(self, state: RequestState, tree: TokenTree) -> bool:
        """Commit as far as the known target tokens allow. Returns False when the request finished."""
        rid = state.request.request_id
        rejection = self._rejection(state)
        while tree.root_node.target_next is not None and (tree.root_node.target_p is not None or not rejection):
            child, token = self._decide(state, tree) if rejection else \
                (tree.matching_child(tree.root, tree.root_node.target_next), tree.root_node.target_next)
            if child is not None:
                state.count("hits")
                pruned = tree.commit(child)
                node = child
            else:
                state.count("misses")
                proposed = any(tree.nodes[c].token == token for c in tree.root_node.children)
                state.count("misses_proposed_not_injected" if proposed else "misses_not_proposed")
                root = tree.root_node
                if not root.expanded:        # the bonus's parent must reach the draft before the bonus
                    self.unseen.setdefault(rid, []).append(DraftNode(root.id, state.root_parent, root.depth,
                                                                     root.token))
                node, pruned = tree.restart(token)
            if pruned:
                self.draft.prune(rid, pruned)
            self.draft.commit(rid, [node], [token])
            if not self._commit(state, [node], [token], prune=pruned):
                return False
            if child is None:
                break             # the bonus has no target token yet
        return True

    def _decide(self, state: RequestState, tree: TokenTree) -> tuple[int | None, int]:
        """Rejection verification at the root: its injected children, in the draft's order up to the first
        one not in flight, against the target's and the draft's distributions there."""
        root = tree.root_node
        children = []
        for c in root.children:
            if not tree.nodes[c].injected:
                break
            children.append(c)
        u = uniform(state.request.sampling.seed, root.depth + 1, len(children) + 1, salt=2)
        j, token = verify_children(root.target_p, root.q, [tree.nodes[c].token for c in children], u)
        return (children[j] if j is not None else None), token

    # -- growth -------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.pending)

    def work(self) -> None:
        """Draft compute, kept out of the event handlers so that injections leave first: the draft
        prefills new prompts, expands the nodes injected last (all requests in one call), lets lagging
        trees look ahead, then the next micro-batch goes in if the pipeline has room."""
        jobs, self.pending = self.pending, {}
        for rid in jobs:
            if rid in self.requests and rid not in self.begun:
                state = self.requests[rid]
                try:
                    self._timed([state], lambda: self.draft.begin(rid, state.request.prompt_ids,
                                                                  state.request.sampling, self._rejection(state)))
                    self.begun.add(rid)
                except Exception as e:        # a failing draft fails its request, not the scheduler
                    self._draft_failed(state, e)
        expand = []
        for rid, ids in jobs.items():
            if rid in self.requests:
                tree, eos = self.trees[rid], self.requests[rid].request.eos_ids
                expand.append((rid, [tree.nodes[i] for i in ids if i in tree.nodes
                                     and not tree.nodes[i].expanded and tree.nodes[i].token not in eos]))
        self._expand(expand)
        for _ in range(LOOKAHEAD):
            self._expand([(rid, [n]) for rid in jobs if rid in self.requests
                          and (n := self._lookahead(self.requests[rid], self.trees[rid])) is not None])
        self._dispatch()

    def _lookahead(self, state: RequestState, tree: TokenTree) -> TreeNode | None:
        """hybrid: while the injected tree reaches fewer than S-1 layers below the root (after a re-root),
        the draft expands the next spine node before it is injected, so the next micro-batch can carry
        two layers and the tree catches up with the pipeline."""
        if self.policy != "hybrid" or tree.lead() >= self.num_stages - 1:
            return None
        limit = tree.root_node.depth + state.request.max_new_tokens - len(state.generated)
        nid = tree.spine(limit)
        while nid is not None and tree.nodes[nid].expanded:      # follow already expanded spine nodes
            best = max((tree.nodes[c] for c in tree.nodes[nid].children), key=lambda n: n.score, default=None)
            nid = best.id if best is not None and best.depth <= limit else None
        if nid is None or tree.nodes[nid].token in state.request.eos_ids:
            return None
        state.count("lookahead_nodes")
        return tree.nodes[nid]

    def _expand(self, jobs: list[tuple[str, list[TreeNode]]]) -> None:
        """One draft call for the nodes of several requests; their proposals become children."""
        jobs = [(rid, nodes) for rid, nodes in jobs if nodes]
        if not jobs:
            return
        draft_jobs, skip = [], []
        for rid, nodes in jobs:
            state, tree = self.requests[rid], self.trees[rid]
            parent_of_root = state.root_parent
            unseen = self.unseen.pop(rid, [])
            skip.append(len(unseen))
            draft_jobs.append((rid, unseen + [DraftNode(n.id, parent_of_root if n.id == tree.root else n.parent,
                                                        n.depth, n.token) for n in nodes]))
        results = self._timed([self.requests[rid] for rid, _ in jobs],
                              lambda: self.draft.expand_many(draft_jobs, self.topk),
                              weights=[len(nodes) for _, nodes in jobs])
        for (rid, nodes), proposals, extra in zip(jobs, results, skip):
            if isinstance(proposals, Exception):
                self._draft_failed(self.requests[rid], proposals)
                continue
            keep_q = self._rejection(self.requests[rid])
            for n, props in zip(nodes, proposals[extra:]):
                self.trees[rid].add_children(n.id, props)
                if keep_q:
                    n.q = self.draft.take_q(rid, n.id)

    def _draft_failed(self, state: RequestState, error: Exception) -> None:
        self._finish(state, "error", error=f"draft failed: {error!r}", error_code=13)

    def _timed(self, states: list[RequestState], fn, weights: list[int] | None = None):
        """Run draft compute and charge its time to the requests (in proportion to `weights`)."""
        before = self.draft.compute_s
        result = fn()
        spent = (self.draft.compute_s - before) * 1e3
        weights = weights or [1] * len(states)
        total = sum(weights)
        for state, w in zip(states, weights):
            state.count("draft_ms", spent * w / total)
        return result
