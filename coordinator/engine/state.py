"""The engine's lifecycle as one state, and the errors its requests are refused with.

Transitions, each by one Engine method (only the pipeline owner, coordinator/engine/pipeline.py, calls
hold, suspend, restart and swap_transport; fail_all and fail_running answer failures):

    RUNNING --hold--> HELD --swap_transport--> RUNNING      a re-partition drains the pipeline, moves on
    any --suspend--> SUSPENDED --restart--> RUNNING          a stage failed: the requests run again
    any --fail_running--> UNAVAILABLE                        recovery gave up, or no stages to run on
    any --fail_all--> FAILED                                 a failure that nothing recovers
    any, nothing running --swap_transport--> RUNNING         (UNAVAILABLE when swapped to no pipeline)
    SUSPENDED, UNAVAILABLE, FAILED --restart--> RUNNING
"""
from __future__ import annotations

import enum


class EngineState(enum.Enum):
    RUNNING = "running"            # requests run on the transport
    HELD = "held"                  # a re-partition drains: running requests go on, new ones queue
    SUSPENDED = "suspended"        # a stage failed: requests wait for `restart` on a new pipeline
    FAILED = "failed"              # the pipeline failed and nothing recovers it: requests are refused
    UNAVAILABLE = "unavailable"    # no pipeline to run on (scaled to zero, recovery gave up): refused


REFUSING = frozenset({EngineState.FAILED, EngineState.UNAVAILABLE})     # submit raises Unavailable
RESTARTABLE = frozenset({EngineState.SUSPENDED, *REFUSING})              # nothing runs on a live pipeline


class Unavailable(Exception):
    """The engine cannot run this request: the pipeline failed or has no stages, recovery gave up, or the
    request was refused while it waited in the queue. The APIs answer UNAVAILABLE."""


class EngineStateError(RuntimeError):
    """A lifecycle method was called in a state it does not apply to (a bug of its caller)."""
