"""What a scheduler run must leave behind: nothing.

    out = InProcessPipeline(runners).run(sched, reqs)
    assert_nothing_left(sched, runners, draft)      # no request, batch, tree, stage KV or draft KV remains
"""
from __future__ import annotations

from coordinator.core.drafts.model import ModelDraft
from coordinator.core.schedulers.base import Scheduler
from services.runner import StageRunner


def assert_nothing_left(sched: Scheduler, runners: list[StageRunner], draft: ModelDraft | None = None) -> None:
    assert not sched.requests and not getattr(sched, "prefill_next", {}) and not sched._batches
    for name in ("trees", "pending", "begun", "next_row", "draft_prefilled"):
        assert not getattr(sched, name, {}), f"scheduler keeps {name}"
    assert all(not r.cache.requests and r.cache.nbytes() == 0 for r in runners), "a stage keeps KV"
    if draft is not None:
        assert not draft.runner.cache.requests and draft.runner.cache.nbytes() == 0, "the draft keeps KV"
        assert not draft.sampling and not draft._q, f"the draft keeps sampling state {list(draft.sampling)[:5]}"
