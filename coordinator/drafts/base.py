"""The draft-source interface: who proposes the children of tree nodes.

A draft source keeps its own per-request state (for a model: a KV cache over the same node ids the
stages use) and follows the scheduler's commits and prunes, so it never recomputes the prefix.

Contract, per request:
    begin(rid, prompt)                     the prompt is committed as nodes 0..n-1
    expand(rid, nodes, k) -> proposals     for each node (its parent already expanded, or earlier in
                                           `nodes`), up to k (token, log-prob) children, best first
    commit(rid, ids, tokens) / prune(rid, ids)   mirror the tree (prune takes subtrees)
    release(rid)                           forget the request
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftNode:
    node_id: int
    parent_id: int
    position: int
    token: int


Proposals = list[list[tuple[int, float]]]


class DraftSource(ABC):
    name = "draft"

    def __init__(self) -> None:
        self.compute_s = 0.0        # time spent proposing, for the draft-time share

    @abstractmethod
    def begin(self, request_id: str, prompt_ids: list[int]) -> None: ...

    @abstractmethod
    def expand(self, request_id: str, nodes: list[DraftNode], k: int) -> Proposals: ...

    def commit(self, request_id: str, node_ids: list[int], tokens: list[int]) -> None:
        pass

    def prune(self, request_id: str, node_ids: list[int]) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass
