"""Draft work (a round, or chained rounds) as data, so the draft can run beside the coordinator (its own
thread; on the simulated clock its own resource) instead of in line with it.

A scheduler never calls the draft while it handles an event. It queues the draft's bookkeeping (`commit`,
`prune`, `release`: the tree's commits and prunes mirrored into the draft's KV) and, when a round is due,
hands out a `DraftJob`: the prompts to prefill, that bookkeeping in order, then the nodes to expand.
Whoever owns the draft runs `job.run(draft)` — one job at a time, in the order they were made — and gives
the `DraftResults` back to the scheduler (`SpecPipeScheduler.draft_done`, or `draft_next`, which also makes
the next job: one call per round). Meanwhile results may come
back, commit and prune: what they prune is queued behind the job, and the job's proposals for nodes no
longer in a tree are dropped when they are applied.

    job = sched.draft_job()          # under the scheduler's lock: cheap, pure
    results = job.run(sched.draft)   # on the draft's thread: the model's forward and top-k
    sched.draft_done(job, results)   # under the lock: proposals become children, the next batch may go in
    # or, as the engine's draft loop and the simulated clock do: applied, and the next job made, in one call
    job = sched.draft_next(job, results)

A job may carry several rounds for a request (`chains`): the draft chooses the later ones itself
(coordinator/core/drafts/chain.py), and the results hold every round's proposals (`chained`).

A failure stays with the requests it touches: an exception from a request's bookkeeping, prefill or
expansion becomes that request's error; one from a whole model call, the error of every request in it.
"""
from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from common.sampling import Sampling

from coordinator.core.calibration import CalibrationTable
from coordinator.core.drafts.base import DraftNode, DraftSource, Proposals
from coordinator.core.drafts.chain import Chain, ChainGrowth, ChainRound
from coordinator.core.proposals import ProposalRows


class OpKind(str, Enum):
    COMMIT = "commit"      # node ids, tokens
    PRUNE = "prune"        # node ids (and their subtrees)
    RELEASE = "release"    # forget the request


@dataclass(frozen=True)
class DraftOp:
    """Bookkeeping mirrored into the draft."""
    kind: OpKind
    request_id: str
    node_ids: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()


@dataclass
class DraftJob:
    ops: list[DraftOp] = field(default_factory=list)
    # (request_id, prompt, sampling, q)
    begin: list[tuple[str, list[int], Sampling, bool]] = field(default_factory=list)
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)   # request -> the prompt rows [a, b) to
    # prefill now (DraftSource.begin_many); absent: all of them
    expand: list[tuple[str, Sequence[DraftNode]]] = field(default_factory=list)   # request -> its nodes to
    # expand, in order (DraftNodes: made into tuples when the draft reads them)
    topk: int = 1
    keep_q: set[str] = field(default_factory=set)     # requests whose expanded nodes' q is taken (rejection)
    tree_nodes: dict[str, list[int]] = field(default_factory=dict)   # request -> the tree nodes expanded: the
    # last rows of its expansion (the rows before are committed nodes the draft had not computed)
    asked_at: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)   # request -> (its tree's
    # `NodeArrays.layout`, [len(tree_nodes)] the nodes' rows) when asked (TokenTree.add_asked)
    cut: bool = False      # set by the scheduler when a result comes back: chained rounds stop at a round's end
    calibration: CalibrationTable | None = None   # rescores the proposals of the requests in `calibrated` as
    calibrated: set[str] = field(default_factory=set)   # they come out of each call (coordinator/core/calibration.py)
    chains: dict[str, Chain] = field(default_factory=dict)   # request -> its later rounds, chosen by the draft
    # (coordinator/core/drafts/chain.py); its first round is its entry in `expand`

    @property
    def requests(self) -> set[str]:
        return {request_id for request_id, *_ in self.begin} | {request_id for request_id, _ in self.expand}

    def run(self, draft: DraftSource) -> "DraftResults":
        """Prefill, apply the bookkeeping (a request's commits may precede its prefill: they were queued
        before the draft held it), expand; never raises (failures are per request). Chained rounds stop at a
        round's end once `cut` is set: the scheduler sets it when a result comes back, since the rounds done
        are wanted now; the rest go in the next job, chosen from the tree as it is then."""
        steps = self.steps(draft)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def steps(self, draft: DraftSource) -> Generator[None, None, "DraftResults"]:
        """`run`, pausing at the end of each chained round but the last (before it checks `cut`): the
        simulated clock lets the round's modelled time pass there, so results arriving meanwhile cut it as
        they would on the engine. Returns the results."""
        out = DraftResults()
        before = draft.compute_s
        if self.begin:
            try:
                errors = draft.begin_many(self.begin, self.rows)
            except Exception as e:           # the call failed as a whole: every request in it
                errors = [e] * len(self.begin)
            out.errors.update({request_id: e for (request_id, *_), e in zip(self.begin, errors) if e is not None})
        started = time.perf_counter()
        self._bookkeeping(draft, out)
        out.bookkeeping_ms = (time.perf_counter() - started) * 1e3
        expand = [(request_id, nodes) for request_id, nodes in self.expand if request_id not in out.errors]
        if expand:
            try:
                results: list[Proposals | Exception] = draft.expand_many(expand, self.topk)
            except Exception as e:
                results = [e] * len(expand)
            for (request_id, nodes), got in zip(expand, results):
                if isinstance(got, Exception):
                    out.errors[request_id] = got
                    continue
                out.proposals[request_id] = self._scored(request_id, got)
                if request_id in self.keep_q:
                    out.q[request_id] = {n.node_id: draft.take_q(request_id, n.node_id) for n in nodes}
            if self.chains:
                yield from self._chain(draft, out, {request_id: len(nodes) for request_id, nodes in expand})
        out.compute_ms = (draft.compute_s - before) * 1e3
        return out

    def _bookkeeping(self, draft: DraftSource, out: "DraftResults") -> None:
        """The ops in order, each request's commits and prunes coalesced into one `DraftSource.control` (its
        commits, then its prunes: one check and one pass over the KV table, as a stage takes a control
        message). Reordering them is safe: the tree commits only live nodes and prunes only uncommitted ones,
        so no op of a job undoes another's (a control in which one would is refused: `NodeTable.check_control`).
        A release flushes the request's ops before it and always runs (the request has ended, nothing else frees
        its state); a request that failed (its prefill, an op) gets no more ops. A failure is the request's own.

            [COMMIT a (4,), PRUNE a (7, 9), COMMIT a (5,), RELEASE b]  ->  b released, then a: control(commit
            [4, 5], prune [7, 9])
        """
        pending: dict[str, tuple[list[int], list[int], list[int]]] = {}   # request -> commit, tokens, prune

        def flush(request_id: str) -> None:
            got = pending.pop(request_id, None)
            if got is not None and request_id not in out.errors:
                try:
                    draft.control(request_id, *got)
                except Exception as e:
                    out.errors[request_id] = e

        for op in self.ops:
            if op.kind is OpKind.RELEASE:
                flush(op.request_id)
                try:
                    draft.release(op.request_id)
                except Exception as e:
                    out.errors[op.request_id] = e
                continue
            commit, tokens, prune = pending.setdefault(op.request_id, ([], [], []))
            if op.kind is OpKind.COMMIT:
                commit += op.node_ids
                tokens += op.tokens
            else:
                prune += op.node_ids
        for request_id in list(pending):
            flush(request_id)

    def _scored(self, request_id: str, got: Proposals) -> Proposals:
        """A request's proposals as the tree scores them: calibrated (`calibration`) or as the draft gave them."""
        if self.calibration is None or request_id not in self.calibrated:
            return got
        return self.calibration.apply(got if isinstance(got, ProposalRows) else ProposalRows.of(got))

    def _chain(self, draft: DraftSource, out: "DraftResults", asked: dict[str, int]) -> Generator[None, None, None]:
        """The chained requests' later rounds (coordinator/core/drafts/chain.py), batched across requests: after
        each round every chain records it and, unless the job was cut meanwhile, chooses its next nodes; a
        request that fails stops there (its error)."""
        due: dict[str, ProposalRows] = {}
        for request_id, chain in self.chains.items():
            got = out.proposals.get(request_id)
            if got is not None:
                rows = got if isinstance(got, ProposalRows) else ProposalRows.of(got)
                head = asked[request_id] - len(chain.ids)       # (committed nodes the draft had not computed)
                due[request_id] = rows.select(np.arange(head, len(rows))) if head else rows
        rounds = 1
        while due:
            started = time.perf_counter()
            more = []
            for request_id, rows in due.items():
                try:
                    if self.chains[request_id].record(rows):
                        more.append(request_id)
                except Exception as e:       # (a request's failure is its own)
                    out.errors[request_id] = e
            out.select_ms += (time.perf_counter() - started) * 1e3
            if not more:
                break
            yield                            # a round's end
            if self.cut:
                out.cut = True
                break
            started = time.perf_counter()    # (after the cut's check: a cut chain chooses nothing in vain)
            nxt = []
            for request_id in more:
                try:
                    nodes = self.chains[request_id].choose()
                except Exception as e:
                    out.errors[request_id] = e
                    continue
                if nodes is not None:
                    nxt.append((request_id, nodes))
            out.select_ms += (time.perf_counter() - started) * 1e3
            if not nxt:
                break
            try:
                results: list[Proposals | Exception] = draft.expand_many(nxt, self.topk)
            except Exception as e:
                results = [e] * len(nxt)
            rounds += 1
            due = {}
            for (request_id, nodes), got in zip(nxt, results):
                if isinstance(got, Exception):
                    out.errors[request_id] = got
                    continue
                due[request_id] = self._scored(request_id, got if isinstance(got, ProposalRows)
                                               else ProposalRows.of(got))
                if request_id in self.keep_q:
                    out.q.setdefault(request_id, {}).update(
                        {n.node_id: draft.take_q(request_id, n.node_id) for n in nodes})
        out.rounds = rounds
        started = time.perf_counter()
        for request_id, chain in self.chains.items():
            if request_id not in out.errors and chain.done:
                out.chained[request_id] = chain.done
                out.grown[request_id] = chain.growth()
        out.select_ms += (time.perf_counter() - started) * 1e3


@dataclass
class DraftResults:
    proposals: dict[str, Proposals] = field(default_factory=dict)     # request -> one row per expanded node
    q: dict[str, dict[int, torch.Tensor | None]] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)
    compute_ms: float = 0.0          # the draft's compute (its model calls and top-k)
    bookkeeping_ms: float = 0.0      # the ops' wall time (the draft's KV tables: Python on the draft's thread)
    chained: dict[str, list[ChainRound]] = field(default_factory=dict)   # request -> its rounds, the first
    # included, when the job chained them (the ids its children get)
    rounds: int = 1                  # the model calls of the expansion (chained rounds)
    cut: bool = False                # the chains stopped early (`DraftJob.cut`): their other rounds are due
    select_ms: float = 0.0           # the chains' choice of their next nodes (Python on the draft's thread)
    grown: dict[str, ChainGrowth] = field(default_factory=dict)   # request -> its chained rounds as the tree's
    # new rows, in one piece (`TreeGrowth.add_grown`)
