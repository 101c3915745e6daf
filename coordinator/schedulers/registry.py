"""Method name -> scheduler. Methods not built yet are listed so that errors can say so."""
from __future__ import annotations

from dataclasses import dataclass

from coordinator.drafts.base import DraftSource
from coordinator.schedulers.base import Scheduler
from coordinator.schedulers.pp import PPScheduler
from coordinator.schedulers.specpipe import SpecPipeScheduler

METHODS = ("pp", "specpipe")
PLANNED = ("sps", "tree", "pipeinfer", "cb-pp")
SPECULATIVE = ("specpipe",)


@dataclass(frozen=True)
class SpecOptions:
    """Speculation settings shared by the speculative methods."""
    draft: DraftSource | None = None
    width: int = 16
    policy: str = "hybrid"
    topk: int = 8


def make_scheduler(method: str, num_stages: int, spec: SpecOptions | None = None) -> Scheduler:
    spec = spec or SpecOptions()
    if method == "pp":
        return PPScheduler(num_stages)
    if method == "specpipe":
        if spec.draft is None:
            raise ValueError("method 'specpipe' needs a draft source (--draft quant|ngram|model)")
        return SpecPipeScheduler(num_stages, spec.draft, spec.width, spec.policy, spec.topk)
    known = ", ".join(METHODS)
    if method in PLANNED:
        raise ValueError(f"method {method!r} is not available in this build; available: {known}")
    raise ValueError(f"unknown method {method!r}; available: {known}")
