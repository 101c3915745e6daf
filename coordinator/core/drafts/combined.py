"""`quant+ngram`: the quant model draft's children plus free prompt-lookup proposals.

Per node, the children are the model's top k (its order, its scores) merged with the n-gram's first
`max_extra` (2) proposals; a token both propose is one child, with the model's score. An n-gram-only token
is scored by the model's own log-prob of it, read from the log-prob row the model computes for that node
anyway (ModelDraft.expand_many(extra=...); the warped log-prob when sampling); one outside the model's
(warped) support is dropped. The merged list is sorted by score (stable: the model's children keep their
order), so children stay best first with non-increasing scores, and a node has at most k + max_extra.

Worked example (greedy, k = 2): at a node the model's probabilities are 7: 0.5, 3: 0.25, 9: 0.15, 4: 0.05, ...
    model  [(7, log .5), (3, log .25)]          n-gram  [(4, log 2/3), (7, log 1/3)]
    merged [(7, log .5), (3, log .25), (4, log .05)]
7 is one child with the model's score; 4 gets the model's log .05, not its n-gram frequency. When greedy an
n-gram-only token therefore ranks after every model child (its log-prob is at most the k-th largest), and
the tree ranks its subtree by the model's cumulative log-prob like any other node; when sampling, the
model's children are ordered by log q plus noise, so an n-gram token can land between them.

Lossless: with greedy or `match` verification the committed token is the target's own whatever the children
are; extra children only add chances of a hit. `rejection` needs a node's children to be draws without
replacement from the draft's q (coordinator/core/verify.py), which n-gram tokens are not: a request begun with
keep_q gets exactly the model's proposals, and the n-gram part never sees it.

`compute_s`, `calls` and `rows` are the parts' sums (plus this wrapper's own merge time in compute_s), so
the bench charges model calls as for `quant`; the n-gram runs no model and adds no calls or rows.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from common.sampling import GREEDY, Sampling

from coordinator.core.drafts.base import DraftNode, DraftSource, Proposals, piece_start
from coordinator.core.drafts.model import ModelDraft
from coordinator.core.drafts.ngram import NgramDraft


def _summed(attr: str) -> property:
    """The parts' `attr` plus this source's own (what DraftSource.__init__ and later assignments set)."""
    own = "_own_" + attr

    def get(self):
        return getattr(self, own) + getattr(self.model, attr) + getattr(self.ngram, attr)

    def set_(self, value) -> None:
        setattr(self, own, value)

    return property(get, set_)


class CombinedDraft(DraftSource):
    compute_s = _summed("compute_s")
    calls = _summed("calls")
    rows = _summed("rows")

    def __init__(self, model: ModelDraft, ngram: NgramDraft | None = None, max_extra: int = 2,
                 name: str = "quant+ngram") -> None:
        if max_extra < 0:
            raise ValueError("max_extra must be 0 or more")
        self.model, self.ngram = model, ngram if ngram is not None else NgramDraft()
        super().__init__()
        self.name, self.max_extra = name, max_extra
        self.merged: set[str] = set()          # requests with n-gram proposals (not `rejection`)

    def begin(self, request_id: str, prompt_ids: list[int], sampling: Sampling = GREEDY,
              keep_q: bool = False) -> None:
        self.model.begin(request_id, prompt_ids, sampling, keep_q)
        self.merged.discard(request_id)
        if not keep_q:                         # rejection needs children drawn from q: model only
            self.ngram.begin(request_id, prompt_ids, sampling, keep_q)
            self.merged.add(request_id)

    def begin_many(self, jobs: list[tuple[str, list[int], Sampling, bool]],
                   rows: dict[str, tuple[int, int]] | None = None) -> list[Exception | None]:
        out = self.model.begin_many(jobs, rows)
        for (request_id, prompt_ids, sampling, keep_q), error in zip(jobs, out):
            if piece_start(rows, request_id):
                continue                         # a later piece of the model's prefill: begun already
            self.merged.discard(request_id)
            if error is None and not keep_q:
                self.ngram.begin(request_id, prompt_ids, sampling, keep_q)
                self.merged.add(request_id)
        return out

    def expand(self, request_id: str, nodes: Sequence[DraftNode], k: int) -> Proposals:
        result = self.expand_many([(request_id, nodes)], k)[0]
        if isinstance(result, Exception):
            raise result
        return result

    def expand_many(self, jobs: list[tuple[str, Sequence[DraftNode]]], k: int) -> list[Proposals | Exception]:
        """The n-gram's proposals first (cheap), then one model call that also scores them."""
        failed: dict[int, Exception] = {}
        extra: list[list[list[int]]] = []
        for j, (request_id, nodes) in enumerate(jobs):
            tokens: list[list[int]] = [[] for _ in nodes]
            if request_id in self.merged and nodes and self.max_extra:
                try:
                    tokens = [[t for t, _ in props] for props in self.ngram.expand(request_id, nodes, self.max_extra)]
                except Exception as e:         # one request's failure is its own
                    failed[j] = e
            extra.append(tokens)
        results = self.model.expand_many(jobs, k, extra=extra)
        started = time.perf_counter()
        out: list[Proposals | Exception] = []
        for j, result in enumerate(results):
            if j in failed:
                out.append(failed[j])
            elif isinstance(result, Exception) or jobs[j][0] not in self.merged:
                out.append(result)
            else:                              # stable: the model's children keep their order
                out.append([sorted(props, key=lambda p: -p[1]) for props in result])
        self._own_compute_s += time.perf_counter() - started
        return out

    def take_q(self, request_id: str, node_id: int) -> torch.Tensor | None:
        return self.model.take_q(request_id, node_id)

    def control(self, request_id: str, commit: list[int], tokens: list[int], prune: list[int]) -> None:
        self.model.control(request_id, commit, tokens, prune)
        if request_id in self.merged:
            self.ngram.control(request_id, commit, tokens, prune)

    def release(self, request_id: str) -> None:
        self.ngram.release(request_id)           # plain dicts first: the model's KV release may raise
        self.merged.discard(request_id)
        self.model.release(request_id)
