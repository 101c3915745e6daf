"""The tree's calibrated scores (coordinator/core/calibration.py): the draft's measured acceptance by its
confidence and rank, learnt from verifications, rescoring its proposals on the draft's thread."""
from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator.core import calibration as calibration_module
from coordinator.core.calibration import EDGES, FADE, PRIOR, RANKS, Calibration
from coordinator.core.drafts.job import DraftJob
from coordinator.core.proposals import ProposalRows
from coordinator.core.tree import TokenTree
from coordinator.core.tree_columns import UNKNOWN
from helpers.ids import id_counter


def rows(probs: list[list[float]], first_token: int = 10) -> ProposalRows:
    p = np.asarray(probs, float)
    tokens = first_token + np.arange(p.size).reshape(p.shape)
    return ProposalRows.topk(tokens, np.log(p))


def worked_example() -> Calibration:
    """The module docstring's: 20 verifications at bin [0.3, 0.4), two children each, 19 won by the first."""
    cal = Calibration()
    for i in range(20):
        cal.observe(3, 0 if i < 19 else 1, 2)
    return cal


@pytest.fixture
def no_fade(monkeypatch):
    monkeypatch.setattr(calibration_module, "FADE", 1.0)


def test_the_worked_example(no_fade):
    assert EDGES[2] == 0.3 and EDGES[3] == 0.4        # bin 3 is [0.3, 0.4)
    out = worked_example().table().apply(rows([[0.35, 0.2], [0.95, 0.01]]))
    # (19 + 4 * 0.85) / 24 and (1 + 4 * 0.075) / 24, by hand; a bin not seen yet: the pooled rates
    assert np.exp(out.logps[0]) == pytest.approx([(19 + 4 * (20.4 / 24)) / 24, (1 + 4 * (1.8 / 24)) / 24])
    assert np.exp(out.logps[1, 0]) == pytest.approx((19 + PRIOR * 0.95) / 24)
    assert out.bins.tolist() == [3, 10]
    assert out.tokens is not None and out.tokens.tolist() == [[10, 11], [12, 13]]


def test_with_no_data_the_scores_are_the_drafts_own():
    r = rows([[0.6, 0.3, 0.05], [0.2, 0.1, 0.1]])
    out = Calibration().table().apply(r)
    assert np.allclose(out.logps, r.logps)
    assert out.bins.tolist() == [6, 2]


def test_a_row_stays_best_first_and_padding_stays_out():
    cal = Calibration()
    for _ in range(50):                    # at bin 1 the second child wins every time
        cal.observe(1, 1, 3)
    logps = np.log(np.array([[0.15, 0.1, 0.05], [0.15, 0.1, 0.1]]))
    logps[1, 2] = -np.inf                  # (padding)
    r = ProposalRows(np.array([[5, 6, 7], [8, 9, 0]]), logps, np.array([3, 2]), distinct=True)
    out = cal.table().apply(r)
    assert (np.diff(out.logps[0]) <= 0).all() and (np.diff(out.logps[1, :2]) <= 0).all()
    assert out.logps[1, 2] == -np.inf, "a padding cell never becomes a child"
    assert out.logps[0, 0] == out.logps[0, 1], "the first child is scored as well as the second (best first)"
    assert out.select([1]).bins.tolist() == [1]


def test_what_a_verification_teaches(no_fade):
    cal = Calibration()
    cal.observe(UNKNOWN, 0, 4)             # a node expanded uncalibrated: nothing
    cal.observe(5, 0, 0)                   # no children: nothing
    assert cal.seen.sum() == 0
    cal.observe(5, -1, 2)                  # neither of two children: both ranks seen, none won
    cal.observe(5, 1, 2)
    cal.observe(5, 3, 2)                   # a rank beyond the two children: seen, not a hit
    assert cal.seen[5, :3].tolist() == [3, 3, 0] and cal.hits[5, :4].tolist() == [0, 1, 0, 0]
    assert cal.rates()[5, 1] == pytest.approx(1 / 3) and math.isnan(cal.rates()[4, 0])
    t = cal.table()
    assert cal.table() is t, "the frozen table is made again only after an observation"
    cal.observe(5, 0, RANKS + 4)           # more children than the table keeps
    assert cal.table() is not t and cal.seen[5, RANKS - 1] == 1


def test_the_spine_goes_deep_where_the_draft_is_right_more_often_than_it_says():
    """A draft that proposes its first choice at 0.4 and is right 99% of the time there: by its own
    probabilities the best 4 nodes after the root are the two children and two grandchildren (0.4, 0.35,
    0.16, 0.14); by its measured acceptance the spine, 4 deep."""
    def grow(cal: Calibration | None) -> list[int]:
        tree = TokenTree(0, 1, 0, id_counter(1))
        frontier = [0]
        for _ in range(4):
            props = rows([[0.4, 0.35]] * len(frontier))
            if cal is not None:
                props = cal.table().apply(props)
            new = tree.add_children_many(frontier, props)
            frontier = new.tolist()
        return tree.a.depth[tree.select_rows("best-first", 4)].tolist()
    cal = Calibration()
    for i in range(200):
        cal.observe(4, 0 if i % 100 else 1, 2)      # bin [0.4, 0.5): first child 99%
    assert grow(None) == [1, 1, 2, 2]
    assert grow(cal) == [1, 2, 3, 4]


def test_a_bins_counts_fade_with_its_own_verifications_only():
    """A draft that was right at bin 6 for 1000 verifications and is wrong there from then on: the bin's rate
    follows (FADE 0.999: after 1000 more it is about 1 / (1 + e)); bin 2, not verified meanwhile, keeps its
    counts."""
    cal = Calibration()
    for _ in range(10):
        cal.observe(2, 0, 1)
    for _ in range(1000):
        cal.observe(6, 0, 1)
    assert cal.rates()[6, 0] == pytest.approx(1.0)
    for _ in range(1000):
        cal.observe(6, -1, 1)
    # hits (1 - f^1000) / (1 - f) faded by f^1000, seen (1 - f^2000) / (1 - f): f^1000 / (1 + f^1000)
    f = FADE ** 1000
    assert cal.rates()[6, 0] == pytest.approx(f / (1 + f))
    assert f / (1 + f) == pytest.approx(1 / (1 + math.e), rel=0.01)
    assert cal.seen[2, 0] == pytest.approx(sum(FADE ** k for k in range(10)))
    assert cal.rates()[2, 0] == pytest.approx(1.0)


def test_a_job_rescores_only_the_calibrated_requests():
    cal = worked_example()
    job = DraftJob(calibration=cal.table(), calibrated={"a"})
    got = rows([[0.35, 0.2]])
    assert job._scored("a", got).bins.tolist() == [3]
    assert job._scored("b", got) is got, "a request not calibrated (sampling) keeps the draft's scores"
