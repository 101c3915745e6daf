"""Method name -> scheduler class. Methods not built yet are listed so that errors can say so."""
from __future__ import annotations

from coordinator.schedulers.base import Scheduler
from coordinator.schedulers.pp import PPScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    "pp": PPScheduler,
}
PLANNED = ("sps", "tree", "pipeinfer", "specpipe", "cb-pp")


def make_scheduler(method: str, num_stages: int) -> Scheduler:
    try:
        cls = SCHEDULERS[method]
    except KeyError:
        known = ", ".join(sorted(SCHEDULERS))
        if method in PLANNED:
            raise ValueError(f"method {method!r} is not available in this build; available: {known}") from None
        raise ValueError(f"unknown method {method!r}; available: {known}") from None
    return cls(num_stages)
