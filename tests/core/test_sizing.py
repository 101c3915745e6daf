"""The cost rule (coordinator/core/sizing.py) on hand-computed cases: what it learns from observations, the
rates its model gives, and what it chooses — wide on a GPU-like profile, none where the draft costs as much as
the target, measured pace over the model, pinned values kept."""
from __future__ import annotations

import math
import random

import pytest

from coordinator.core.sizing import EXPLORE, NONE, Choice, Line, Pace, Sizer, Sizing, Why, load
from coordinator.core import sizing_estimators
from coordinator.core.sizing_estimators import COVER, HOLD_Z, Coverage
from helpers.sizing import pace as _pace, ranks as _ranks, teach as _teach


def test_a_line_through_two_buckets():
    line = Line()
    line.add(1, 5.0)
    line.add(32, 5.8)
    a, b = line.coefficients()
    assert a == pytest.approx(5.0 - 0.8 / 31)        # 4.974
    assert b == pytest.approx(0.8 / 31)              # 0.0258
    assert line(16) == pytest.approx(a + 16 * b)


def test_a_line_with_one_bucket_is_flat_and_never_falls():
    line = Line()
    line.add(32, 8.0)
    assert line.coefficients() == (8.0, 0.0)           # fewer rows are not cheaper without evidence
    line.add(2, 9.0)                                   # costs that fall with rows are noise: a flat line
    assert line.coefficients() == (8.5, 0.0)


def test_sizing_of_config_values():
    s = Sizing.of(0, 0, 0)
    assert (s.max_width, s.max_topk, s.max_rounds, s.auto) == (32, 16, 4, True)
    s = Sizing.of(8, 0, 1)
    assert (s.max_width, s.pin_width, s.pin_topk, s.pin_rounds) == (8, True, False, True)
    assert not Sizing.of(8, 4, 1).auto


def _gpu(shared: bool = True) -> Sizer:
    """The GPU regime: S = 8, stages 5 + 0.025 ms/row, hops 0.5 ms, draft 1.5 + 0.005 ms/row, control 1.5 ms;
    0.76 tokens per step at width 32; the draft's first child right 9 times in 10, its second the tenth."""
    sizer = Sizer(8, Sizing.of(0, 0, 0), shared=shared)
    _teach(sizer, (5.0, 0.025), 0.5, (1.5, 0.005), 1.5, 0.76, [0] * 90 + [1] * 10)
    return sizer


def test_the_gpu_profile_rates_by_hand():
    sizer = _gpu()
    # w32 r2: step = max(5 + 0.8 + 0.5 + 1.5 / 8, 2 * (1.5 + 0.16), 1.5) = 6.4875 ms; 0.76 tokens (measured here)
    assert sizer.rate(Choice(32, 16, 2)) == pytest.approx(0.76 / 6.4875)
    # none: one trip of 8 x (5.025 + 0.5) ms per token (no control time seen without speculation yet)
    assert sizer.rate(NONE) == pytest.approx(1 / 44.2)
    # narrower: fewer children per root are injected, the draft's second child is missed more often
    assert sizer.rate(Choice(4, 4, 2)) < sizer.rate(Choice(32, 16, 2))


def test_a_round_is_kept_where_it_keeps_up_and_left_where_it_does_not():
    """Stages sharing the draft's cores (`_gpu()`'s default): a step holds all its rounds. 3 * d(32) =
    3 * 1.66 = 4.98 ms fits in a step of 6.4875 ms, so 3 rounds rate as 2; the start's 4 * 1.66 = 6.64 ms sets
    the step (2.3% slower), not by the 25% an untried choice must promise, so the start (32, 16, 4) stays.
    A draft of 3 + 0.005 ms/row: 4 * 3.16 = 12.64 ms sets the step, 2 * 3.16 = 6.32 does not (6.4875 ms).
    Best of all is width 16 with one round: its 2 root children hold every target token seen (the first two
    ranks), so it commits about as much as 32 does (99%: the counts' prior leaves a little beyond the first
    ranks), and its step is max(5 + 0.4 + 0.5 + 0.1875, 3.08) = 6.0875 ms: 2.08x as fast as the start."""
    gpu = _gpu()
    assert gpu.rate(Choice(32, 16, 3)) == pytest.approx(gpu.rate(Choice(32, 16, 2)))
    assert gpu.rate(Choice(32, 16, 4)) == pytest.approx(0.76 / 6.64)
    _pace(gpu, 1 / gpu.rate(gpu.choice))
    assert gpu.choose().shape == (32, 4)
    slow = Sizer(8, Sizing.of(0, 0, 0))
    _teach(slow, (5.0, 0.025), 0.5, (3.0, 0.005), 1.5, 0.76, [0] * 90 + [1] * 10)
    assert slow.rate(Choice(32, 16, 4)) == pytest.approx(0.76 / 12.64)
    assert slow.rate(Choice(32, 16, 2)) == pytest.approx(0.76 / 6.4875)
    assert slow.rate(Choice(16, 16, 1)) == pytest.approx(0.76 / 6.0875, rel=0.01)
    _pace(slow, 1 / slow.rate(slow.choice))
    assert slow.choose().shape == (16, 1)


