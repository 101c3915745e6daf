"""`specpipe`: a dynamic speculative token tree grows into the pipeline every step (arXiv 2504.04104), so
that ideally one token commits per pipeline step instead of one per S steps.

Per request, while fewer than S of its micro-batches are in flight: grow the tree (coordinator/core/tree.py)
and inject the chosen nodes as one micro-batch; then the draft **runs ahead** (`rounds` rounds, beside the
coordinator: `draft_job` in coordinator/core/schedulers/specpipe_draft.py, over coordinator/core/drafts/job.py;
each round one batched call expanding the best not-yet-expanded nodes, injected or not; chained in one job,
coordinator/core/drafts/chain.py, unless a result cuts them), so the next micro-batch
can take a node with its already-proposed descendants. `layer` is the paper's rule: one layer per step, the
draft expands only what was injected. On a result, verify at the root: **hit** (`TokenTree.commit`), or
**miss** with a warm restart (`reroot`) or a fresh **bonus** (`restart`), which the draft expands before it
goes in. Commits and prunes are broadcast to every stage.

Worked example (S = 4, best-first, width 4, rounds 2): the root r was injected with children a, b. The
draft expanded a, b (round 1) and a's best child a1 (round 2). The next micro-batch is best-first over
{a's and b's other children, a1's children...}: e.g. [a2, a1x, b1, a1y] spans depths 2 and 3.

With several requests (SpecPipe-DB) every micro-batch carries the next rows of all ready requests under
a shared node budget (coordinator/core/schedulers/batching.py): each request's width is
min(width, node_budget // requests held) — a request alone may use its whole width — and the draft
expands the nodes of all requests in one batched call per round.

Lossless: every committed token is the target's argmax after the committed prefix when greedy; when
sampling, see coordinator/core/verify.py.
"""
from __future__ import annotations

import numpy as np

from common.batch import MicroBatch, Segment
from common.sampling import uniform

from coordinator.core.calibration import Calibration
from coordinator.core.drafts.base import DraftNode, DraftSource
from coordinator.core.drafts.job import DraftJob, DraftOp, OpKind
from coordinator.core.schedulers.base import RequestState
from coordinator.core.schedulers.batching import BatchingScheduler
from coordinator.core.schedulers.specpipe_draft import DraftBeside
from coordinator.core.sizing import Sizer
from coordinator.core.stats import SpecCounters
from coordinator.core.status import FinishReason
from coordinator.core.tree import Hit, TokenTree
from coordinator.core.vocabulary import TREE_POLICIES, VERIFIERS, TreePolicy, Verifier
from coordinator.core.verify import verify_children


