"""Node ids for trees built by hand in tests: `id_counter(start)(n)` hands out n consecutive fresh ids and
returns the first, as RequestState.new_node does; `make_tree` a tree of one root that draws its ids so."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.core.tree import TokenTree


def id_counter(start: int) -> Callable[[int], int]:
    nxt = itertools.count(start)

    def new_ids(count: int = 1) -> int:
        first = next(nxt)
        for _ in range(count - 1):
            next(nxt)
        return first
    return new_ids


def make_tree(root_id: int = 0, root_token: int = 50, root_depth: int = 0) -> TokenTree:
    from coordinator.core.tree import TokenTree
    return TokenTree(root_id, root_token, root_depth, id_counter(root_id + 1))