def test_where_stages_run_apart_a_round_beyond_a_step_is_run_ahead():
    """Stages apart from the draft (GPU pods, the simulated clock): the draft works beside them and a result
    cuts its rounds, so the step is max(stage, one round, control) and a result commits at most the rounds
    that fit in it. The slow draft (3 + 0.005 ms/row): every round count of width 32 steps at 6.4875 ms and
    fits 6.4875 / 3.16 = 2.05 rounds, more than the 0.76 tokens measured: all rate alike, and the start
    (32, 16, 4) stays on ties. With 1.7 tokens a result, one round caps it at 1 token."""
    slow = Sizer(8, Sizing.of(0, 0, 0), shared=False)
    _teach(slow, (5.0, 0.025), 0.5, (3.0, 0.005), 1.5, 0.76, [0] * 90 + [1] * 10)
    for rounds in (1, 2, 4):
        assert slow.rate(Choice(32, 16, rounds)) == pytest.approx(0.76 / 6.4875)
    assert slow.leave_draft_bound_start() is None                # 4 * 3.16 < 2 * (5.8 + 0.5): not step 0's case
    many = Sizer(8, Sizing.of(0, 0, 0), shared=False)
    _teach(many, (5.0, 0.025), 0.5, (3.0, 0.005), 1.5, 1.7, [0] * 90 + [1] * 10)
    assert many.rate(Choice(32, 16, 1)) == pytest.approx(1 / 6.4875)
    assert many.rate(Choice(32, 16, 4)) == pytest.approx(1.7 / 6.4875)


def test_the_gpu_profile_stays_wide():
    sizer = _gpu()
    assert sizer.choose() == Choice(32, 16, 4) and not sizer.decided     # not judged before it is measured
    _pace(sizer, 1 / sizer.rate(sizer.choice))                           # as the model says
    choice = sizer.choose()
    assert sizer.decided and sizer.calibration == pytest.approx(1.0)
    assert choice.speculates and choice.width >= 16


def test_a_cpu_profile_with_a_draft_as_costly_as_the_target_chooses_none():
    """S = 4 stages of 28 + 0.5 ms/row, a draft of the whole target (112 + 0.5 ms/row): any speculating step
    takes at least 112.5 ms for at most 0.8 tokens (>= 140 ms per token); none takes 4 x 29.5 = 118 ms."""
    sizer = Sizer(4, Sizing.of(0, 0, 0))
    _teach(sizer, (28.0, 0.5), 1.0, (112.0, 0.5), 3.0, 0.8, [0] * 80 + [1] * 10 + [-1] * 10)
    assert 1 / sizer.rate(NONE) == pytest.approx(118.0)
    assert max(sizer.rate(c) for c in sizer.candidates() if c.speculates) < sizer.rate(NONE)
    _pace(sizer, 150.0)
    assert sizer.choose() == NONE


def test_a_pinned_width_is_kept_and_never_none():
    sizer = Sizer(4, Sizing.of(8, 0, 0))
    assert sizer.choice.width == 8
    _teach(sizer, (28.0, 0.5), 1.0, (112.0, 0.5), 3.0, 0.8, [0] * 20)
    assert NONE not in sizer.candidates()
    assert {c.width for c in sizer.candidates()} == {8}
    assert sizer.choose().width == 8


