"""Method name -> scheduler."""
from __future__ import annotations

from dataclasses import dataclass, fields

from common.options import option

from coordinator.core.calibration import Calibration
from coordinator.core.drafts.base import DraftSource
from coordinator.core.schedulers.base import Scheduler
from coordinator.core.schedulers.cbpp import CBPPScheduler
from coordinator.core.schedulers.pp import PPScheduler
from coordinator.core.schedulers.specpipe import SpecPipeScheduler
from coordinator.core.schedulers.trip import make_pipeinfer, make_sps, make_tree
from coordinator.core.sizing import Sizer, Sizing
from coordinator.core.vocabulary import METHODS, STAGE_HARDWARE, TREE_POLICIES, VERIFIERS, Method, StageHardware



@dataclass(frozen=True, kw_only=True)
class Speculation:
    """The speculation and batching settings, each declared once: CoordinatorConfig inherits them (with a flag
    and an environment variable each, e.g. --width and SPECPIPE_WIDTH; common/options.py), SpecOptions adds
    the draft source, and `spec_options` carries one into the other."""
    # 0 = chosen online by the cost rule (coordinator/core/sizing.py), up to AUTO_MAX; a value given pins it
    width: int = option(0, "tree nodes injected per step; 0: the cost rule picks 1..32, or no speculation "
                           "where it cannot pay")                     # measured: docs/benchmarks.md
    tree_policy: str = option("hybrid", choices=TREE_POLICIES)
    topk: int = option(0, "children the draft proposes per node; 0: the cost rule picks up to 16")
    draft_rounds: int = option(0, "specpipe: draft calls per step; each expands the best not-yet-expanded nodes so "
                                  "a micro-batch can span several tree layers (layer policy: 1); 0: the cost rule "
                                  "picks 1 to 4")
    draft_chain: bool = option(True, "specpipe: a step's draft rounds in one job, the draft choosing the later "
                                     "rounds' nodes as the tree would (one coordinator call a step instead of one a "
                                     "round); false: a job per round")
    calibrate: bool = option(True, "specpipe: rank the tree's nodes by the draft's measured acceptance (greedy "
                                   "requests: how often its r-th choice at a given confidence was the target's "
                                   "token) instead of its probability")    # coordinator/core/calibration.py
    stage_hardware: str = option("shared", "specpipe's cost rule: the stages compute on the draft's hardware "
                                           "(shared: one machine, e.g. specpipe local), so plain pipelining is "
                                           "tried once before its model of it is trusted; or on their own "
                                           "(apart: GPU pods)", choices=STAGE_HARDWARE)
    sps_k: int = option(4, "sps: draft tokens per trip")
    tree_nodes: int = option(32, "tree: nodes per trip")
    tree_depth: int = option(6, "tree: expansion rounds per trip")
    tree_topk: int = option(8, "tree: nodes expanded per round")
    pipeinfer_run: int = option(4, "pipeinfer: draft tokens per run")
    pipeinfer_min_prob: float = option(0.1, "pipeinfer: end a run where the draft's probability falls below this")
    verify: str = option("match", "sampling verification: match (the target's seeded sample decides; "
                                  "reproducible, ships one token per row) or rejection (speculative sampling; "
                                  "ships distributions)", choices=VERIFIERS)      # coordinator/core/verify.py
    node_budget: int = option(32, "specpipe, cb-pp: rows per micro-batch shared by all requests in it")
    prefill_chunk: int = option(256, "prompt rows per micro-batch, every method (a longer prompt continues in the "
                                     "next micro-batches; specpipe, cb-pp: beside the node budget)")

    def spec_options(self, draft: DraftSource | None) -> SpecOptions:
        """These settings with a draft source, for the schedulers."""
        return SpecOptions(draft, **{f.name: getattr(self, f.name) for f in fields(Speculation)})


@dataclass(frozen=True)
class SpecOptions(Speculation):
    """Speculation and batching settings of the schedulers: `SpecOptions(draft, width=4)`."""
    draft: DraftSource | None = None


def make_scheduler(method: str, num_stages: int, spec: SpecOptions | None = None,
                   sizer: Sizer | None = None, calibration: Calibration | None = None) -> Scheduler:
    """The method's scheduler. `sizer`, `calibration`: specpipe's cost rule and tree calibration carried over
    from an earlier scheduler of the same pipeline and settings (what they learnt stays); by default a new
    cost rule when any of width, topk and draft rounds is left to it, told whether the stages' step times may
    depend on the draft's work (`spec.stage_hardware`: coordinator/core/sizing.py Sizer), and a new
    calibration unless `spec.calibrate` is off."""
    spec = spec or SpecOptions()
    if method == Method.PP:
        return PPScheduler(num_stages, spec.prefill_chunk)
    if method == Method.CB_PP:
        return CBPPScheduler(num_stages, spec.node_budget, spec.prefill_chunk)
    if method == Method.SPECPIPE:
        if spec.draft is None:
            raise ValueError("method 'specpipe' needs a draft source (--draft quant|quant+ngram|ngram|model)")
        sizing = Sizing.of(spec.width, spec.topk, spec.draft_rounds)
        if sizer is None and sizing.auto:
            shared = StageHardware(spec.stage_hardware) is StageHardware.SHARED
            sizer = Sizer(num_stages, sizing, spec.node_budget, shared)
        return SpecPipeScheduler(num_stages, spec.draft, sizing.max_width, spec.tree_policy, sizing.max_topk,
                                 spec.node_budget, spec.verify, sizing.max_rounds, spec.prefill_chunk, sizer,
                                 bool(spec.draft_chain),
                                 (calibration or Calibration()) if spec.calibrate else None)
    if method in (Method.SPS, Method.TREE, Method.PIPEINFER):
        if spec.draft is None:
            raise ValueError(f"method {method!r} needs a draft source (--draft quant|quant+ngram|ngram|model)")
        if method == Method.SPS:
            return make_sps(num_stages, spec.draft, spec.sps_k, spec.verify, spec.prefill_chunk)
        if method == Method.PIPEINFER:
            return make_pipeinfer(num_stages, spec.draft, spec.pipeinfer_run, spec.pipeinfer_min_prob,
                                  spec.prefill_chunk)
        return make_tree(num_stages, spec.draft, spec.tree_nodes, spec.tree_depth, spec.tree_topk, spec.verify,
                         spec.prefill_chunk)
    raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
