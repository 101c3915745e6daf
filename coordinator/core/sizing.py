"""Speculation that sizes itself: the cost rule that picks specpipe's width, topk and draft rounds — or no
speculation at all (plain pipelining) where speculation cannot pay.

The rule learns online from what the scheduler already sees (it has no clock: times come with the events),
with the estimators of coordinator/core/sizing_estimators.py (`Line`, `Ewma`, `Pace`, `Costs`):

    c(rows)  a stage's step time against the rows of a micro-batch (each result's stage traces: compute plus
             emulated time), a line fitted over row-count buckets so that a prompt chunk seen once still counts
    hop      the rest of a round trip, per stage: (trip - the stages' step times) / S (the transport stamps
             `MicroBatch.trip_ms`)
    d(rows)  one draft round's time against the rows it expands (`DraftResults.compute_ms`)
    ctl      the coordinator's own time per pipeline step (`charge_control`, measured by the driver)
    hit(k)   the chance that the target's token at a root is among the first k children the draft proposed
             (the rank seen at every verification), and how many children of a root the current width
             injects (k_now): a width w injects k(w) = min(k_now * w / w_now, its topk) of them
    E_now    committed tokens per request per result at the current width

The model, one request (`Sizer.rate`):

    step(w, r)  = max(c(w) + hop + ctl / S,  r * d(w),  ctl)     the slowest of stages, draft, coordinator
    tokens(w, r) = min(E_now * f(w) / f(w_now), r),   f(w) = 1 / (1 + (1 - hit(k(w))) * (S - 1))
                  (a miss throws away the S - 1 micro-batches behind it; and a result commits at most the r
                  layers that the r draft rounds since the injection before it added to the spine: where the
                  draft sets the pace, E_now measured at 2 rounds is ~1.7 and says nothing of 1 round's ~0.9)
    where the stages run apart from the draft (`shared` False: GPU pods, the simulated clock), the draft works
    beside them and a result cuts its rounds, so rounds beyond a stage step's are run-ahead, not a longer step:
    step(w, r) = max(c(w) + hop + ctl / S, d(w), ctl), tokens(w, r) = min(E_now * f(w) / f(w_now), r,
    step / d(w))
    spec rate   = tokens(w, r) / step(w, r)       none rate = 1 / (S * (c(1) + hop) + ctl_none)

With n requests held (SpecPipe-DB) each takes share = min(w, node_budget // n) rows, a micro-batch carries
all of them (rows = n * share) and commits n * tokens(share); without speculation a micro-batch carries
max(1, n / S) rows, min(1, n / S) of them per step.

Worked example, the GPU regime (S = 8, c = 5 + 0.025 * rows ms, hop 0.5, d = 1.5 + 0.005 * rows, ctl 1.5,
E_now 0.76 at w_now 32, hit(k_now = 4) = 0.98), stages apart: w = 32, r = 4 -> step = max(5.8 + 0.5 + 0.19,
1.66, 1.5) = 6.5 ms, 0.76 tokens -> 8.5 ms per token (r = 2 rates the same: the rounds beyond the stage step
are run-ahead, and ties keep the choice in use); none -> 8 * 5.525 = 44.2 ms per token: speculate, wide.
A CPU with a draft as costly as the whole target (S = 4, c = 28 + 0.5 * rows, d = 112 + 0.5 * rows): any
width takes step >= d(1) = 112.5 ms for at most E tokens, none 4 * 29.5 = 118 ms per token; with
E_now = 0.8 -> 140 ms: none.

What it chooses (`Sizer.step`, after every result; `choose` every max(8, 4 S) results):

0. **Leave a draft-bound start at once**: before the rule knows what speculation commits, a start whose draft
   rounds take DRAFT_BOUND times a stage step (r * d(w) > DRAFT_BOUND * (c(w) + hop), seen from the first two draft
   rounds and the first result) is left for the largest choice whose rounds keep up with a stage step (r * d(w) <=
   c(w) + hop; apart, one round: d(w) <= c(w) + hop), else the smallest: a CPU whose draft is the whole target spent
   its first ~10 results (1.9 s of `make run`) at width 32 x 2 rounds, 110-630 ms of draft each, before it could try
   none. Where stages share the draft's cores it goes to the smallest (width 1, 1 round): there every row either
   computes takes the same cores, and a wide tree that "keeps up" with a wide stage step (32 x 1 at S = 2 here) ran
   at 76-80 ms a token against none's 47. The GPU regime (apart: d(32) = 1.66 ms against c(32) + hop = 6.3 ms)
   starts and stays large.
1. **Start large, grow, try none**: the largest choice first; where stages share cores, the choice step 0
   left for is measured, then (once) twice its width with a round more (`grown_choice`: the model cannot
   speak for it there); once the rule knows enough, unless speculation is
   predicted EXPLORE times as fast as none (merely as fast where the stage times cannot depend on the
   draft: `Sizer(shared=False)`, from `--stage-hardware apart`: the Helm chart's GPU pods, the simulated clock),
   none is tried (NONE_PACED results, after the S results of micro-batches sent before the switch), to
   measure what plain pipelining costs here (where stages share cores with the draft, the same stages run
   much faster alone, which the speculating costs hide).
2. **Measured where it ran, modelled where not** (`expected`): a choice that has run long enough is judged
   by its measured pace (committed tokens per ms between results: `MicroBatch.arrived_ms`); one that has
   not, by the model, scaled by how the choice in use fares against its own model (`calibration`: what the
   model leaves out, shared cores, lag, refills). A pace counts from the second result of the choice's own
   micro-batches (the first waits a whole trip), and a speculating one only after half a decision interval
   more, while the tree the last choice grew is pruned and the draft works off its last rounds: on real
   processes at S = 4, width 1 measured 82-99 ms a token over its first 8 results after the draft-bound
   start and 42-46 once settled.
3. **Hysteresis**: a change must promise MARGIN more than the choice in use, UNTRIED more when only the model
   speaks for it. Where stages share cores with the draft (`shared`), none is left only for a choice that
   has a measured pace: the calibration carried over from the width that ran flatters a narrower one the
   model alone speaks for (out of none, width 4 x 1 rode on it and then measured 0.94x `pp`); at a load
   where nothing speculating has run, none stays. Ties keep the current choice.
4. **topk by coverage** (`topk_for`, `Coverage`): a node's children are the draft's top-k proposals, and a rank
   the target never takes costs the tree a row and the coordinator its top-k lists, but buys nothing. The ranks seen
   at the roots choose the smallest of 2, 4, 8, 16, ... whose first k ranks hold COVER of the target's tokens the
   largest topk proposes. Not 1 where stages run apart: with the tree ranked by the draft's measured acceptance
   (coordinator/core/calibration.py) a second child below every node lets it hedge where the draft is unsure, for a
   draft row and a stage row that cost little there (the `quant` draft's first rank holds 96%: GPU regime, 8
   prompts, width 32 x 4 rounds, no control time charged: 2.3 ms between tokens at topk 2, 2.4 at topk 4;
   uncalibrated, topk 1 was best, 3.2 ms on 4 prompts against 4.4 at topk 4). Where stages share the draft's cores
   from 1 (CHAIN_TOPK): a chain's draft computes one row a round, a hedged one as many as its width, each a row's
   compute on the stages' cores (real processes, S = 2 and 4, the rule at topk 2: twice of four runs none won).
   Below the largest a rank beyond topk reads "not proposed": the ranks are a survival estimate under that censoring
   (Kaplan-Meier, `Coverage`), counted at every topk, and the topk in use is kept until it holds less than COVER by
   HOLD_Z standard errors. A draft that gets worse under a small topk leaves more roots unproposed, which lowers
   that topk's coverage until a larger one is chosen; more unproposed than the counts allow (what lies beyond the
   topk in use is not seen) by SHIFT_Z standard deviations is a shift: the counts are forgotten and the largest topk
   measures again. A topk change is not a change of pace: paces are kept by (width, rounds), and it does not wait
   for a decision.

       ranks 0..15 seen 72, 15, 6, 3, 2, 1, 1, 0, ... times (100 proposed): the first 4 hold 96% -> topk 4;
       a flat draft (every rank about as likely) keeps 16.

   Measured (docs/benchmarks.md, with the dynamic-int8 `quant` draft of before 2026-12-07): the default
   model's draft held 96% of its proposed root tokens in its first 4 (98.8% in 8), and topk 4 committed as
   much per step as 16 over all 32 shipped prompts, at about three quarters of the control time.

Going to none, running requests finish without draft rounds (what is in flight still commits); coming back,
they rejoin (coordinator/core/schedulers/specpipe.py, `_resize`). Explicitly given values pin (`Sizing`): a
pinned width is never changed and never dropped to none, and with all three pinned there is no rule. A
transport without a clock (the in-process driver) leaves the rule at the largest choice.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

# the estimators it measures with; Line and Pace are imported from here too (tests/core/test_sizing.py)
from coordinator.core.sizing_estimators import CHAIN_TOPK, MIN_TOPK, Costs, Coverage, Ewma, Line, Pace
# what it chooses among and tells (imported from here too)
from coordinator.core.sizing_choices import AUTO_MAX, NONE, Choice, Sizing, Switch, Why

AUTO_WIDTHS = (1, 2, 4, 8, 16, 32)     # the widths the rule tries (up to Sizing.max_width)
MARGIN = 0.10                          # a change must promise this much more throughput (measured)
UNTRIED = 0.25                         # ... and this much when the rule's model is all it has
EVERY = 8                              # results between decisions
MAX_RANK = 64                          # ranks counted (beyond: "not proposed")
EXPLORE = 4.0                          # none is tried unless speculation is predicted this many times as fast
NONE_PACED = 8                         # results measured before none's pace counts (a speculating choice's: half
                                       # a decision interval, as misses come in bursts; none has no misses)
DRAFT_BOUND = 2.0                      # a start whose draft rounds take this many stage steps is left at once


def load(requests: float) -> int:
    """The load level of a (smoothed) number of requests held, log2 rounded: 1 -> 0, 2 -> 1, 3..5 -> 2,
    6..11 -> 3, ...: 8 clients, whose count dips to 7 between one's finish and its next request, stay at 3."""
    return round(math.log2(max(requests, 1.0)))