def test_none_is_tried_then_judged_by_its_measured_pace():
    """The CPU profile: speculation is not predicted 4x as fast as none, so none is tried; measured at one
    token per 200 ms (the model said 118), against speculation measured at one per 150 ms: back to
    speculating."""
    sizer = Sizer(4, Sizing.of(0, 0, 0))
    assert sizer.choice == Choice(32, 16, 4)
    _teach(sizer, (28.0, 0.5), 1.0, (112.0, 0.5), 3.0, 0.8, [0] * 80 + [1] * 10 + [-1] * 10)
    _pace(sizer, 150.0, 16)                   # speculating at 150 ms per token
    assert sizer.choose() == NONE and sizer.trying
    t = 150.0 * 16
    seen = []
    for _ in range(14):                       # none at 200 ms per token: its trial ends once measured
        t += 200.0
        sizer.observe_result(t, 1)
        seen.append(sizer.step())
    assert sizer.measured(NONE) == pytest.approx(1 / 200)
    # S = 4 results of the micro-batches sent before the switch, the first of none's (its wait is a whole
    # trip: not counted), then NONE_PACED (8) measured: none is judged on the 13th result, not before
    assert all(c == NONE for c in seen[:12]) and seen[12].speculates and not sizer.trying
    # out of none only a measured choice counts (stages share cores: the default), by 10%: width 32 x 3
    # rounds, measured at 150 ms a token against none's 200 (33% more), with the topk coverage allows: rank 0
    # holds 80 of the 90 proposed (89%), ranks 0-1 all: 2
    assert seen[-1] == Choice(32, 2, 4)
    # the switches, for the engine's log: none modelled at 4 x (28.5 + 1) = 118 ms a token (the speculating
    # costs without control), then measured at 200
    trial, back = sizer.switches
    assert (trial.before, trial.after, trial.why) == (Choice(32, 16, 4), NONE, Why.TRY_NONE)
    assert (trial.before_ms, trial.before_measured) == (pytest.approx(150.0), True)
    assert (trial.after_ms, trial.after_measured) == (pytest.approx(118.0), False)
    assert (back.before, back.after, back.why) == (NONE, Choice(32, 2, 4), Why.FASTER)
    assert (back.before_ms, back.after_ms) == (pytest.approx(200.0), pytest.approx(150.0))
    assert back.before_measured and back.after_measured and sizer.switched == 2
    assert sizer.choose().speculates                  # none tried once: not again while its pace says no


def test_where_the_draft_sets_the_pace_fewer_rounds_commit_fewer_tokens():
    """A CPU whose draft costs as much as the whole target (S = 4, stages 28 + 0.5 ms/row, draft 112 + 0.5):
    at 3 rounds (the largest) every result waits for 384 ms of draft and commits 1.7 tokens (up to three spine
    layers a result; 2 rounds: 256 ms).
    One round cannot commit more than one layer a result, so width 8 with 1 round is 1 token per 116 ms —
    no better than none, which is kept after its trial (uncapped, the model said 1.7 tokens per 116 ms and
    went back to speculating)."""
    sizer = Sizer(4, Sizing.of(0, 0, 0))
    _teach(sizer, (28.0, 0.5), 0.4, (112.0, 0.5), 1.0, 1.7, [0] * 40)
    # step = max(28 + 4 + 0.4 + 1 / 4, 1 * (112 + 4), 1) = 116 ms; tokens = min(1.7 * f(8) / f(32), 1 round)
    assert sizer.rate(Choice(8, 8, 1)) == pytest.approx(1 / 116.0)
    # step = max(28 + 16 + 0.65, 2 * 128, 1) = 256 ms for min(1.7, 2) tokens
    assert sizer.rate(Choice(32, 16, 2)) == pytest.approx(1.7 / 256.0)
    assert sizer.rate(Choice(32, 16, 4)) == pytest.approx(1.7 / 512.0)     # (4 * 128 ms of draft)
    _pace(sizer, 512.0 / 1.7, 16)             # the start, speculating as modelled: 301 ms per token
    assert sizer.choose() == NONE
    t = 512.0 / 1.7 * 16
    for _ in range(14):                       # none at 119 ms per token
        t += 119.0
        sizer.observe_result(t, 1)
        assert sizer.step() == NONE
    assert sizer.measured(NONE) == pytest.approx(1 / 119.0)


def test_the_gpu_profile_does_not_try_none():
    sizer = _gpu()
    _pace(sizer, 1 / sizer.rate(sizer.choice))
    sizer.choose()
    assert not sizer.tried and sizer.choice.speculates


