"""`specpipe`'s draft, beside the coordinator (coordinator/core/schedulers/specpipe.py `SpecPipeScheduler`
takes these methods from `DraftBeside`): the rounds of draft work it hands out as jobs
(coordinator/core/drafts/job.py), and the proposals that come back becoming tree children.

Contract. The scheduler never calls the draft while it handles an event:
- `draft_job()` makes the next round, or None when nothing is due (then it dispatches: rounds counted down
  may free a request). The job carries, in order: the queued bookkeeping (`draft_ops`: commits, prunes,
  releases), the prompts of requests the draft has not held yet (`begun`), and for every request with rounds
  due (`pending`, counted down here, as jobs are *made*) its best nodes not yet expanded
  (`TokenTree.to_expand`, as many as its width; `layer`: the injected ones), behind the committed nodes the
  draft never computed (`unseen`). Those nodes are marked asked, so no later job takes them again and a prune
  names them. Chained (`chain`, coordinator/core/drafts/chain.py): every round due goes in one job, the draft
  choosing the later rounds' nodes from the frontier it is handed (marked asked too) and the children it
  proposes; a bonus root's first round goes alone.
- `draft_done(job, results)` applies a job's results, in the order jobs were made: the draft's time is charged
  to the requests in proportion to the rows it computed for each, a failure ends its request (not the
  scheduler), proposals become children of the nodes still in their tree (a result may have pruned some
  meanwhile: their rows are dropped), and the cost rule sees the round's time; then it dispatches.
- `draft_next(job, results)` is `draft_done` and then `draft_job` in one call: what the driver calls when a
  job comes back (the engine's draft loop, the simulated clock).
- `work()` runs one round in line (the in-process drivers); `_draft_now` / `_expand` run a job in line
  for the trip baselines (coordinator/core/schedulers/trip.py).

Worked example (one request, rounds 2): an injection sets `pending` = 2. `draft_job()` -> job 1, expanding
the tree's best unexpanded nodes, say [5, 7], now asked; `pending` = 1, so the request is ready again (a
round has started). Before job 1 comes back a result commits 5 and prunes 7: both go to `draft_ops`, behind
job 1. `draft_done(job 1, results)` adds 5's proposed children and drops 7's row; the next `draft_job()`
carries the commit and the prune first, then the request's second round.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from coordinator.core.drafts.base import DraftNode, DraftNodes
from coordinator.core.drafts.chain import Chain, candidates
from coordinator.core.drafts.job import DraftJob, DraftOp, DraftResults, OpKind
from coordinator.core.schedulers.base import RequestState
from coordinator.core.status import FinishReason, Status
from coordinator.core.vocabulary import TreePolicy

if TYPE_CHECKING:
    from coordinator.core.calibration import Calibration
    from coordinator.core.drafts.base import DraftSource
    from coordinator.core.sizing import Sizer
    from coordinator.core.tree import TokenTree


class DraftBeside:
    """The draft part of `SpecPipeScheduler` (module docstring). What it uses of the scheduler: the state
    below (set in `SpecPipeScheduler.__init__`), `requests`, `num_stages`, and `_dispatch`, `_finish`,
    `_share`, `_rejection`, `_max_depth`."""
    draft: DraftSource
    trees: dict[str, TokenTree]
    pending: dict[str, int]
    begun: set[str]
    unseen: dict[str, list[DraftNode]]
    draft_ops: list[DraftOp]
    sizer: Sizer | None
    width: int
    topk: int
    policy: str
    chain: bool
    out_job: DraftJob | None
    calibration: Calibration | None

    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.draft_ops)

    def work(self) -> None:
        """One round of draft work in line (the in-process drivers; the engine and the simulated clock run
        `draft_job` beside the coordinator instead)."""
        job = self.draft_job()
        if job is not None:
            self.draft_done(job, job.run(self.draft))

    def draft_job(self) -> DraftJob | None:
        """The next round of draft work, or None when nothing is due: the queued bookkeeping; the prompts of
        new requests to prefill; and for every request with rounds due, its best nodes not yet expanded
        (`TokenTree.to_expand`, as many as its width; `layer`: the injected ones), now marked asked so no
        later job takes them again and a prune names them."""
        job = DraftJob(ops=self.draft_ops, topk=self.topk)
        self.draft_ops = []
        width = min(self.width, self._share())
        lead = self.num_stages if self.policy == TreePolicy.HYBRID else 0
        for request_id in list(self.pending):
            state = self.requests.get(request_id)
            if state is None:
                del self.pending[request_id]
                continue
            tree = self.trees[request_id]
            due = self.pending[request_id]
            chained = self.chain and due > 1 and bool(tree.a.expanded[0]) and self.policy != TreePolicy.LAYER
            self.pending[request_id] = 0 if chained else due - 1       # (a chain takes every round due)
            if self.pending[request_id] <= 0:
                del self.pending[request_id]
            if request_id not in self.begun:             # the draft holds the request from this job on
                self.begun.add(request_id)
                job.begin.append((request_id, state.request.prompt_ids, state.request.sampling, self._rejection(state)))
            if self.calibration is not None and state.request.sampling.greedy:
                job.calibrated.add(request_id)
            limit = self._max_depth(state, tree)
            if chained:
                self._chain(job, state, tree, due, width, limit, lead)
                continue
            if self.policy == TreePolicy.LAYER:
                rows = tree.expand_rows(tree.a.n, limit, state.request.eos_ids, injected_only=True)
            else:
                rows = tree.expand_rows(width, limit, state.request.eos_ids, spine_lead=lead)
            if len(rows):
                self._ask(job, request_id, *tree.ask(rows, state.root_parent))
                job.asked_at[request_id] = (tree.a.layout, rows)
        if job.calibrated:
            job.calibration = self.calibration.table()
        if job.ops or job.begin or job.expand:
            self.out_job = job
            return job
        self._dispatch()                  # nothing to compute: the rounds counted down may free a request
        return None

    def _chain(self, job: DraftJob, state: RequestState, tree: TokenTree, rounds: int, width: int, limit: int,
               lead: int) -> None:
        """A job's rounds for one request, chained (coordinator/core/drafts/chain.py): the first round's nodes as
        for any job; the frontier (the next best (rounds - 1) * width usable nodes) marked asked, so a prune
        names it while the draft may expand it; a block of ids for the children."""
        request_id, a = state.request.request_id, tree.a
        ranked, tipped = tree.expand_ranked(rounds * width, limit, state.request.eos_ids, spine_lead=lead)
        if not len(ranked):
            return
        rows, frontier = tree.parents_first(ranked[:width]), ranked[width:]
        a.asked[frontier] = True
        self._ask(job, request_id, *tree.ask(rows, state.root_parent))
        tip = int(np.flatnonzero(rows == ranked[0])[0]) if tipped else -1
        job.chains[request_id] = Chain(
            rounds, width, self.topk, state.new_node(rounds * width * self.topk), limit, state.request.eos_ids,
            int(a.depth[0]) + lead, a.id[rows], a.depth[rows], a.score[rows], tip,
            candidates(a.id[frontier], a.parent[frontier], a.depth[frontier], a.token[frontier], a.score[frontier],
                       a.injected[frontier]))

    def _ask(self, job: DraftJob, request_id: str, nodes: list[int], parents: list[int], positions: list[int],
             tokens: list[int]) -> None:
        """Add the expansion of these tree nodes (marked asked: `TokenTree.ask`) to the job, behind the
        committed nodes the draft has not computed yet (`unseen`)."""
        state = self.requests[request_id]
        job.expand.append((request_id, DraftNodes(self.unseen.pop(request_id, []), nodes, parents, positions, tokens)))
        job.tree_nodes[request_id] = nodes
        if self._rejection(state):
            job.keep_q.add(request_id)

    def draft_done(self, job: DraftJob, results: DraftResults) -> None:
        """A job's results: failures end their requests; proposals become children (of the nodes still in
        their tree: a result may have pruned some meanwhile); then the next micro-batch may go in."""
        self._apply(job, results)
        self._dispatch()

    def draft_next(self, job: DraftJob, results: DraftResults) -> DraftJob | None:
        """`draft_done(job, results)`, then the next job while rounds are due (`draft_job()`), in one call:
        the draft's hand-over costs the coordinator one call per round instead of two (each call after a
        model's forward starts with cold caches). None: nothing is due."""
        self.draft_done(job, results)
        return self.draft_job() if self.has_work else None

    def _apply(self, job: DraftJob, results: DraftResults) -> None:
        if self.out_job is job:
            self.out_job = None
        if self.sizer is not None and job.expand and not job.begin and not results.errors:
            rows = sum(len(nodes) for _, nodes in job.expand) + \
                sum(len(done.node_ids) for chain in results.chained.values() for done in chain[1:])
            for _ in range(results.rounds):       # a chained job: its rounds, alike
                self.sizer.observe_draft(rows / results.rounds, results.compute_ms / results.rounds)
        weights: dict[str, int] = {}          # request -> rows the draft computed for it
        for request_id, prompt, *_ in job.begin:
            a, b = job.rows.get(request_id, (0, len(prompt)))
            weights[request_id] = b - a
        for request_id, nodes in job.expand:
            later = sum(len(done.node_ids) for done in results.chained.get(request_id, ())[1:])
            weights[request_id] = weights.get(request_id, 0) + len(nodes) + later
        total = sum(weights.values())
        for request_id, w in weights.items():            # the draft's time, charged in proportion to its rows
            if request_id in self.requests and total:
                self.requests[request_id].spec.draft_ms += results.compute_ms * w / total
        for request_id, error in results.errors.items():
            if request_id in self.requests:              # a failing draft fails its request, not the scheduler
                self._draft_failed(self.requests[request_id], error)
        for request_id, chain in job.chains.items():
            tree = self.trees.get(request_id)
            if tree is None:
                continue
            a = tree.a
            rows, live = tree.rows(chain.asked)        # the frontier the draft left: askable again
            a.asked[rows[live & ~a.expanded[rows]]] = False
            done = results.chained.get(request_id, ())
            if self.unseen.get(request_id):          # a frontier node committed, then restarted from: the chain
                computed = {i for r in done for i in r.node_ids.tolist()}      # computed it, or it stays unseen
                self.unseen[request_id] = [n for n in self.unseen[request_id] if n.node_id not in computed]
                if not self.unseen[request_id]:
                    del self.unseen[request_id]
            left = chain.rounds - len(done)
            if results.cut and left > 0 and request_id not in self.plain:    # cut short by a result: the rest,
                self.pending[request_id] = max(self.pending.get(request_id, 0), min(left, self.rounds))   # from
                # the tree (no more than the rounds now chosen)
        for request_id, nodes in job.tree_nodes.items():
            if request_id not in self.requests or request_id not in results.proposals:
                continue
            if request_id in job.chains:
                self._apply_chain(request_id, job.chains[request_id], results)
                continue
            rows = results.proposals[request_id]
            # (the rows before the tree's nodes are committed nodes the draft had not computed: `unseen`)
            tree = self.trees[request_id]
            keep = tree.add_asked(nodes, rows, first=len(rows) - len(nodes), asked_at=job.asked_at.get(request_id))
            for node_id in keep if request_id in results.q else ():
                tree.q[node_id] = results.q[request_id].get(node_id)

    def _apply_chain(self, request_id: str, chain: Chain, results: DraftResults) -> None:
        """A chained job's rounds become children, in one step (`add_grown`; round by round where it cannot). The
        nodes the draft made and computed whose parent left the tree meanwhile (a commit then a restart there:
        the committed parent is not pruned, and the tree never had them) are pruned in the draft (ids from the
        job's block: never committed)."""
        tree = self.trees[request_id]
        rounds = results.chained.get(request_id, ())
        grown = results.grown.get(request_id)
        added = tree.add_grown(grown) if grown is not None else None     # every round in one step
        if added is not None:
            keep, gone = added
        else:
            keep = [i for done in rounds for i in tree.add_chained(done.node_ids, done.proposals, done.child_ids)]
            made = np.concatenate([done.node_ids for done in rounds[1:]] or [np.zeros(0, np.int64)])
            made = made[made >= chain.first]
            gone = made[~tree.rows(made)[1]] if len(made) else made
        for node_id in keep if request_id in results.q else ():
            tree.q[node_id] = results.q[request_id].get(node_id)
        if len(gone):
            self.draft_ops.append(DraftOp(OpKind.PRUNE, request_id, tuple(gone.tolist())))

    def _draft_now(self, job: DraftJob) -> None:
        """Run a job in line, the queued bookkeeping first, and apply it (the trip baselines)."""
        job.ops, self.draft_ops = self.draft_ops + job.ops, []
        self._apply(job, job.run(self.draft))

    def _expand(self, request_id: str, nodes: list[int]) -> None:
        """Expand these nodes of one request now (the trip baselines)."""
        if not nodes:
            return
        job, tree = DraftJob(topk=self.topk), self.trees[request_id]
        tree.mark_asked(nodes)
        self._ask(job, request_id, nodes, *tree.segment_rows(nodes, self.requests[request_id].root_parent))
        if job.expand:
            self._draft_now(job)

    def _draft_failed(self, state: RequestState, error: Exception) -> None:
        self._finish(state, FinishReason.ERROR, error=f"draft failed: {error!r}", error_code=Status.INTERNAL)
