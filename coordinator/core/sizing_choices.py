"""What specpipe's cost rule (coordinator/core/sizing.py) chooses among and tells: a `Choice` of width, topk
and draft rounds (or `NONE`), the `Sizing` the user's flags allow, and each `Switch` it makes, for the
engine's log."""
from __future__ import annotations

import enum
from dataclasses import dataclass

AUTO_MAX = (32, 16, 4)                 # width, topk, draft rounds when not given: the largest the rule picks


@dataclass(frozen=True)
class Choice:
    """Speculation settings; width 0 = none (plain pipelining, no draft)."""
    width: int
    topk: int
    rounds: int

    @property
    def speculates(self) -> bool:
        return self.width > 0

    @property
    def shape(self) -> tuple[int, int]:
        """(width, rounds): what a pace is kept by (a topk change does not change the pace; rule step 4)."""
        return self.width, self.rounds


NONE = Choice(0, 0, 0)


class Why(str, enum.Enum):
    """Why the rule switched (its steps, module docstring)."""
    DRAFT_BOUND = "draft-bound start"      # step 0
    GROW = "measuring a longer chain"      # step 1, where stages share cores
    TRY_NONE = "trying none"               # step 1
    FASTER = "faster"                      # steps 2 and 3
    COVERAGE = "topk by coverage"          # step 4

    @property
    def label(self) -> str:
        """The one spelling logs and metrics use: draft_bound, grow, try_none, faster, coverage (the value is
        the sentence a log line carries beside it)."""
        return self.name.lower()


@dataclass(frozen=True)
class Switch:
    """One of the rule's switches, for the engine's log: the paces it compared, in ms per committed token
    (None: not known yet), and whether each was measured or modelled.

        Switch(Choice(32, 4, 3), NONE, Why.TRY_NONE, 79.3, 87.3, True, False)
        -> width 32 measured at 79.3 ms a token; none modelled at 87.3, tried to measure it
    """
    before: Choice
    after: Choice
    why: Why
    before_ms: float | None
    after_ms: float | None
    before_measured: bool
    after_measured: bool


@dataclass(frozen=True)
class Sizing:
    """What the rule may choose: values given by the user are pinned, the others range up to AUTO_MAX.

        Sizing.of(width=0, topk=0, rounds=0)  -> all three chosen by the rule, none allowed
        Sizing.of(width=8, topk=0, rounds=0)  -> width 8 always; topk and rounds chosen
    """
    max_width: int
    max_topk: int
    max_rounds: int
    pin_width: bool = False
    pin_topk: bool = False
    pin_rounds: bool = False

    @staticmethod
    def of(width: int, topk: int, rounds: int) -> "Sizing":
        """From config values where 0 means "chosen by the rule"."""
        w, k, r = AUTO_MAX
        return Sizing(width or w, topk or k, rounds or r, width > 0, topk > 0, rounds > 0)

    @property
    def auto(self) -> bool:
        return not (self.pin_width and self.pin_topk and self.pin_rounds)

    @property
    def largest(self) -> Choice:
        return Choice(self.max_width, self.max_topk, self.max_rounds)