@pytest.mark.parametrize("shared, tried", [(True, True), (False, False)])
def test_none_is_tried_where_the_stages_may_share_the_drafts_hardware(shared, tried):
    """Speculation measured at 3x none's modelled pace (a run of misses: one token per 44.2 / 3 = 14.7 ms):
    where the stages' step times may depend on the draft (`shared`) the speculating costs may overstate none's
    (EXPLORE = 4), so none is tried; where they cannot (the simulated clock) the model is right about none,
    which is 3x slower: not tried."""
    sizer = _gpu(shared)
    assert sizer.rate(NONE) == pytest.approx(1 / 44.2)
    _pace(sizer, 44.2 / 3)
    assert (sizer.choose() == NONE) is tried and sizer.tried is tried


@pytest.mark.parametrize("hardware, explore", [("shared", EXPLORE), ("apart", 1.0), (None, EXPLORE)])
def test_the_stage_hardware_setting_reaches_the_cost_rule(hardware, explore):
    """--stage-hardware (default shared: one machine) makes the scheduler's rule explore none or not."""
    from coordinator.core.drafts.ngram import NgramDraft
    from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
    spec = SpecOptions(NgramDraft()) if hardware is None else SpecOptions(NgramDraft(), stage_hardware=hardware)
    assert make_scheduler("specpipe", 8, spec).sizer.explore == explore


def test_what_ran_is_judged_by_its_measured_pace():
    """The model says width 32 is best; its measured pace (1 token per 100 ms) is worse than none's (1 per
    50 ms): none it is."""
    sizer = _gpu()
    _pace(sizer, 100.0)
    assert sizer.measured(Choice(32, 16, 4)) == pytest.approx(0.01)
    sizer.paces[NONE.shape, 0] = Pace(0.9)
    for _ in range(5):
        sizer.paces[NONE.shape, 0].add(1, 50.0)
    assert sizer.choose() == NONE


@pytest.mark.parametrize("shared", [False, True])
def test_none_is_left_for_a_width_measured_faster_by_the_margin(shared):
    """S = 2; stages of 28 ms and a draft call of 40 ms whatever the rows, hop 1, control 3, one round pinned:
    every width's step is max(28 + 1 + 3 / 2, 40, 3) = 40 ms and width 32 rates best (0.8 tokens: 1 per 50 ms),
    none 1 per 2 x 29 = 58 ms; not 4x as fast, so after the start is measured (1 token per 100 ms:
    calibration 0.5, every width modelled at most as fast) none is tried, and measured at 1 per 114 ms. The
    start measured 14% faster, and a measured choice needs 10% more (0.01 / 1.1 = 0.00909 > 1 / 114 =
    0.00877): back to it, whether stages share cores or not (its pace was measured after it settled)."""
    sizer = Sizer(2, Sizing.of(0, 16, 1), shared=shared)
    _teach(sizer, (28.0, 0.0), 1.0, (40.0, 0.0), 3.0, 0.8, [0] * 80 + [1] * 10 + [-1] * 10)
    start = sizer.choice
    assert sizer.rate(start) == pytest.approx(0.8 / 40) and sizer.rate(NONE) == pytest.approx(1 / 58)
    _pace(sizer, 100.0, 16)
    assert sizer.step() == NONE and sizer.trying and sizer.calibration == pytest.approx(0.5)
    t, seen = 1600.0, []
    for _ in range(8):                # 2 results of the start's micro-batches, none's first, 4 of none: judged
        t += 114.0
        sizer.observe_result(t, 1)
        seen.append(sizer.step())
    assert sizer.measured(NONE) == pytest.approx(1 / 114) and not sizer.trying
    assert all(c == NONE for c in seen[:6]) and seen[6] == seen[7] == start


def test_paces_are_kept_by_load_level():
    assert [load(n) for n in (1, 2, 3, 5, 7, 8, 11, 12)] == [0, 1, 2, 2, 3, 3, 3, 4]
    sizer = _gpu()
    _pace(sizer, 100.0)                               # one request
    for t in range(60):                               # then eight, whose count dips to seven now and then
        sizer.observe_result(5000.0 + 10.0 * t, 1, requests=7 if t % 4 == 0 else 8)
    assert sizer.paces[Choice(32, 16, 4).shape, 0].rate == pytest.approx(0.01)
    assert sizer.measured(Choice(32, 16, 4)) == pytest.approx(0.1, rel=0.05)     # eight's level now


