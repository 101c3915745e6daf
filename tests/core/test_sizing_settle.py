"""The cost rule (coordinator/core/sizing.py): topk from 1 (a chain where the draft's first guess holds COVER),
and a choice's pace measured only once it has settled (`_switch`)."""
from __future__ import annotations

import pytest

from coordinator.core.sizing import NONE, Choice, Sizer, Sizing, Why
from coordinator.core.sizing_estimators import Coverage

from helpers.sizing import pace as _pace, ranks as _ranks, teach as _teach


@pytest.mark.parametrize("counts, topk", [([95, 5, 0], 1), ([85, 15, 0], 2), ([72, 15, 6, 3, 2, 1, 1, 0], 4)])
def test_a_draft_whose_first_guess_holds_cover_grows_a_chain(counts, topk):
    """Ranks seen at topk 16: 95 of 100 at rank 0 -> topk 1 (95% >= COVER = 90%); 85 -> 2 (85 + 15); the
    module's example (72, 87, 96% in 1, 2, 4) -> 4. As a GPU profile's rule chooses it too: a chain."""
    cov = Coverage(16, 64)
    for rank in _ranks(counts):
        cov.add(rank, 16)
    assert cov.topk(16) == topk
    sizer = Sizer(8, Sizing.of(0, 0, 0))
    _teach(sizer, (5.0, 0.025), 0.5, (1.5, 0.005), 1.5, 0.76, _ranks(counts), injected=9)
    _pace(sizer, 1 / sizer.rate(sizer.choice))
    assert sizer.step() == Choice(32, topk, 3)


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
