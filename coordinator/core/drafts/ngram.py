"""`ngram`: prompt lookup. A node's children are the tokens that followed the most recent occurrences of
the last n tokens of its path (n = 3, then 2, then 1) in the request's text so far; free, no model.

    context = [5, 6, 7, 5, 6]  -> the suffix [5, 6] occurred before, followed by 7 -> propose 7
"""
from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence

from common.sampling import GREEDY, Sampling

from coordinator.core.drafts.base import DraftNode, DraftSource, Proposals


class NgramDraft(DraftSource):
    name = "ngram"

    def __init__(self, max_n: int = 3, window: int = 4096) -> None:
        super().__init__()
        self.max_n, self.window = max_n, window
        self.tokens: dict[str, dict[int, tuple[int, int]]] = {}   # request_id -> node -> (parent, token)
        self.committed: dict[str, list[int]] = {}                 # request_id -> committed tokens
        self.committed_ids: dict[str, set[int]] = {}

    def begin(self, request_id: str, prompt_ids: list[int], sampling: Sampling = GREEDY,
              keep_q: bool = False) -> None:
        """Proposals are the same whatever the sampling (deterministic: point masses for `rejection`)."""
        self.tokens[request_id] = {i: (i - 1, t) for i, t in enumerate(prompt_ids)}
        self.committed[request_id] = list(prompt_ids)
        self.committed_ids[request_id] = set(range(len(prompt_ids)))

    def expand(self, request_id: str, nodes: Sequence[DraftNode], k: int) -> Proposals:
        started = time.perf_counter()
        table, history = self.tokens[request_id], self.committed[request_id]
        done = self.committed_ids[request_id]
        out = []
        for n in nodes:
            table[n.node_id] = (n.parent_id, n.token)
            out.append(self._propose(history, self._path(table, n.node_id, done), k))
        self.compute_s += time.perf_counter() - started
        return out

    def _path(self, table, node_id: int, committed: set[int]) -> list[int]:
        """Tokens of the node's path that are not yet in the committed history."""
        path = []
        while node_id in table and node_id not in committed:
            parent, token = table[node_id]
            path.append(token)
            node_id = parent
        return path[::-1]

    def _propose(self, history: list[int], path: list[int], k: int) -> list[tuple[int, float]]:
        context = (history + path)[-self.window:]
        for n in range(self.max_n, 0, -1):
            if len(context) <= n:
                continue
            suffix = context[-n:]
            follow = Counter(context[i + n] for i in range(len(context) - n) if context[i:i + n] == suffix)
            if follow:
                total = sum(follow.values())
                return [(t, math.log(c / total)) for t, c in follow.most_common(k)]
        return []

    def control(self, request_id: str, commit: list[int], tokens: list[int], prune: list[int]) -> None:
        if commit:
            self.committed[request_id].extend(tokens)
            self.committed_ids[request_id].update(commit)
        if prune:
            table = self.tokens[request_id]
            for nid in prune:
                table.pop(nid, None)

    def release(self, request_id: str) -> None:
        for d in (self.tokens, self.committed, self.committed_ids):
            d.pop(request_id, None)