class Table(Sizer):
    """A rule whose expectations are given: which choice it moves to, and when."""
    ready = True

    def __init__(self, expected: dict[Choice, float], measured: set[Choice]) -> None:
        super().__init__(4, Sizing.of(0, 0, 0))
        self.choice, self.tried = Choice(32, 16, 2), True
        self.table, self.seen = expected, measured

    def expected(self, choice: Choice, requests: int = 1) -> float:
        return self.table.get(choice, 0.0)

    def measured(self, choice: Choice, requests: int = 1) -> float | None:
        return self.table.get(choice) if choice in self.seen else None


@pytest.mark.parametrize("gain, measured, moves", [
    (1.20, False, False), (1.30, False, True),         # modelled only: must promise 25% more
    (1.05, True, False), (1.15, True, True),           # measured: 10%
])
def test_a_change_must_promise_more(gain, measured, moves):
    now, other = Choice(32, 16, 2), Choice(8, 8, 1)
    sizer = Table({now: 1.0, other: gain}, {now, other} if measured else {now})
    assert sizer.choose() == (other if moves else now)


@pytest.mark.parametrize("shared, start_pace, after", [
    (False, 0.9, "untried"),          # apart: the model speaks for width 4 x 1 (2x none's pace, 25% needed)
    (True, 0.9, "none"),              # shared: only a measured choice may leave none
    (True, 1.05, "none"),             # ... by MARGIN (10%), as any measured change
    (True, 1.2, "start"),
])
def test_out_of_none_where_stages_share_cores_only_a_measured_choice_counts(shared, start_pace, after):
    start, untried = Choice(32, 16, 2), Choice(4, 4, 1)
    sizer = Table({NONE: 1.0, start: start_pace, untried: 2.0}, {NONE, start})
    sizer.shared, sizer.choice = shared, NONE
    assert sizer.choose() == {"none": NONE, "start": start, "untried": untried}[after]


def test_a_draft_bound_start_is_left_for_the_widest_choice_that_keeps_up():
    """The module's step 0, its docstring's example: stages of 50 ms (one bucket seen: flat), draft rounds of
    16 and 32 rows that took 212 and 626 ms. After the first result the start (32, 16, 4) is left for
    (2, 2, 4) at once, before the rule knows any acceptance (one round of 2 rows, 36.6 ms, keeps up with a
    50 ms step; apart, its other rounds are run-ahead); it is not done twice. (Stages on hardware of their
    own: where they share the draft's cores the smallest is taken, tests/core/test_sizing_settle.py.)"""
    sizer = Sizer(4, Sizing.of(0, 0, 0), shared=False)
    sizer.observe_draft(16, 212.0)
    assert sizer.step() == Choice(32, 16, 4), "one draft round (a warm-up) and no stage step: not known yet"
    sizer.observe_stage(43, 50.0)
    sizer.observe_draft(32, 626.0)
    assert sizer.leave_draft_bound_start() == Choice(2, 2, 4)
    assert sizer.step() == Choice(2, 2, 4) and sizer.left_start and not sizer.decided
    sizer.observe_draft(2, 400.0)                # even slower now: step 0 is not repeated
    assert sizer.step() == Choice(2, 2, 4)


def test_a_start_whose_draft_keeps_up_stays_and_a_pinned_width_never_leaves():
    gpu = _gpu()                               # 3 * d(32) = 5.0 ms against c(32) + hop = 6.3 ms
    assert gpu.leave_draft_bound_start() is None and gpu.step().shape == (32, 4)    # (topk by coverage: 4)
    pinned = Sizer(4, Sizing.of(32, 0, 0))
    pinned.observe_stage(43, 50.0)
    for rows, ms in ((16, 212.0), (32, 626.0)):
        pinned.observe_draft(rows, ms)
    assert pinned.leave_draft_bound_start() is None and pinned.step().width == 32


def test_a_draft_too_slow_for_any_choice_leaves_for_the_smallest():
    sizer = Sizer(4, Sizing.of(0, 0, 0))
    sizer.observe_stage(8, 10.0)
    for rows, ms in ((16, 300.0), (32, 300.0)):  # one bucket each, flat at 300 ms: nothing keeps up
        sizer.observe_draft(rows, ms)
    assert sizer.step() == Choice(1, 1, 1)            # (stages share cores: topk from CHAIN_TOPK, a chain)


