"""Speculative decoding bolted onto a pipeline, one speculation per full trip (the baselines SpecPipe beats):

- `sps`: a chain of k draft tokens (SpecInfer/Leviathan style), sent with the root, verified, repeat;
- `tree`: a tree of up to N nodes grown best-first by cumulative draft log-probability in rounds of `topk`
  (EAGLE-2 style: each round the draft expands the best candidates together), verified along the longest
  accepted path, repeat.

Each request has at most one micro-batch in flight: while it travels the S stages, S-1 of them idle — the
narrow speculative window SpecPipe removes. Verification, commits, prunes and the draft's KV bookkeeping are
SpecPipe's (this class only changes how a speculation is grown and when it is sent). Counters: `hits` are
accepted draft tokens, `misses` the target's own (bonus) token that ends every trip.
"""
from __future__ import annotations

import math

from common.batch import Segment

from coordinator.core.drafts.base import DraftSource
from coordinator.core.drafts.job import DraftJob
from coordinator.core.schedulers.base import RequestState
from coordinator.core.schedulers.specpipe import SpecPipeScheduler
from coordinator.core.status import FinishReason
from coordinator.core.vocabulary import TreePolicy


class TripScheduler(SpecPipeScheduler):
    drafts_beside = False        # a speculation is grown with the draft in line (`work`)
    def __init__(self, num_stages: int, draft: DraftSource, budget: int, rounds: int, per_round: int,
                 policy: str, max_in_flight: int = 1, bonus_alone: bool = False, min_prob: float = 0.0,
                 verify: str = "match", prefill_chunk: int = 256) -> None:
        super().__init__(num_stages, draft, width=budget, policy=policy, topk=per_round, verify=verify,
                         prefill_chunk=prefill_chunk)
        if rounds < 1 or max_in_flight < 1:
            raise ValueError("a speculation needs at least one round and one micro-batch in flight")
        self.budget, self.rounds, self.per_round = budget, rounds, per_round
        self.max_in_flight, self.bonus_alone = max_in_flight, bonus_alone
        self.min_logp = math.log(min_prob) if min_prob > 0 else -math.inf
        self.draft_prefilled: dict[str, int] = {}    # request -> prompt rows the draft has computed (while < n - 1)

    @property
    def kv_rows_per_batch(self) -> int:
        return self.budget + 1

    def _finish(self, state: RequestState, reason: FinishReason, error: str = "", error_code: int = 0) -> None:
        self.draft_prefilled.pop(state.request.request_id, None)
        super()._finish(state, reason, error, error_code)

    # -- no cross-request batching: each request's prompt and speculations travel alone ------------
    def _dispatch(self) -> None:
        for request_id in list(self.prefill_next):         # the prompt in chunks, back to back (each stage keeps order)
            state = self.requests[request_id]
            while request_id in self.prefill_next:
                self._inject([self._prefill_chunk(state, self.prefill_chunk)])
        for state in list(self.requests.values()):
            self._fill(state)

    def _fill(self, state: RequestState) -> None:
        request_id = state.request.request_id
        tree = self.trees[request_id]
        if self.bonus_alone and not tree.root_node.injected:      # PipeInfer's non-speculative run
            root = tree.root_node
            root.injected = True
            self._inject([Segment(request_id, [root.id], [state.root_parent], [root.depth], [root.token], [True])])
            state.spec.nodes_injected += 1
        if state.in_flight < self.max_in_flight and request_id not in self.pending:
            self.pending[request_id] = 1                 # the speculation is grown in work(), off the event path

    def work(self) -> None:
        """Grow each due request's speculation in line, the draft's queued bookkeeping first."""
        if self.draft_ops:
            self._draft_now(DraftJob())
        for request_id in list(self.pending):
            try:
                self._work_one(request_id)
            except Exception as e:        # a failing draft fails its request, not the scheduler
                self.pending.pop(request_id, None)
                if request_id in self.requests:
                    self._draft_failed(self.requests[request_id], e)

    def _work_one(self, request_id: str) -> None:
        del self.pending[request_id]
        state, tree = self.requests[request_id], self.trees[request_id]
        if request_id not in self.begun:       # the draft's prefill, one chunk per call: results are handled
            prompt = state.request.prompt_ids  # between them (the engine lets go of the lock after each)
            a = self.draft_prefilled.get(request_id, 0)
            b = min(a + self.prefill_chunk, len(prompt) - 1)
            self._draft_now(DraftJob(begin=[(request_id, prompt, state.request.sampling, self._rejection(state))],
                                     rows={request_id: (a, b)}))
            if request_id not in self.requests:
                return                         # the draft failed the request
            if b < len(prompt) - 1:
                self.draft_prefilled[request_id] = b
                self.pending[request_id] = 1   # due again: the next chunk
                return
            self.draft_prefilled.pop(request_id, None)
            self.begun.add(request_id)
        root = tree.root_node
        if not root.expanded:                  # may overlap the prompt's trip
            self._expand(request_id, [tree.root])
            if request_id not in self.requests:
                return                         # the draft failed the request
        if state.in_flight >= self.max_in_flight:
            return                             # the pipeline is full: _fill asks again after a result
        chosen = []
        if not root.injected:                  # a bonus token: it travels with the speculation below it
            root.injected = True
            chosen.append(root)
        max_depth = root.depth + state.request.max_new_tokens - len(state.generated)
        grown = 0
        for _ in range(self.rounds):
            take = min(self.per_round, self.budget - grown)
            # one layer per round
            grow = tree.select_layer if self.policy == TreePolicy.LAYER else tree.select_best_first
            picked = [tree.nodes[i] for i in grow(take, max_depth)] if take > 0 else []
            if self.min_logp > -math.inf and picked and grown:     # confidence cut-off (PipeInfer)
                weak = [n for n in picked if n.score - tree.nodes[n.parent].score < self.min_logp]
                for n in weak:
                    n.injected = False
                picked = [n for n in picked if n not in weak]
            if not picked:
                break
            grown += len(picked)
            chosen += picked
            self._expand(request_id, [n.id for n in picked if n.token not in state.request.eos_ids])
            if request_id not in self.requests:
                return
        if not chosen:
            return                             # nothing to verify: wait for the outstanding result
        chosen.sort(key=lambda n: (n.depth, n.id))
        parent = {tree.root: state.root_parent}
        self._inject([Segment(request_id, [n.id for n in chosen], [parent.get(n.id, n.parent) for n in chosen],
                              [n.depth for n in chosen], [n.token for n in chosen], [True] * len(chosen))])
        state.spec.nodes_injected += len(chosen)
        state.spec.trips += 1
        if state.in_flight < self.max_in_flight:
            self.pending[request_id] = 1             # room for another run (pipeinfer)


