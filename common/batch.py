"""Data-plane and control-plane messages as plain dataclasses (the core's view; wire.py maps them to proto).

Vocabulary (docs/architecture.md): a *node* is a token in a request's tree with a parent node; the first node of a
request has parent -1. Positions are depths: position(node) = position(parent) + 1. A micro-batch holds
one *segment* of rows per request.

Worked example — the prompt "a b" then a two-way tree below "b":

    Segment(request_id="r1", node_ids=[0, 1], parent_ids=[-1, 0], positions=[0, 1],
            token_ids=[a, b], want_output=[False, True])          # prefill chain, output for "b"
    Segment(request_id="r1", node_ids=[2, 3], parent_ids=[1, 1], positions=[2, 2],
            token_ids=[x, y], want_output=[True, True])           # two children of "b"
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.sampling import GREEDY, Sampling


@dataclass
class Segment:
    request_id: str
    node_ids: list[int]
    parent_ids: list[int]
    positions: list[int]
    token_ids: list[int]
    want_output: list[bool]
    error: str = ""            # set when a stage rejected the segment (it then has no rows)
    error_code: int = 0        # grpc.StatusCode value[0] of the rejection
    error_stage: int = -1
    sampling: Sampling = GREEDY   # how the last stage draws the target's token for output rows

    @property
    def rows(self) -> int:
        return len(self.node_ids)

    def select(self, keep: list[int]) -> "Segment":
        """The segment restricted to row indices `keep` (in order)."""
        return Segment(self.request_id, [self.node_ids[i] for i in keep], [self.parent_ids[i] for i in keep],
                       [self.positions[i] for i in keep], [self.token_ids[i] for i in keep],
                       [self.want_output[i] for i in keep], sampling=self.sampling)

    @staticmethod
    def failed(request_id: str, message: str, code: int, stage: int) -> "Segment":
        return Segment(request_id, [], [], [], [], [], error=message, error_code=code, error_stage=stage)


@dataclass
class StageTrace:
    stage: int
    rows_in: int
    rows_computed: int
    compute_ms: float
    wait_ms: float = 0.0


@dataclass
class MicroBatch:
    batch_id: int
    segments: list[Segment]
    hidden: torch.Tensor | None = None          # [rows, hidden] between stages
    argmax: list[int] = field(default_factory=list)   # [output_rows] on results
    logprobs: torch.Tensor | None = None        # [output_rows, vocab] on results, when asked for
    return_logprobs: bool = False
    trace: list[StageTrace] = field(default_factory=list)
    wire_bytes: int = 0                         # size of the message it arrived in (0: not over the wire)
    trip_ms: float = 0.0                        # on results: injection to arrival, stamped by the transport (0: unknown)
    arrived_ms: float = 0.0                     # on results: the transport's clock at arrival (0: unknown)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)


@dataclass
class Control:
    request_id: str
    commit: list[int] = field(default_factory=list)
    prune: list[int] = field(default_factory=list)
    release: bool = False
