"""The draft-source interface: who proposes the children of tree nodes.

A draft source keeps its own per-request state (for a model: a KV cache over the same node ids the
stages use) and follows the scheduler's commits and prunes, so it never recomputes the prefix.

Contract, per request:
    begin(request_id, prompt, sampling, keep_q)   the prompt is committed as nodes 0..n-1; proposals follow the
                                           request's sampling (below); keep_q: remember each expanded
                                           node's warped distribution for `take_q`
    expand(request_id, nodes, k) -> proposals     for each node (its parent already expanded, or earlier in
                                           `nodes`), up to k (token, log-prob) children, best first
    expand_many([(request_id, nodes), ...], k)    the same for several requests at once (one model call where
                                           the source can batch); a failed request's entry is the exception
    commit(request_id, ids, tokens) / prune(request_id, ids)   mirror the tree (prune takes subtrees)
    release(request_id)                           forget the request

Proposals when sampling (common/sampling.py): the children are the top k of the warped draft log-probs
plus Gumbel noise — the target's own noise at that position for `match` verification (so the first child
is the token the target most likely draws), the draft's own noise for `rejection` (a draw without
replacement) — in that order, with scores that never increase along it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from common.sampling import GREEDY, Sampling

from coordinator.core.proposals import ProposalRows


class DraftNode(NamedTuple):
    """A node the draft is asked to expand (a tuple: a job makes one per node, on the control plane's hot
    path)."""
    node_id: int
    parent_id: int
    position: int
    token: int


class DraftNodes(Sequence[DraftNode]):
    """The nodes a job asks a request's draft to expand: committed nodes the draft has not computed (`head`),
    then tree nodes given as columns, made into `DraftNode`s only when first read — on the draft's side, not
    on the control plane's hot path where the job is made.

        DraftNodes([], [7, 8], [5, 5], [12, 12], [40, 41])[1] == DraftNode(8, 5, 12, 41)
    """
    __slots__ = ("_head", "_columns", "_nodes")

    def __init__(self, head: list[DraftNode], node_ids: list[int], parent_ids: list[int], positions: list[int],
                 tokens: list[int]) -> None:
        self._head = head
        self._columns = (node_ids, parent_ids, positions, tokens)
        self._nodes: list[DraftNode] | None = None

    def _all(self) -> list[DraftNode]:
        if self._nodes is None:
            self._nodes = self._head + list(map(DraftNode, *self._columns))
        return self._nodes

    def __len__(self) -> int:
        return len(self._head) + len(self._columns[0])

    def __getitem__(self, i: int | slice) -> DraftNode | list[DraftNode]:  # type: ignore[override]
        return self._all()[i]

    def __iter__(self) -> Iterator[DraftNode]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, DraftNodes)) else NotImplemented

    def __repr__(self) -> str:
        return f"DraftNodes({self._all()!r})"


# per node, its children (token, log-prob) best first: a list of lists, or the same as arrays (ProposalRows)
Proposals = ProposalRows | list[list[tuple[int, float]]]


def piece_start(rows: dict[str, tuple[int, int]] | None, request_id: str) -> int:
    """The first prompt row of a request's prefill piece in `begin_many` (0: its first piece, or all at once)."""
    return (rows or {}).get(request_id, (0, 0))[0]


class DraftSource(ABC):
    name = "draft"
    chains = False      # its proposals are a distinct top-k per node (ProposalRows.distinct): a job may chain
    # rounds (coordinator/core/drafts/chain.py)

    def __init__(self) -> None:
        self.compute_s = 0.0        # time spent proposing, for the draft-time share
        # model calls made and rows they computed (prefills included), for the simulated clock's draft time
        # (coordinator/engine/loops/simulated.py); 0 without a model (ngram). Read them as `draft.calls`
        # and `draft.rows`: a composite source sums its parts'.
        self.calls = 0
        self.rows = 0

    @abstractmethod
    def begin(self, request_id: str, prompt_ids: list[int], sampling: Sampling = GREEDY,
              keep_q: bool = False) -> None: ...

    def begin_many(self, jobs: list[tuple[str, list[int], Sampling, bool]],
                   rows: dict[str, tuple[int, int]] | None = None) -> list[Exception | None]:
        """`begin` for several requests (request id, prompt ids, sampling, keep_q); a model draft prefills
        them all in one call. Each request's failure is its own (None: begun).

        `rows` {request: (a, b)} prefills only the rows [a, b) of that request's prompt (of its len - 1): a
        long prompt in pieces, one call each, so a caller holding a lock can let go between them. The piece
        with a == 0 begins the request; the request is ready once a piece has reached b == len - 1. A source
        without a model begins on the first piece and has nothing to compute for the others.

            prompt of 9 ids: rows (0, 4), then (4, 8)  ==  no rows (all 8 at once)
        """
        out: list[Exception | None] = []
        for request_id, prompt, sampling, keep_q in jobs:
            try:
                if not piece_start(rows, request_id):
                    self.begin(request_id, prompt, sampling, keep_q)
                out.append(None)
            except Exception as e:
                out.append(e)
        return out

    @abstractmethod
    def expand(self, request_id: str, nodes: Sequence[DraftNode], k: int) -> Proposals: ...

    def expand_many(self, jobs: list[tuple[str, Sequence[DraftNode]]], k: int) -> list[Proposals | Exception]:
        out: list[Proposals | Exception] = []
        for request_id, nodes in jobs:
            try:
                out.append(self.expand(request_id, nodes, k))
            except Exception as e:      # one request's failure is its own
                out.append(e)
        return out

    def take_q(self, request_id: str, node_id: int) -> torch.Tensor | None:
        """The warped distribution [vocab] the children of an expanded node were drawn from (kept only
        with keep_q; None for sources without one: their children count as point masses)."""
        return None

    def control(self, request_id: str, commit: list[int], tokens: list[int], prune: list[int]) -> None:
        """A request's commits (node ids and their tokens, in order), then its prunes (node ids, with their
        subtrees), as one message: a job's queued bookkeeping, coalesced (`DraftJob`). A source with a KV table
        checks and applies it at once, as a stage does a control message. The one method a source overrides for
        bookkeeping; nothing to keep here."""

    def commit(self, request_id: str, node_ids: list[int], tokens: list[int]) -> None:
        self.control(request_id, node_ids, tokens, [])

    def prune(self, request_id: str, node_ids: list[int]) -> None:
        self.control(request_id, [], [], node_ids)

    def release(self, request_id: str) -> None:
        pass
