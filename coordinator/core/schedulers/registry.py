"""Method name -> scheduler."""
from __future__ import annotations

from dataclasses import dataclass

from coordinator.core.drafts.base import DraftSource
from coordinator.core.schedulers.base import Scheduler
from coordinator.core.schedulers.cbpp import CBPPScheduler
from coordinator.core.schedulers.pp import PPScheduler
from coordinator.core.schedulers.specpipe import SpecPipeScheduler
from coordinator.core.schedulers.trip import make_pipeinfer, make_sps, make_tree

METHODS = ("pp", "specpipe", "sps", "tree", "pipeinfer", "cb-pp")


@dataclass(frozen=True)
class SpecOptions:
    """Speculation and batching settings of the schedulers."""
    draft: DraftSource | None = None
    width: int = 32           # specpipe: tree nodes per micro-batch (measured: README "Measured")
    policy: str = "hybrid"
    topk: int = 16            # specpipe: children the draft proposes per node
    draft_rounds: int = 2     # specpipe: draft calls per step (run-ahead; layer: 1)
    sps_k: int = 4            # sps: draft tokens per trip
    tree_nodes: int = 32      # tree: nodes per trip
    tree_depth: int = 6       # tree: expansion rounds per trip
    tree_topk: int = 8        # tree: nodes expanded per round
    pipeinfer_run: int = 4    # pipeinfer: draft tokens per speculative run
    pipeinfer_min_prob: float = 0.1   # pipeinfer: stop a run where the draft is less sure than this
    node_budget: int = 32     # specpipe, cb-pp: rows per micro-batch, shared by the requests in it
    prefill_chunk: int = 256  # specpipe, cb-pp: prompt rows per micro-batch, beside the node budget
    verify: str = "match"     # sampling: match (seeded sample-then-match) | rejection (coordinator/core/verify.py)


def make_scheduler(method: str, num_stages: int, spec: SpecOptions | None = None) -> Scheduler:
    spec = spec or SpecOptions()
    if method == "pp":
        return PPScheduler(num_stages)
    if method == "cb-pp":
        return CBPPScheduler(num_stages, spec.node_budget, spec.prefill_chunk)
    if method == "specpipe":
        if spec.draft is None:
            raise ValueError("method 'specpipe' needs a draft source (--draft quant|quant+ngram|ngram|model)")
        return SpecPipeScheduler(num_stages, spec.draft, spec.width, spec.policy, spec.topk, spec.node_budget,
                                 spec.verify, spec.draft_rounds, spec.prefill_chunk)
    if method in ("sps", "tree", "pipeinfer"):
        if spec.draft is None:
            raise ValueError(f"method {method!r} needs a draft source (--draft quant|quant+ngram|ngram|model)")
        if method == "sps":
            return make_sps(num_stages, spec.draft, spec.sps_k, spec.verify)
        if method == "pipeinfer":
            return make_pipeinfer(num_stages, spec.draft, spec.pipeinfer_run, spec.pipeinfer_min_prob)
        return make_tree(num_stages, spec.draft, spec.tree_nodes, spec.tree_depth, spec.tree_topk, spec.verify)
    raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
