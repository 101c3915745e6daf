"""One request's statistics: what its scheduler counts on the pipeline clock and what the engine times.

`RequestStats` is filled by two owners: the scheduler (steps, tokens, micro-batches, per-stage rows, and for
the speculative methods the `SpecCounters`) while the request runs, the engine (wall-clock times, recoveries,
the prompt's length) when it ends (coordinator/engine/live.py). Each field says its unit and whether it is
*additive*: a request that runs more than once (after a stage failure) sums the additive fields of its
attempts (`add`); the others are the last attempt's or set by the engine from what the client was sent.

The wire's `Stats.counters` map, results.json and the debug log see one flat map (`as_dict`, the one place
where names become strings): every field that is set, the two derived rates, `stage<i>_<counter>` for each
stage and `ttft_<phase>_ms` for each phase of the time to first token.

    >>> s = RequestStats(steps=8, tokens=4, decode_steps=3, spec=SpecCounters(hits=3, misses=1))
    >>> s.tokens_per_step, s.decode_tokens_per_step
    (0.5, 1.0)
    >>> s.add(RequestStats(steps=6, tokens=2, spec=SpecCounters(hits=1)))
    >>> s.steps, s.tokens, s.spec.hits
    (14, 4, 4)
    >>> {k: v for k, v in s.as_dict().items() if k in ("steps", "hits", "tokens_per_step")}
    {'steps': 14.0, 'tokens_per_step': 0.2857142857142857, 'hits': 4.0}
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any


def stat(unit: str, additive: bool, default: Any = 0) -> Any:
    """A statistics field: its unit, and whether attempts of one request add up."""
    return field(default=default, metadata={"unit": unit, "additive": additive})


class TTFTPhase(str, Enum):
    """Where a request's time to first token went (coordinator/engine/live.py); they add up to `ttft_ms`."""
    QUEUE = "queue"                  # submit -> admitted (the admission queue)
    COORDINATOR = "coordinator"      # admitted -> its first rows on the wire (scheduler lock, add, executor)
    PIPELINE = "pipeline"            # -> the result holding its last prompt row is back (every stage)
    EMIT = "emit"                    # -> the first token is streamed (scheduler lock, on_result, executor)


def _merge(into: Any, other: Any) -> None:
    for f in fields(into):
        if f.metadata.get("additive"):
            setattr(into, f.name, getattr(into, f.name) + getattr(other, f.name))


def _flat(obj: Any, out: dict[str, float], prefix: str = "") -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + f.name] = float(value)


@dataclass
class StageCounters:
    """What one stage did for a request's micro-batches (1/n of a micro-batch shared by n requests)."""
    rows_computed: float = stat("rows", True)
    rows_dropped: float = stat("rows", True)      # pruned before the stage reached them
    compute_ms: float = stat("ms", True)
    wait_ms: float = stat("ms", True)             # emulated stage time waited out


@dataclass
class SpecCounters:
    """The speculative methods' counters (specpipe, sps, tree, pipeinfer; None for pp and cb-pp)."""
    hits: int = stat("tokens", True)              # accepted draft tokens
    misses: int = stat("tokens", True)            # the target's token where no draft token matched
    plain_tokens: int = stat("tokens", True)      # the target's token with no speculation to check (sized off)
    misses_proposed_not_injected: int = stat("tokens", True)
    misses_not_proposed: int = stat("tokens", True)
    warm_restarts: int = stat("misses", True)     # a miss whose token the draft had proposed: kept its subtree
    lag_steps: int = stat("steps", True)          # a result committed nothing: the tree lagged behind
    refill_steps: int = stat("steps", True)       # ... the pipeline was refilling after a miss
    nodes_injected: int = stat("nodes", True)
    trips: int = stat("trips", True)              # sps / tree / pipeinfer: speculations sent
    draft_ms: float = stat("ms", True)            # the draft model's compute, shared by rows


@dataclass
class RequestStats:
    """One request's statistics (module docstring)."""
    # the scheduler's, on the pipeline clock
    steps: int = stat("steps", True)              # from its first injection to its last result
    decode_steps: int = stat("steps", True)       # from its first committed token to its last
    tokens: int = stat("tokens", False)           # generated (the engine sets the total after a recovery)
    batches: float = stat("micro-batches", True)  # 1/n of a micro-batch shared by n requests
    result_bytes: float = stat("bytes", True)
    control_ms: float = stat("ms", True)          # the coordinator's own time, shared by the requests running
    sized_width: int | None = stat("rows", False, None)   # the cost rule's last width (0: no speculation)
    sized_topk: int | None = stat("children", False, None)   # ... and its topk (0: no speculation)
    sized_calibration: float | None = stat("ratio", False, None)   # ... and its measured pace over its modelled
    # one (`Sizer.calibration`; None: the rule had not decided)
    spec: SpecCounters | None = None
    stages: dict[int, StageCounters] = field(default_factory=dict)
    # the engine's and the front end's, on the wall clock
    prompt_tokens: int = stat("tokens", False)
    seed: int | None = stat("", False, None)     # the sampling seed used (one the server picked, too)
    recoveries: int = stat("attempts", False)
    wall_ms: float = stat("ms", False)
    ttft_ms: float = stat("ms", False)
    tbt_ms: float = stat("ms", False)             # mean time between tokens
    rtt_ms_mean: float | None = stat("ms", False, None)        # inject -> result per micro-batch
    overhead_ms_mean: float | None = stat("ms", False, None)   # ... less stage compute and emulated time
    overhead_share: float | None = stat("", False, None)
    draft_share: float | None = stat("", False, None)          # draft_ms / wall_ms
    ttft_phases: dict[TTFTPhase, float] = field(default_factory=dict)   # ms per phase

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def decode_tokens_per_step(self) -> float:
        """Tokens after the first per decode step: what time between tokens follows."""
        return (self.tokens - 1) / self.decode_steps if self.decode_steps else 0.0

    def stage(self, index: int) -> StageCounters:
        """Stage `index`'s counters (created on first use; called per stage trace of every result)."""
        counters = self.stages.get(index)
        if counters is None:
            counters = self.stages[index] = StageCounters()
        return counters

    def add(self, other: RequestStats) -> None:
        """Sum another attempt's additive fields into these."""
        _merge(self, other)
        if other.spec is not None:
            if self.spec is None:
                self.spec = SpecCounters()
            _merge(self.spec, other.spec)
        for i, counters in other.stages.items():
            _merge(self.stage(i), counters)

    def as_dict(self) -> dict[str, float]:
        """The flat map of the wire, results.json and the log (module docstring)."""
        out: dict[str, float] = {}
        _flat(self, out)
        out["tokens_per_step"] = self.tokens_per_step
        out["decode_tokens_per_step"] = self.decode_tokens_per_step
        if self.spec is not None:
            _flat(self.spec, out)
        for i, counters in sorted(self.stages.items()):
            _flat(counters, out, f"stage{i}_")
        for phase, ms in self.ttft_phases.items():
            out[f"ttft_{phase.value}_ms"] = ms
        return out