def test_a_speculating_choice_measured_slow_before_the_trial_of_none_keeps_its_calibration():
    """The CPU profile: width 32 x 2 rounds measured at half its model's pace (calibration 0.5); then none is
    tried and measured at 250 ms per token. The untried narrow choices, modelled faster than that by more
    than the 25% margin but slower once scaled by the measured calibration, must not be tried: before, the
    trial's switch returned before the calibration was recorded, and the rule went back to speculating."""
    sizer = Sizer(4, Sizing.of(0, 0, 0))
    _teach(sizer, (28.0, 0.5), 1.0, (112.0, 0.5), 3.0, 0.8, [0] * 80 + [1] * 10 + [-1] * 10)
    modelled = 1 / sizer.rate(sizer.choice)
    _pace(sizer, 2 * modelled, 16)
    assert sizer.choose() == NONE and sizer.trying
    assert sizer.calibration == pytest.approx(0.5, rel=0.01)
    fastest = max((c for c in sizer.candidates() if c.speculates), key=sizer.rate)
    assert 1 / sizer.rate(fastest) * 1.25 < 250.0 < 1 / (sizer.rate(fastest) * 0.5), "the case this test is for"
    t = 2 * modelled * 16
    for _ in range(14):
        t += 250.0
        sizer.observe_result(t, 1)
        choice = sizer.step()
    assert not sizer.trying and choice == NONE and sizer.choose() == NONE


# -- topk by coverage (rule step 4) ---------------------------------------------------------------------
def _covered(counts: list[int]) -> Sizer:
    """The GPU profile whose roots showed these ranks at the largest topk, its width 32 measured as modelled."""
    sizer = Sizer(8, Sizing.of(0, 0, 0))
    _teach(sizer, (5.0, 0.025), 0.5, (1.5, 0.005), 1.5, 0.76, _ranks(counts), injected=9)
    _pace(sizer, 1 / sizer.rate(sizer.choice))
    return sizer


@pytest.mark.parametrize("counts, topk", [
    ([72, 15, 6, 3, 2, 1, 1, 0], 4),                 # the module's example: the first 4 hold 96 of 100
    ([50, 20, 8, 4, 6, 5, 4, 3, 3], 8),              # 82 of 100 in 4, all in 8 (3 not proposed: not counted)
    ([2] * 16 + [0], 16),                             # a flat draft: 25% in 4, 50% in 8
])
def test_topk_is_the_smallest_that_covers_the_proposed_ranks(counts, topk):
    sizer = _covered(counts)
    assert sizer.step().topk == topk and sizer.choice.shape == (32, 4)
    assert {c.topk for c in sizer.candidates() if c.width >= topk} == {topk}
    assert all(c.topk <= max(4, c.width) for c in sizer.candidates() if c.speculates)


def test_a_topk_change_keeps_the_pace_and_its_measurement():
    """topk 16 -> 4 at the first decision: the same (width, rounds), its pace measured on as before, no results
    skipped (a width change skips the S results of micro-batches sent before it)."""
    sizer = _covered([72, 15, 6, 3, 2, 1, 1, 0])
    before = sizer.measured(sizer.choice)
    assert sizer.step() == Choice(32, 4, 4) and sizer.measured(sizer.choice) == before and sizer._skip == 0


def test_coverage_waits_for_enough_ranks_and_a_pinned_topk_never_moves():
    few = _covered([20, 0])                            # 20 < COVER_SEEN ranks: the largest topk still
    assert few.step().topk == 16
    pinned = Sizer(8, Sizing.of(0, 16, 0))
    _teach(pinned, (5.0, 0.025), 0.5, (1.5, 0.005), 1.5, 0.76, [0] * 100, injected=9)
    _pace(pinned, 1 / pinned.rate(pinned.choice))
    assert pinned.step().topk == 16 and pinned.coverage.risk.sum() == 0


def test_a_draft_that_gets_worse_under_a_small_topk_moves_it_up():
    """At topk 4 an unproposed root says only "rank >= 4" (censored) and still counts. The counts said 4% lie
    beyond the first 4; when a third of the roots take ranks 4..7, topk 4's coverage falls below COVER by
    more than HOLD_Z standard errors and the next decision takes 8, where those ranks are seen. When two
    thirds of the roots go beyond 8, which was last seen empty, that is a shift: the counts are forgotten and
    16 measures them again."""
    sizer = _covered([72, 15, 6, 3, 2, 1, 1, 0])
    assert sizer.step().topk == 4
    for i in range(64):
        sizer.observe_root(-1 if i % 3 == 0 else 0, 4)
    assert sizer.coverage.covered(4) < COVER - HOLD_Z * (COVER * (1 - COVER) / sizer.coverage.risk[0]) ** 0.5
    assert sizer.choose().topk == 8 and sizer.step() == Choice(32, 8, 4)
    for i in range(32):
        sizer.observe_root(4 + i % 4 if i % 4 == 0 else 0, 8)
    assert sizer.choose().topk == 8 and sizer.coverage.covered(4) < COVER
    shifted = [sizer.coverage.risk.sum() > 0]
    for rank in _ranks([2] * 8 + [32]):                # flat within 8, two thirds of the roots beyond it
        sizer.observe_root(rank if rank < 8 else -1, sizer.choice.topk)
        shifted.append(sizer.coverage.risk.sum() > 0)
        sizer.step()
    assert False in shifted and sizer.choice.topk == 16
    assert sizer.choose().topk == 16