class SpecPipeScheduler(DraftBeside, BatchingScheduler):
    name = "specpipe"
    overtakes = True             # a full pipeline is speculation: a new prompt's first chunk need not wait
    holds_finished_slot = True   # and the slot a finished request frees may wait a step for the next prompt
    drafts_beside = True         # draft rounds are jobs that run beside the scheduler (draft_job, draft_next)

    def __init__(self, num_stages: int, draft: DraftSource, width: int = 32, policy: str = "hybrid",
                 topk: int = 16, node_budget: int = 32, verify: str = "match", rounds: int = 2,
                 prefill_chunk: int = 256, sizer: Sizer | None = None, chain: bool = True,
                 calibration: Calibration | None = None) -> None:
        super().__init__(num_stages, node_budget, prefill_chunk)
        if width < 1 or topk < 1 or rounds < 1:
            raise ValueError("width, topk and rounds must be at least 1")
        if policy not in TREE_POLICIES:
            raise ValueError(f"unknown tree policy {policy!r}; choose from {', '.join(TREE_POLICIES)}")
        if verify not in VERIFIERS:
            raise ValueError(f"unknown verifier {verify!r}; choose from {', '.join(VERIFIERS)}")
        self.verify = verify
        self.draft, self.width, self.policy, self.topk = draft, width, policy, topk
        self.rounds = 1 if policy == TreePolicy.LAYER else rounds     # draft calls per step (run-ahead)
        self.chain = chain and draft.chains      # a step's rounds in one job (coordinator/core/drafts/chain.py)
        self.out_job: DraftJob | None = None     # the job the draft computes (at most one): a result cuts its chains
        self.trees: dict[str, TokenTree] = {}
        self.pending: dict[str, int] = {}            # request -> draft rounds still due since its last injection
        self.begun: set[str] = set()                 # requests whose prompt the draft has seen
        # committed nodes whose rows the draft never computed (a miss at a root whose result came back before
        # the draft expanded it): they go in front of the request's next draft call, parents first
        self.unseen: dict[str, list[DraftNode]] = {}
        self.miss_batch: dict[str, int] = {}         # request -> first micro-batch id injected after its last miss
        self.draft_ops: list[DraftOp] = []           # bookkeeping for the draft, sent ahead of its next job
        # the cost rule (coordinator/core/sizing.py): width, topk and rounds chosen online, or none
        self.max_width = width
        self.sizer = sizer if sizer is not None and sizer.sizing.auto else None
        if self.sizer is not None and self.sizer.choice.speculates:     # a sizer that served earlier requests
            self.width, self.topk, self.rounds = self.sizer.choice.width, self.sizer.choice.topk, \
                1 if policy == TreePolicy.LAYER else self.sizer.choice.rounds
        self.plain: set[str] = set()                 # requests served without speculation (the rule chose none)
        # the tree's scores from the draft's measured acceptance (coordinator/core/calibration.py; None: the
        # draft's own log-probabilities), learnt across requests, or carried over from an earlier scheduler
        self.calibration = calibration
        self._control_ms = 0.0                       # control time charged since the last result
        self._committed = 0                          # tokens committed, all requests

    @property
    def kv_rows_per_batch(self) -> int:
        return self.max_width + 1

    # -- scheduler hooks ----------------------------------------------------------------------------
    def _admitted(self, state: RequestState) -> None:
        request_id, prompt = state.request.request_id, state.request.prompt_ids
        state.stats.spec = SpecCounters()   # its speculation counters are there from the start (zero)
        root = state.committed[-1]
        self.trees[request_id] = TokenTree(root, prompt[-1], len(prompt) - 1, state.new_node)
        if self.sizer is not None and not self.sizer.choice.speculates:
            self.plain.add(request_id)             # plain pipelining: the draft never sees it
        else:
            self.pending[request_id] = self.rounds     # the draft prefills and expands the root in its next job

    def _ready(self, state: RequestState) -> bool:
        """Room in the pipeline; not a bonus whose children the draft has not proposed yet; and a draft round
        *started* since the request's last injection (`pending` counts down as jobs are made, not as they
        come back). Beside the coordinator a round starts right after an injection, so a result finds the
        request ready and the next growth takes what has been proposed so far; in line (the in-process
        drivers) the round has run by then."""
        request_id = state.request.request_id
        if request_id in self.plain:               # one micro-batch at a time, as `pp`
            return state.in_flight == 0
        a = self.trees[request_id].a              # (row 0: the root)
        # a bonus waits for its children
        cold = self.policy != TreePolicy.LAYER and not a.injected[0] and not a.expanded[0]
        return self.pending.get(request_id, 0) < self.rounds and not cold and state.in_flight < self.num_stages

    def _share_beside_prompts(self) -> int:
        return 1          # speculation gives way for the one step a prompt travels with it

    def _solo_share(self) -> int:
        return max(self.width, self.node_budget)

    def _row_value(self, state: RequestState) -> float:
        """The chance that the request's next layer is used: its measured acceptance (hits and misses so far,
        Laplace-smoothed) to the power of its micro-batches in flight — the next rows sit that many layers of
        unverified speculation deep. A request with nothing in flight (new, or just after a miss) comes
        first: its rows are sure to count, as a continuous-batching row is.

            hits 8, misses 2, 3 batches in flight -> (9 / 12) ** 3 = 0.42;  nothing in flight -> 1.0
        """
        hits, misses = state.spec.hits, state.spec.misses
        return ((hits + 1.0) / (hits + misses + 2.0)) ** state.in_flight

    @staticmethod
    def _max_depth(state: RequestState, tree: TokenTree) -> int:
        """The deepest position a node of this request can still be committed at."""
        return int(tree.a.depth[0]) + state.request.max_new_tokens - len(state.generated)

    def _next_rows(self, state: RequestState, share: int) -> Segment | None:
        """The tree's next growth, at most min(width, share) nodes (`layer`: a bonus alone); the draft then
        runs ahead in its jobs."""
        request_id = state.request.request_id
        tree = self.trees[request_id]
        injected = tree.a.injected                 # (row 0: the root)
        if request_id in self.plain:               # the root alone (the last committed token), once
            if injected[0]:
                return None
            injected[0] = True
            parents, positions, tokens = tree.segment_rows([tree.root], state.root_parent)
            return Segment(request_id, [tree.root], parents, positions, tokens, [True])
        if self.policy == TreePolicy.LAYER and not injected[0]:
            injected[0] = True
            rows = np.zeros(1, np.int64)           # the root
        else:
            rows = tree.select_rows(self.policy, min(self.width, share), self._max_depth(state, tree),
                                    horizon=self.num_stages)
        if not len(rows):
            return None
        state.spec.nodes_injected += len(rows)
        self.pending[request_id] = self.rounds
        chosen, parents, positions, tokens = tree.segment_of(rows, state.root_parent)
        return Segment(request_id, chosen, parents, positions, tokens, [True] * len(chosen))

    def _on_segment(self, state: RequestState, seg: Segment, outputs: list[int], logprobs=None) -> None:
        tree = self.trees[state.request.request_id]
        out_ids = [node_id for node_id, want in zip(seg.node_ids, seg.want_output) if want]
        tree.set_target_next(out_ids, outputs)
        if self._rejection(state) and logprobs is not None:
            for i, node_id in enumerate(out_ids):
                if node_id in tree.nodes:
                    tree.target_p[node_id] = logprobs[i]
        committed = len(state.generated)
        misses = state.spec.misses
        if not self._verify(state, tree):
            return
        if self.sizer is not None and committed and state.request.request_id not in self.plain:
            self.sizer.observe_tokens(len(state.generated) - committed)
        if len(state.generated) == committed and state.spec.misses == misses:
            # nothing committed: the pipeline was refilling after a miss, or the tree lagged behind it
            stale = self._result_batch < self.miss_batch.get(state.request.request_id, -1)
            if stale:
                state.spec.refill_steps += 1
            else:
                state.spec.lag_steps += 1

    def _rejection(self, state: RequestState) -> bool:
        """This request samples and is verified by rejection (the last stage ships distributions); a plain
        request takes the target's own draw."""
        return self.verify == Verifier.REJECTION and not state.request.sampling.greedy and \
            state.request.request_id not in self.plain

    def _wants_logprobs(self, segments: list[Segment]) -> bool:
        return any(self._rejection(self.requests[s.request_id]) for s in segments)

    def _finish(self, state: RequestState, reason: FinishReason, error: str = "", error_code: int = 0) -> None:
        request_id = state.request.request_id
        self.trees.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.unseen.pop(request_id, None)
        self.miss_batch.pop(request_id, None)
        self.begun.discard(request_id)           # the draft may hold it (begun) or have had a commit for it: release
        if self.sizer is not None:        # the cost rule's last choice for it (0: no speculation)
            plain = request_id in self.plain
            state.stats.sized_width, state.stats.sized_topk = (0, 0) if plain else (self.width, self.topk)
            state.stats.sized_calibration = self.sizer.calibration if self.sizer.decided else None
        self.plain.discard(request_id)
        self.draft_ops.append(DraftOp(OpKind.RELEASE, request_id))
        super()._finish(state, reason, error, error_code)

    # -- the cost rule (coordinator/core/sizing.py) ---------------------------------------------------
    def charge_control(self, ms: float) -> None:
        super().charge_control(ms)
        self._control_ms += ms

    def on_result(self, batch: MicroBatch) -> None:
        if self.out_job is not None:      # the chained rounds done so far are wanted now (DraftJob.cut)
            self.out_job.cut = True
        if self.sizer is not None:
            self._observe(batch)
        committed, running = self._committed, len(self.requests)
        super().on_result(batch)
        if self.sizer is not None:
            if running:                   # (results of finished requests still come back: not a pace)
                self.sizer.observe_result(batch.arrived_ms, self._committed - committed, running)
            if not self.requests:
                self.sizer.idle()
            before = self.sizer.choice
            if self.sizer.step(len(self.requests)) != before:
                self._resize()

    def _commit(self, state: RequestState, node_ids: list[int], tokens: list[int],
                prune: list[int] | tuple[int, ...] = ()) -> bool:
        self._committed += min(len(tokens), state.request.max_new_tokens - len(state.generated))
        return super()._commit(state, node_ids, tokens, prune)

    def _observe(self, batch: MicroBatch) -> None:
        """A result's costs: each stage's step (compute and emulated time) against its rows, the round
        trip's rest per stage (the hop), the control time since the last result."""
        sizer, steps, speculating = self.sizer, 0.0, len(self.plain) < len(self.trees)
        for t in batch.trace:
            sizer.observe_stage(t.rows_computed, t.compute_ms + t.wait_ms, speculating)
            steps += t.compute_ms + t.wait_ms
        if batch.trip_ms > 0 and batch.trace:
            sizer.observe_hop((batch.trip_ms - steps) / len(batch.trace), speculating)
        sizer.observe_control(self._control_ms, speculating)
        self._control_ms = 0.0

    def _resize(self) -> None:
        """Apply the rule's choice: new settings for the next rounds and micro-batches. None -> every running
        request goes on without draft rounds (what is in flight still commits; the draft keeps its state and
        follows the commits, and the committed nodes it has not computed wait in `unseen`). Speculation again
        -> they rejoin: the draft (prefilling the prompt first if it never saw it) catches up in the next
        round."""
        choice = self.sizer.choice
        if not choice.speculates:
            for request_id in self.trees:
                if request_id not in self.plain:
                    self.plain.add(request_id)
                    self.pending.pop(request_id, None)
            self._dispatch()              # a request waiting for its draft round goes in now, plain
            return
        self.width, self.topk = choice.width, choice.topk
        self.rounds = 1 if self.policy == TreePolicy.LAYER else choice.rounds
        for request_id in self.pending:          # fewer rounds now: none is due beyond them
            self.pending[request_id] = min(self.pending[request_id], self.rounds)
        for request_id in self.plain:
            self.pending[request_id] = self.rounds
            if request_id not in self.begun and self.requests[request_id].generated:   # its commits, after its prefill
                state = self.requests[request_id]
                nodes = state.committed[len(state.request.prompt_ids):]
                self.draft_ops.append(DraftOp(OpKind.COMMIT, request_id, tuple(nodes), tuple(state.generated)))
        self.plain.clear()
        self._dispatch()

    # -- verification -------------------------------------------------------------------------------
    def _verify(self, state: RequestState, tree: TokenTree) -> bool:
        """Commit as far as the known target tokens allow. Returns False when the request finished."""
        request_id = state.request.request_id
        rejection = self._rejection(state)
        while (target := tree.root_target()) is not None:
            # by rejection where the root's distribution came back; a root injected while the request was plain
            # (no distributions asked) is verified by the target's own draw, as `match` does: lossless too
            if rejection and tree.target_p.get(tree.root) is not None:
                child, token = self._decide(state, tree)
                rank = tree.root_rank(token)
            elif not rejection and (hits := tree.match_path()):     # every hit down the tree, in one step
                if not self._hits(state, tree, hits):
                    return False
                continue
            else:
                child, *rank = tree.match_root(target)
                token = target
                if self.calibration is not None and state.request.sampling.greedy and request_id not in self.plain:
                    self.calibration.observe(int(tree.a.conf[0]), rank[0], tree.root_children())
            plain = request_id in self.plain     # no speculation: the target's token is the next root, no miss
            if self.sizer is not None and not plain:
                self.sizer.observe_root(*rank)
            if child is not None:
                state.spec.hits += 1
                pruned = tree.commit(child)
                node = child
            else:
                root, proposed = tree.root_node, None
                if plain:
                    state.spec.plain_tokens += 1   # the target's token, with no speculation to check
                else:
                    state.spec.misses += 1
                    self.miss_batch[request_id] = self._next_batch
                    # (with rejection an injected child outside the verified prefix may carry the token: cold
                    # restart)
                    same = [c for c in root.children if tree.nodes[c].token == token]
                    proposed = next((c for c in same if not tree.nodes[c].injected), None)
                    if same:
                        state.spec.misses_proposed_not_injected += 1
                    else:
                        state.spec.misses_not_proposed += 1
                if proposed is not None and self.policy != TreePolicy.LAYER:
                    state.spec.warm_restarts += 1
                    node, pruned = proposed, tree.reroot(proposed)
                else:
                    # the bonus's parent reaches the draft before it (a chain's frontier is asked but may be left:
                    # then it stays unseen, `_apply`)
                    if not root.expanded and (not root.asked or self._in_frontier(request_id, root.id)):
                        self.unseen.setdefault(request_id, []).append(DraftNode(root.id, state.root_parent, root.depth,
                                                                         root.token))
                    node, pruned = tree.restart(token)
                if self.policy != TreePolicy.LAYER and not tree.a.expanded[0] and not plain:
                    self.pending[request_id] = self.rounds           # the draft expands the new root before it goes in
            if not plain or request_id in self.begun:    # (a request the draft never held: told when it rejoins)
                if pruned.expanded:
                    self.draft_ops.append(DraftOp(OpKind.PRUNE, request_id, tuple(pruned.expanded)))
                self.draft_ops.append(DraftOp(OpKind.COMMIT, request_id, (node,), (token,)))
            if not self._commit(state, [node], [token], prune=pruned.injected):
                return False
            if child is None:
                break             # the new root has no target token yet
        return True

    def _hits(self, state: RequestState, tree: TokenTree, hits: list[Hit]) -> bool:
        """Commit the hits of `match_path` at once (what `_verify` does for each: the calibration and the cost
        rule see every level, the tree reroots once, the draft and the stages get one commit with every prune).
        Returns False when the request finished."""
        request_id = state.request.request_id
        plain = request_id in self.plain      # (its tree in flight still commits)
        if not plain:
            calibrate = self.calibration is not None and state.request.sampling.greedy
            for h in hits:
                if calibrate:
                    self.calibration.observe(h.conf, h.rank, h.children)
                if self.sizer is not None:
                    self.sizer.observe_root(h.rank, h.injected)
        state.spec.hits += len(hits)
        nodes, tokens = [h.child for h in hits], [h.token for h in hits]
        pruned = tree.commit_path(nodes)
        if not plain or request_id in self.begun:
            if pruned.expanded:
                self.draft_ops.append(DraftOp(OpKind.PRUNE, request_id, tuple(pruned.expanded)))
            self.draft_ops.append(DraftOp(OpKind.COMMIT, request_id, tuple(nodes), tuple(tokens)))
        return self._commit(state, nodes, tokens, prune=pruned.injected)

    def _in_frontier(self, request_id: str, node_id: int) -> bool:
        """The node is asked as the frontier of the chained job out (coordinator/core/drafts/chain.py), which may
        leave it uncomputed."""
        chain = self.out_job.chains.get(request_id) if self.out_job is not None else None
        return chain is not None and bool((chain.asked == node_id).any())

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
