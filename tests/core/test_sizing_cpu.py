"""The cost rule (coordinator/core/sizing.py) where rows are dear and stages share cores (a CPU): topk from 1
(`least_topk`), and a choice's pace measured only once it has settled (`_switch`)."""
from __future__ import annotations

import pytest

from coordinator.core.sizing import NONE, ROWS_DEAR, Choice, Sizer, Sizing, Why
from coordinator.core.sizing_estimators import MIN_TOPK, Coverage

from helpers.sizing import pace as _pace, ranks as _ranks, teach as _teach


def test_coverage_from_one_takes_a_chain_when_the_first_rank_holds_enough():
    """Ranks 0, 1 seen 95 and 5 times at topk 16: from 4 (the default least) topk 4; from 1, topk 1 (95% >=
    COVER = 90%); 85 and 15: topk 2 (85% < 90% <= 100%)."""
    for counts, from_one in (([95, 5], 1), ([85, 15], 2)):
        cov = Coverage(16, 64)
        for rank in _ranks(counts + [0]):
            cov.add(rank, 16)
        assert cov.topk(16) == MIN_TOPK and cov.topk(16, least=1) == from_one


@pytest.mark.parametrize("stage, dear", [
    ((5.0, 0.025), False),     # the GPU regime: c(4) / c(1) = 5.1 / 5.025 = 1.015
    ((120.0, 0.25), False),    # the 120 ms clock: 1.006
    ((12.0, 0.6), True),       # this CPU, S = 4 (about): 14.4 / 12.6 = 1.14
])
def test_rows_are_dear_where_four_cost_more_than_one_by_rows_dear(stage, dear):
    sizer = Sizer(4, Sizing.of(0, 0, 0))
    assert sizer.least_topk() == MIN_TOPK, "nothing seen: the default"
    _teach(sizer, stage, 1.0, (20.0, 0.5), 1.0, 0.8, [0] * 95 + [1] * 5)
    a, b = stage
    assert ((a + 4 * b) > ROWS_DEAR * (a + b)) == dear
    assert sizer.least_topk() == (1 if dear else MIN_TOPK)
    _pace(sizer, 50.0)
    assert sizer.step().topk == (1 if dear else MIN_TOPK)         # 95% at the first rank: a chain where dear


def test_rows_once_dear_stay_dear():
    """Stage times on shared cores are noisy: a line that looks flat later does not bring siblings back."""
    sizer = Sizer(4, Sizing.of(0, 0, 0))
    sizer.observe_stage(1, 12.0)
    sizer.observe_stage(32, 40.0)
    assert sizer.least_topk() == 1
    for _ in range(200):
        sizer.observe_stage(1, 30.0)              # the 1-row bucket now costs about what 32 rows did
    assert sizer.costs[True].stage(MIN_TOPK) <= ROWS_DEAR * sizer.costs[True].stage(1)
    assert sizer.least_topk() == 1


def test_a_speculating_choices_pace_counts_once_it_has_settled():
    """S = 4 (a decision every 16 results). After a switch to a speculating choice the S results of
    micro-batches sent before it, then half a decision interval (8) while the tree and the draft settle, then
    the first result after them (a whole trip's wait) are not its pace: results 14 on are. A switch to none
    skips only the S and the first."""
    sizer = Sizer(4, Sizing.of(0, 0, 0))
    sizer._switch(Choice(2, 1, 1), Why.FASTER)
    t = 0.0
    for _ in range(13):                           # slow, as a transition is: none of it counts
        t += 500.0
        sizer.observe_result(t, 1)
    assert sizer.paces == {}
    for _ in range(8):
        t += 40.0
        sizer.observe_result(t, 1)
    assert sizer.measured(Choice(2, 1, 1)) == pytest.approx(1 / 40)
    sizer._switch(NONE, Why.TRY_NONE)
    assert sizer._skip == 4