@pytest.mark.parametrize("rate, held, after", [(0.04, 4, 0), (0.25, 8, 4)])
def test_chance_does_not_move_the_topk(rate, held, after):
    """2,000 roots (seeded draws, a decision every 32) whose target takes one of ranks 0..3, or at `rate` one of 4..7
    (at topk 4: not proposed). At the rate the counts expect (4%) topk stays 4 at every decision; a quarter
    takes it to 8 by the fifth decision (the 100 roots first seen at 16 fade) and it stays there; neither is
    a shift (ranks beyond 8 never come). (The check that came before, an EWMA over ~20 roots with a 5-point
    margin, fired on such noise several times a prompt and measured again at 16 each time.)"""
    draws, cov = random.Random(1), Coverage(16)
    for rank in _ranks([72, 15, 6, 3, 2, 1, 1, 0]):
        cov.add(rank, 16)
    topk, chosen = cov.topk(16), []
    assert topk == 4
    for i in range(2000):
        rank = 4 + draws.randrange(4) if draws.random() < rate else draws.randrange(4)
        assert not cov.add(rank if rank < topk else -1, topk)
        if i % 32 == 31:
            topk = cov.topk(topk)
            chosen.append(topk)
    assert set(chosen[after:]) == {held}


def test_coverage_by_hand(monkeypatch):
    """Kaplan-Meier by hand, with no fading. 100 roots at topk 16, ranks 0..6 taken 88 / 0 / 0 / 0 / 12 / 0 / 0
    times: the first 4 hold 88% (under COVER 0.90, above it less 2 standard errors, 0.84): from 16 the rule
    takes 8, at 4 it holds 4, at 8 it keeps 8. Then the docstring's case: ranks 0..6 taken 72, 15, 6, 3, 2, 1,
    1 times at 16, S(4) = 4 / 100, and 50 roots at topk 4 of which 20 unproposed: hazards 102/150, 15/48, 6/33,
    3/27, so S(4) = 24 / 150 and topk 4 holds 0.84 < 0.851 (2 standard errors at 150 roots; the ranks beyond
    4 were all within 7): 8."""
    monkeypatch.setattr(sizing_estimators, "FADE", 1.0)
    monkeypatch.setattr(sizing_estimators, "SHIFT_Z", math.inf)      # (the shift check: tests above)
    edge = Coverage(16)
    for rank in [0] * 88 + [4] * 12:
        edge.add(rank, 16)
    assert edge.covered(4) == pytest.approx(0.88) and edge.covered(8) == pytest.approx(1.0)
    assert (edge.topk(16), edge.topk(4), edge.topk(8)) == (8, 4, 8)
    cov = Coverage(16)
    for rank in _ranks([72, 15, 6, 3, 2, 1, 1, 0]):
        cov.add(rank, 16)
    assert cov.covered(4) == pytest.approx(0.96) and cov.topk(16) == 4
    for rank in [0] * 30 + [-1] * 20:
        cov.add(rank, 4)
    assert cov.covered(4) == pytest.approx(1 - 24 / 150) and cov.topk(4) == 8
    small = Coverage(4)                                # the largest is 4, every root at rank 0: a chain, with
    for _ in range(40):                                # one hedge below each node (MIN_TOPK)
        small.add(0, 4)
    assert small.topk(4) == 2


def test_a_root_with_no_proposal_in_says_nothing_of_topk():
    sizer = Sizer(8, Sizing.of(0, 0, 0))
    sizer.observe_root(-1, 0)                          # a root never expanded (after a miss): no children
    assert sizer.coverage.risk.sum() == 0 and sizer.ranks[-1] > 1.0