class Sizer:
    """Learns the costs (module docstring) and chooses a `Choice` for the pipeline. It outlives requests:
    one per scheduler (the engine keeps one per method and settings), so what it learnt serves the next
    request."""

    def __init__(self, num_stages: int, sizing: Sizing, node_budget: int = 32, shared: bool = True) -> None:
        """`shared`: the stages' step times may depend on the draft's work (stages and draft share hardware,
        as on a CPU whose cores run both), so the speculating costs may overstate none's and none is tried
        unless speculation is predicted EXPLORE times as fast; False where they cannot (stages on their own
        accelerators, the simulated clock's modelled stage time; `--stage-hardware apart`): none is tried only
        where the model itself favours it."""
        self.S, self.sizing, self.node_budget = num_stages, sizing, node_budget
        self.shared = shared
        self.explore = EXPLORE if shared else 1.0
        self.costs = {True: Costs(), False: Costs()}     # speculating -> its costs
        self.draft = Line()
        self.tokens, self.k_now = Ewma(0.05), Ewma(0.1)
        # fading counts of the target's rank among the proposals (MAX_RANK: not proposed), from a prior of
        # two observations: one spread over the ranks as 1/2, 1/4, ..., one not proposed
        self.ranks = np.append(0.5 ** np.arange(1, MAX_RANK + 1), 1.0)
        self.coverage = Coverage(sizing.max_topk, MAX_RANK, CHAIN_TOPK if shared else MIN_TOPK)   # rule step 4
        self.cover = sizing.max_topk              # the topk coverage allows, as of the last decision
        self.every = max(EVERY, 4 * num_stages)   # results between decisions: a miss costs S of them
        # what each choice committed per ms, as measured, by load (requests held, in powers of two: a pace
        # under 8 clients says nothing of one client's)
        self.paces: dict[tuple[tuple[int, int], int], Pace] = {}     # (Choice.shape, load level) -> pace
        self.held = Ewma(0.1)                     # requests held, smoothed (the load level of a pace)
        self.w_seen = sizing.max_width            # the width E_now and k_now were measured at (last speculating)
        self.choice = sizing.largest
        self.tried = self.trying = False          # none has been tried (is being tried) by `choose`
        self.grew = self.growing = False          # a choice was grown (`grown_choice`); it is being measured
        self._since = 0                           # results since the last decision
        self.decided = False                      # the rule has chosen at least once
        self.calibration = 1.0                    # measured / modelled rate of the speculating choice in use
        self._last: float | None = None           # arrival of the previous result under the current choice
        self._skip = 0                            # results still to come of micro-batches of the previous choice
        self.draft_rounds_seen = 0                # draft rounds observed (the first one warms up)
        self.left_start = False                   # step 0 of the rule has looked (and left a draft-bound start)
        self.switches: deque[Switch] = deque(maxlen=8)   # the latest switches (the engine logs them)
        self.switched = 0                         # switches so far

    # -- what the scheduler sees ---------------------------------------------------------------------
    def observe_stage(self, rows: int, ms: float, speculating: bool = True) -> None:
        self.costs[speculating].stage.add(rows, ms)

    def observe_hop(self, ms: float, speculating: bool = True) -> None:
        self.costs[speculating].hop.add(max(ms, 0.0))

    def observe_control(self, ms: float, speculating: bool = True) -> None:
        self.costs[speculating].ctl.add(ms)

    def observe_result(self, arrived_ms: float, tokens: int, requests: int = 1) -> None:
        """A result arrived (the transport's clock; 0: it has none) and `tokens` were committed on it, by
        the `requests` requests held: the current choice's pace at that load."""
        if arrived_ms <= 0:
            return
        self.held.add(requests)
        if self._skip > 0:                # a micro-batch of the choice before: not this one's pace, nor is the
            self._skip -= 1               # wait for the first of this one's (a whole trip, its draft catching up)
            self._last = None
            return
        if self._last is not None and arrived_ms >= self._last:
            pace = self.paces.setdefault((self.choice.shape, load(self.held.value)), Pace(1 - 1 / self.every))
            pace.add(tokens, arrived_ms - self._last)
        self._last = arrived_ms

    def idle(self) -> None:
        """No request is running: the time until the next result is not the pipeline's."""
        self._last = None

    def observe_draft(self, rows: int, ms: float) -> None:
        self.draft.add(rows, ms)
        self.draft_rounds_seen += 1

    def observe_root(self, rank: int, injected: int) -> None:
        """A verification at a root: the target's token was the draft's `rank`-th child (-1: not proposed);
        `injected` of the root's children had gone in."""
        self.ranks *= 0.995
        self.ranks[rank if 0 <= rank < MAX_RANK else MAX_RANK] += 1
        self.k_now.add(injected)
        # (a root with no proposal in says nothing of topk)
        if injected > 0 and not self.sizing.pin_topk and self.choice.speculates and \
                self.coverage.add(rank, self.choice.topk):
            self.cover = self.sizing.max_topk     # a shift: measured again (from the next `step`)

    def observe_tokens(self, tokens: int) -> None:
        """Tokens one speculating request committed on one result."""
        self.tokens.add(tokens)

    # -- the model -----------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.costs[True].known and self.draft.known and self.tokens.n >= 8 and self.ranks.sum() >= 8

    def hit(self, k: float) -> float:
        """P(the target's token is among the first k proposals)."""
        p = self.ranks / self.ranks.sum()
        whole = min(int(k), MAX_RANK)
        return float(p[:whole].sum() + (k - whole) * (p[whole] if whole < MAX_RANK else 0.0))

    def _f(self, width: int, topk: int) -> float:
        w_now = self.w_seen
        k = min(max((self.k_now.value or 1.0) * width / w_now, 1.0), float(topk), float(MAX_RANK))
        return 1.0 / (1.0 + (1.0 - self.hit(k)) * (self.S - 1))

    def topk_for(self, width: int) -> int:
        """The topk of a choice of this width: pinned, else min(the largest, max(the smallest, width),
        coverage)."""
        s = self.sizing
        return s.max_topk if s.pin_topk else min(s.max_topk, max(self.coverage.smallest, width), self.cover)

    def measured(self, choice: Choice, requests: int = 1) -> float | None:
        """The choice's measured pace at this load, once it has run long enough: speculating, half a decision
        interval (misses come in bursts); none, NONE_PACED results or that half interval if shorter."""
        pace = self.paces.get((choice.shape, load(self.held.value if self.held.n else requests)))
        need = self.every // 2 if choice.speculates else min(self.every // 2, NONE_PACED)
        return pace.rate if pace is not None and pace.n >= need else None

    def expected(self, choice: Choice, requests: int = 1) -> float:
        """Committed tokens per ms to expect: as measured where the choice has run, else the model —
        speculating, scaled by what the choice in use achieves against its model (stages, draft and coordinator
        that share cores, lag, refills: what the model leaves out)."""
        seen = self.measured(choice, requests)
        if seen is not None:
            return seen
        return self.rate(choice, requests) * (self.calibration if choice.speculates else 1.0)

    def rate(self, choice: Choice, requests: int = 1) -> float:
        """The model's committed tokens per ms over `requests` requests."""
        n, S = max(requests, 1), self.S
        if not choice.speculates:        # its own costs once seen, else the speculating ones without control
            c = self.costs[False] if self.costs[False].known else self.costs[True]
            hop, ctl = c.hop.value or 0.0, (c.ctl.value or 0.0) if c is self.costs[False] else 0.0
            m = max(1.0, n / S)
            return min(1.0, n / S) * m / max(c.stage(m) + hop + ctl / S, 1e-9)
        c = self.costs[True]
        hop, ctl = c.hop.value or 0.0, c.ctl.value or 0.0
        share = choice.width if n == 1 else min(choice.width, max(1, self.node_budget // n))
        rows = n * share
        stage, d = c.stage(rows) + hop + ctl / S, max(self.draft(rows), 1e-9)
        if self.shared:        # the draft's rounds take the stages' cores: a step holds all of them
            step, fit = max(stage, choice.rounds * d, ctl), float(choice.rounds)
        else:                  # the draft runs beside: a round beyond a step's is run-ahead (a result cuts it)
            step = max(stage, d, ctl)
            fit = min(float(choice.rounds), step / d)
        f_now = self._f(self.w_seen, self.choice.topk or self.topk_for(self.w_seen))
        tokens = min((self.tokens.value or 0.0) * self._f(share, choice.topk) / f_now, fit)
        return n * tokens / max(step, 1e-9)

    def candidates(self) -> list[Choice]:
        s = self.sizing
        widths = [s.max_width] if s.pin_width else sorted({w for w in AUTO_WIDTHS if w <= s.max_width} |
                                                          {s.max_width})
        rounds = [s.max_rounds] if s.pin_rounds else list(range(s.max_rounds, 0, -1))   # ties: more run-ahead
        out = [Choice(w, self.topk_for(w), r) for w in widths for r in rounds]
        return out if s.pin_width else out + [NONE]

    def step(self, requests: int = 1) -> Choice:
        """After each result: the choice for what follows — the rule (`choose`) as soon as it knows enough,
        then every `every` results, and as soon as a trial of none has been measured."""
        self._since += 1
        if not self.left_start and not self.decided and self.draft_rounds_seen >= 2 and self.costs[True].stage.known:
            self.left_start = True            # step 0 looks once, as soon as it can (not on every later result)
            smaller = self.leave_draft_bound_start()
            if smaller is not None:
                self._since = 0
                self._switch(smaller, Why.DRAFT_BOUND, requests)
                return self.choice
        trial_done = (self.trying and self.measured(NONE, requests) is not None) or \
            (self.growing and self.measured(self.choice, requests) is not None)
        if self._since >= self.every or (not self.decided and self.ready) or trial_done:
            self._since, self.trying = 0, False
            self.choose(requests)
        topk = self.topk_for(self.choice.width)
        if self.choice.speculates and self.choice.topk != topk:    # coverage moved (rule step 4): at once
            self._switch(Choice(self.choice.width, topk, self.choice.rounds), Why.COVERAGE, requests)
        return self.choice

    def choose(self, requests: int = 1) -> Choice:
        """The best candidate when it beats the current choice by MARGIN (UNTRIED on the model's word alone;
        out of none where stages share cores, only a measured candidate), else the current one.
        Until none has been measured, it is tried (`measured`: for NONE_PACED results) when speculation is not
        predicted EXPLORE times as fast: its modelled costs are the speculating ones, which overstate it where
        stages share cores with the draft (`shared`; where they cannot, when the model itself does not favour
        speculation)."""
        if not self.ready or not self.sizing.auto:
            return self.choice
        self.cover = self.coverage.topk(self.cover)
        seen = self.measured(self.choice, requests)
        if self.choice.speculates and seen is None:
            return self.choice            # the choice in use is judged (and calibrates the model) once measured
        self.decided, self.growing = True, False
        if self.choice.speculates:        # (before a trial of none: what was measured must not be lost to it)
            self.calibration = seen / max(self.rate(self.choice, requests), 1e-9)
        grown = self.grown_choice(requests)
        if grown is not None:
            self.grew = self.growing = True
            self._switch(grown, Why.GROW, requests)
            return self.choice
        if self.choice.speculates and not self.sizing.pin_width and self.measured(NONE, requests) is None and \
                not self.tried:
            best = max(self.expected(c, requests) for c in self.candidates() if c.speculates)
            if best < self.explore * self.rate(NONE, requests):
                self.tried = self.trying = True
                self._switch(NONE, Why.TRY_NONE, requests)
                return self.choice
        leaving_none = self.shared and not self.choice.speculates

        def score(c: Choice) -> float:           # a change must promise more: more still if never measured
            margin = 0.0 if c.shape == self.choice.shape else \
                MARGIN if self.measured(c, requests) is not None else UNTRIED
            return self.expected(c, requests) / (1 + margin)

        now = self.choice if not self.choice.speculates else \
            Choice(self.choice.width, self.topk_for(self.choice.width), self.choice.rounds)
        # out of none where stages share cores: only what was measured (the model's calibration, carried over
        # from the width that ran, is no guide to a width that never ran beside these stages)
        pool = [c for c in self.candidates() if not leaving_none or self.measured(c, requests) is not None]
        best = max([now] + pool, key=score)
        if best != self.choice:
            self._switch(best, Why.FASTER, requests)
        return self.choice

    @property
    def settled(self) -> bool:
        """The rule has decided and measures nothing for a decision to come (a warm-up may end here)."""
        return self.decided and not self.trying and not self.growing

    def grown_choice(self, requests: int = 1) -> Choice | None:
        """Step 1's first half where stages share cores (`shared`): once, before none is tried, the choice in
        use with twice the width and one round more, if it has not been measured — the model cannot speak for
        it there (a chain's tokens per result grow with its rounds, and chained rounds cost less than the
        calls the model charges), so it is measured. Real processes, pinned, topk 1: width 1 x 1 round
        40.8 ms a token at S = 4 and 44.5 at S = 2, 2 x 2 36.6 and 36.7 (`pp` 51.1, 47.8)."""
        c, s = self.choice, self.sizing
        if not self.shared or self.grew or self.tried or not c.speculates:
            return None
        width = c.width if s.pin_width else min(2 * c.width, s.max_width)
        rounds = c.rounds if s.pin_rounds else min(c.rounds + 1, s.max_rounds)
        grown = Choice(width, self.topk_for(width), rounds)
        return None if grown.shape == c.shape or self.measured(grown, requests) is not None else grown

    def leave_draft_bound_start(self) -> Choice | None:
        """Step 0 of the rule (module docstring): the choice to leave a draft-bound start for, or None (not
        draft-bound, not known yet: two draft rounds and a stage step seen, or a pinned width).

            S = 4, c(w) = 50 ms (one bucket: flat), hop 0; draft rounds of 16 and 32 rows took 212 and 626 ms
            (a line through the origin: d(w) = 18.3 w). Stages apart (one round a step): the start
            (32, 16, 4): d(32) = 586 > 2 * 50, so it is left; width 4: 73 > 50; width 2: 36.6 <= 50 ->
            (2, 2, 4), the widest that keeps up, with the most run-ahead.
        """
        c, choice = self.costs[True], self.choice
        if self.sizing.pin_width or not choice.speculates or self.draft_rounds_seen < 2 or not c.stage.known:
            return None
        hop = c.hop.value or 0.0

        def keeps_up(x: Choice, factor: float = 1.0) -> bool:   # (apart: a step waits for one round, `rate`)
            return (x.rounds if self.shared else 1) * self.draft(x.width) <= factor * (c.stage(x.width) + hop)
        if keeps_up(choice, DRAFT_BOUND):
            return None
        smallest = min((x for x in self.candidates() if x.speculates), key=lambda x: (x.width, x.rounds))
        if self.shared:                   # shared cores: the smallest, then grown by measurement (step 1)
            return smallest
        smaller = [x for x in self.candidates() if x.speculates and x.width <= choice.width and keeps_up(x)]
        return max(smaller, key=lambda x: (x.width, x.rounds)) if smaller else smallest

    def _switch(self, choice: Choice, why: Why, requests: int = 1) -> None:
        def pace(c: Choice) -> tuple[float | None, bool]:   # (ms per token, measured): else modelled once ready
            seen = self.measured(c, requests)
            rate = seen if seen is not None else self.expected(c, requests) if self.ready else 0.0
            return (1.0 / rate if rate > 0 else None), seen is not None
        (before_ms, before_seen), (after_ms, after_seen) = pace(self.choice), pace(choice)
        self.switches.append(Switch(self.choice, choice, why, before_ms, after_ms, before_seen, after_seen))
        self.switched += 1
        if choice.shape == self.choice.shape:    # topk alone (rule step 4): the same pace goes on
            self.choice = choice
            return
        self.choice = choice
        self.w_seen = choice.width or self.w_seen
        self._last = None                         # the next interval straddles the change: not counted
        self._skip = self.S                       # nor the S results of micro-batches sent before it,
        if choice.speculates:                     # nor, speculating, those while the tree and the draft settle
            self._skip += self.every // 2
