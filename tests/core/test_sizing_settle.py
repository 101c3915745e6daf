"""The cost rule (coordinator/core/sizing.py): topk from 2 (a chain with one hedge below each node where the
draft's first guess holds COVER; from 1, a plain chain, where stages share the draft's cores), and a choice's
pace measured only once it has settled (`_switch`)."""
from __future__ import annotations

import pytest

from coordinator.core.sizing import NONE, Choice, Sizer, Sizing, Why
from coordinator.core.sizing_estimators import Coverage

from helpers.sizing import pace as _pace, ranks as _ranks, teach as _teach


@pytest.mark.parametrize("counts, topk", [([95, 5, 0], 2), ([85, 15, 0], 2), ([72, 15, 6, 3, 2, 1, 1, 0], 4)])
def test_a_draft_whose_first_guess_holds_cover_grows_a_chain_with_one_hedge(counts, topk):
    """Ranks seen at topk 16: 95 of 100 at rank 0 (95% >= COVER = 90%) -> topk 2, the smallest (MIN_TOPK: the
    tree, ranked by measured acceptance, hedges where the draft is unsure); 85 -> 2 (85 + 15); the module's
    example (72, 87, 96% in 1, 2, 4) -> 4. As a GPU profile's rule chooses it too (stages apart); where they
    share the draft's cores a first guess holding COVER grows a plain chain (CHAIN_TOPK, 1)."""
    cov = Coverage(16, 64)
    for rank in _ranks(counts):
        cov.add(rank, 16)
    assert cov.topk(16) == topk
    for shared, expected in ((False, topk), (True, 1 if counts[0] >= 90 else topk)):
        sizer = Sizer(8, Sizing.of(0, 0, 0), shared=shared)
        _teach(sizer, (5.0, 0.025), 0.5, (1.5, 0.005), 1.5, 0.76, _ranks(counts), injected=9)
        _pace(sizer, 1 / sizer.rate(sizer.choice))
        assert sizer.step() == Choice(32, expected, 4), shared


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


def test_where_stages_share_cores_a_draft_bound_start_goes_to_the_smallest_then_grows_once():
    """The step-0 example's costs (stages 50 ms flat, draft d(w) = 18.3 w): apart, (2, 2, 4) keeps up; shared,
    the start is left for (1, 1, 1). Once measured (and the model ready), the rule measures (2, 1, 2) (topk by
    coverage: 95% at rank 0, from CHAIN_TOPK where stages share cores) before it tries none, and does not grow
    again after."""
    sizer = Sizer(4, Sizing.of(0, 0, 0))
    sizer.observe_stage(43, 50.0)
    for rows, ms in ((16, 212.0), (32, 626.0)):
        sizer.observe_draft(rows, ms)
    assert sizer.step() == Choice(1, 1, 1)
    _teach(sizer, (50.0, 0.0), 1.0, (0.0, 18.3), 1.0, 0.8, [0] * 95 + [1] * 5)
    t = 0.0
    for _ in range(40):
        t += 60.0
        sizer.observe_result(t, 1)
        if sizer.step() != Choice(1, 1, 1):
            break
    assert sizer.choice == Choice(2, 1, 2) and sizer.switches[-1].why == Why.GROW and sizer.grew
    assert sizer.grown_choice() is None and sizer.decided and not sizer.settled    # (a warm-up goes on)
    for n in range(1, 40):            # judged as soon as measured: S + 8 settling + 1 + 8 results, not at an interval
        t += 40.0
        sizer.observe_result(t, 1)
        if sizer.step() != Choice(2, 1, 2):
            break
    # (speculation is modelled 5x as fast as none here: none is not tried, the model's pick follows)
    assert n == 4 + 8 + 1 + 8 and sizer.switches[-1].why == Why.FASTER and sizer.settled
    apart = Sizer(4, Sizing.of(0, 0, 0), shared=False)
    apart.observe_stage(43, 50.0)
    for rows, ms in ((16, 212.0), (32, 626.0)):
        apart.observe_draft(rows, ms)
    assert apart.step() == Choice(2, 2, 4) and apart.grown_choice() is None
