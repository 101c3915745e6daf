"""Chained draft rounds (coordinator/core/drafts/chain.py): the draft chooses a job's later rounds as the tree
would, on hand-computed cases."""
from __future__ import annotations

import numpy as np

from coordinator.core.drafts.chain import Chain, candidates
from coordinator.core.proposals import ProposalRows

I64 = np.int64


def chain(rounds: int = 2, width: int = 2, topk: int = 2, frontier=(), tip: int = -1, max_depth: int = 100,
          skip: frozenset[int] = frozenset(), tip_limit: int = -1) -> Chain:
    """Round 1 expands a (id 10, score -0.1) and b (id 11, score -0.5) at depth 5; `frontier`: (id, score,
    injected) at depth 5, parent 1, token 90 + i; reserved ids from 100."""
    f = list(frontier)
    return Chain(rounds, width, topk, 100, max_depth, skip, tip_limit, np.array([10, 11], I64),
                 np.array([5, 5], I64), np.array([-0.1, -0.5]), tip,
                 candidates(np.array([x[0] for x in f], I64), np.ones(len(f), I64), np.full(len(f), 5, I64),
                            np.array([90 + i for i in range(len(f))], I64), np.array([x[1] for x in f], float),
                            np.array([x[2] for x in f], bool)))


def rows(*cells) -> ProposalRows:
    return ProposalRows.topk(np.array([[t for t, _ in r] for r in cells], I64),
                             np.array([[s for _, s in r] for r in cells]))


def test_the_next_round_is_the_best_children_and_frontier_by_score_with_ids_from_the_block():
    """The module docstring's example: a -> x (-0.2), y (-2.0); b -> z (-0.1), w (-3.0); frontier f (-0.9).
    Scores x -0.3, y -2.1, z -0.6, w -3.5: round 2 is [x, z], ids 100 (x, a's first child) and 102 (z)."""
    c = chain(frontier=[(50, -0.9, False)])
    nxt = c.step(rows([(1, -0.2), (2, -2.0)], [(3, -0.1), (4, -3.0)]))
    assert [tuple(n) for n in nxt] == [(100, 10, 6, 1), (102, 11, 6, 3)]     # (id, parent, position, token)
    assert c.done[0].child_ids.tolist() == [[100, 101], [102, 103]]
    np.testing.assert_allclose(c.scores, [-0.3, -0.6])
    assert c.frontier_ids.tolist() == [], "no round after the next: nothing is carried"
    assert c.step(rows([(5, -0.1), (6, -0.2)], [(7, -0.1), (8, -0.2)])) is None, "two rounds: done"
    assert c.done[1].node_ids.tolist() == [100, 102]
    assert c.done[1].child_ids.tolist() == [[104, 105], [106, 107]], "round 2's block: first + (1 * 2 + i) * 2"


def test_a_frontier_node_scoring_higher_than_the_children_is_taken_and_ties_go_to_the_injected_then_shallower():
    c = chain(rounds=3, frontier=[(50, -0.25, False), (51, -0.1 + -0.2, True)])
    nxt = c.step(rows([(1, -0.2), (2, -2.0)], [(3, -0.1), (4, -3.0)]))     # x ties with 51 (injected)
    assert sorted(n.node_id for n in nxt) == [50, 51], "-0.25 first; at -0.3 the injected frontier node wins"
    assert [n.node_id for n in nxt] == [50, 51]
    assert c.frontier_ids.tolist() == [100, 102], "x and z, not taken, are the last round's frontier (width 2)"
    assert c.asked.tolist() == [50, 51], "the tree's frontier as made"
    assert [n.parent_id for n in nxt] == [1, 1] and [n.position for n in nxt] == [5, 5]


def test_eos_and_the_depth_limit_leave_children_unexpanded():
    c = chain(skip=frozenset({1}), max_depth=7)
    nxt = c.step(rows([(1, -0.2), (2, -0.3)], [(3, -0.1), (4, -3.0)]))
    assert [n.token for n in nxt] == [2, 3], "x (EOS) has no children to propose: the next best go"
    c = chain(max_depth=6)
    assert c.step(rows([(1, -0.2), (2, -0.3)], [(3, -0.1), (4, -3.0)])) is None, "depth 6 is the limit"
    # `record` says so before `choose` (a job waits for no round, so a result cannot cut one that would not run)
    assert not chain(max_depth=6).record(rows([(1, -0.2), (2, -0.3)], [(3, -0.1), (4, -3.0)]))
    assert chain(max_depth=6, frontier=[(50, -0.9, False)]).record(
        rows([(1, -0.2), (2, -0.3)], [(3, -0.1), (4, -3.0)])), "the frontier is left to expand"


def test_the_spine_goes_on_through_the_tips_best_child_first_while_within_its_lead():
    """b (index 1) is the spine's tip: its best child w (-3.0 + -0.5) comes first although it scores least."""
    c = chain(tip=1, tip_limit=7)
    nxt = c.step(rows([(1, -0.2), (2, -0.3)], [(4, -3.0), (3, -3.1)]))
    assert sorted(n.token for n in nxt) == [1, 4] and c.tip == [n.token for n in nxt].index(4)
    c = chain(tip=1, tip_limit=6)                  # the child is at depth 6: beyond the lead, no tip
    nxt = c.step(rows([(1, -0.2), (2, -0.3)], [(4, -3.0), (3, -3.1)]))
    assert [n.token for n in nxt] == [1, 2] and c.tip == -1


def test_rows_shorter_than_topk_propose_only_their_cells():
    c = chain(topk=3)
    props = ProposalRows(np.array([[1, 2, 0], [3, 0, 0]], I64), np.array([[-0.2, -0.3, -np.inf], [-0.1, -np.inf,
                         -np.inf]]), np.array([2, 1], I64), distinct=True)
    nxt = c.step(props)
    assert [n.node_id for n in nxt] == [100, 101], "x -0.3, y -0.4 beat z -0.6; ids first + i * 3 + j"
