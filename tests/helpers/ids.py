"""Node ids for trees built by hand in tests: `id_counter(start)(n)` hands out n consecutive fresh ids and
returns the first, as RequestState.new_node does."""
from __future__ import annotations

import itertools
from collections.abc import Callable


def id_counter(start: int) -> Callable[[int], int]:
    nxt = itertools.count(start)

    def new_ids(count: int = 1) -> int:
        first = next(nxt)
        for _ in range(count - 1):
            next(nxt)
        return first
    return new_ids