def make_sps(num_stages: int, draft: DraftSource, k: int, verify: str = "match",
             prefill_chunk: int = 256) -> TripScheduler:
    """A chain of k draft tokens per trip: one node per round, always below the deepest one. Sampling with
    `rejection` is speculative sampling (accept with min(1, p/q), else draw from max(p - q, 0))."""
    sched = TripScheduler(num_stages, draft, budget=k, rounds=k, per_round=1, policy="layer", verify=verify,
                          prefill_chunk=prefill_chunk)
    sched.name = "sps"
    return sched


def make_pipeinfer(num_stages: int, draft: DraftSource, run_len: int, min_prob: float,
                   prefill_chunk: int = 256) -> TripScheduler:
    """PipeInfer (arXiv 2407.11798) over our stage protocol: continuous asynchronous speculation — while fewer
    than S micro-batches are in flight, a speculative run of up to `run_len` chained draft tokens continues
    from the previous run's last token, cut short where the draft's probability falls below `min_prob` —,
    a one-token non-speculative run of the target's own token right after every miss, and early
    cancellation (a miss prunes every run below it at every stage; rows not yet computed are skipped; a
    running step is not aborted). Verification is PipeInfer's sample-then-match (`match`: the target's own
    token, greedy or its seeded sample, decides), so it is exact; `rejection` is not offered."""
    sched = TripScheduler(num_stages, draft, budget=run_len, rounds=run_len, per_round=1, policy="layer",
                          max_in_flight=num_stages, bonus_alone=True, min_prob=min_prob, prefill_chunk=prefill_chunk)
    sched.name = "pipeinfer"
    return sched


def make_tree(num_stages: int, draft: DraftSource, nodes: int, depth: int, topk: int,
              verify: str = "match", prefill_chunk: int = 256) -> TripScheduler:
    """Up to `nodes` per trip, best-first, `depth` rounds of up to `topk` expansions. Sampling with
    `rejection` verifies siblings by recursive rejection sampling (coordinator/core/verify.py)."""
    sched = TripScheduler(num_stages, draft, budget=nodes, rounds=depth, per_round=topk, policy="best-first",
                          verify=verify, prefill_chunk=prefill_chunk)
    sched.name = "tree"
    return sched
