"""The tree's one-step paths (coordinator/core/tree.py `match_path` / `commit_path`, coordinator/core/tree_grow.py
`add_chained` / `add_grown`): a result's hits and a chained job's rounds, each checked against the step-by-step
path it replaces, on hand-built trees."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.core.drafts.chain import Chain, candidates
from coordinator.core.proposals import ProposalRows
from coordinator.core.tree import TokenTree
from helpers.ids import make_tree


def test_a_chained_round_adds_children_with_the_drafts_ids_and_skips_nodes_no_longer_live():
    """`add_chained` (coordinator/core/tree_grow.py): root 0 -> 1 (-0.1), 2 (-0.2), 3 (-0.3); node 1 expanded
    by a chained round gets children 20 (-0.1 - 0.5) and 21 (-0.1 - 0.2), its best child 21; node 3 was pruned
    by a commit of 2 meanwhile, so its row is dropped; ids at or below a live one are refused."""
    t = make_tree()
    t.add_children(0, [(7, -0.1), (8, -0.2), (9, -0.3)])
    rows = ProposalRows.of([[(30, -0.5), (31, -0.2)], [(32, -0.1)]])
    assert t.add_chained(np.array([1, 3]), rows, np.array([[20, 21], [22, 23]])) == [1, 3]
    assert t.children(1) == [20, 21] and t.children(3) == [22], "a row's padding makes no child"
    assert t.nodes[21].score == pytest.approx(-0.3) and t.nodes[20].parent == 1 and t.nodes[20].depth == 2
    assert t.nodes[1].expanded and not t.nodes[1].asked
    assert t.a.id[t.a.best_row[t.row(1)]] == 21
    t.commit(2)                                    # prunes 1 and 3 with their subtrees
    assert t.add_chained(np.array([3, 1]), rows, np.array([[40, 41], [42, 43]])) == []
    assert t.add_children(2, [(5, -0.1)]) == [4]   # (the counter's next id)
    with pytest.raises(ValueError, match="not above every live id"):
        t.add_chained(np.array([4]), ProposalRows.of([[(6, -0.1)]]), np.array([[4]]))


def _columns(t: TokenTree) -> dict[str, list]:
    a = t.a
    return {c: getattr(a, c).tolist() for c in ("id", "parent", "token", "depth", "score", "injected", "expanded",
                                                "asked", "target_next", "best_row", "conf")}


def test_match_path_follows_the_hits_down_and_commit_path_commits_them_as_single_commits_would():
    """`match_path` (the docstring's example): root 0 -> 1:a, 2:b injected; 1 -> 3:c injected, 4:d not; 3 -> 5:e
    injected. Targets: a after 0, c after 1, nothing known after 3 -> hits 1, 3 (ranks 0, 0; 2 and 1 injected
    of 2 children each). `commit_path([1, 3])` leaves the tree, and reports the prunes, as commit(1) then
    commit(3) do."""
    def grown() -> TokenTree:
        t = make_tree()
        t.add_children(0, [(10, -0.1), (11, -0.5)])          # 1:a=10, 2:b=11
        t.add_children(1, [(12, -0.1), (13, -0.2)])          # 3:c=12, 4:d=13
        t.add_children(3, [(14, -0.1)])                      # 5:e=14
        t.add_children(2, [(15, -0.1)])                      # 6 below b
        for i in (1, 2, 3, 5, 6):
            t.nodes[i].injected = True
        t.set_target_next([0, 1], [10, 12])
        return t
    t = grown()
    hits = t.match_path()
    assert [(h.child, h.token, h.rank, h.injected, h.children) for h in hits] == [(1, 10, 0, 2, 2), (3, 12, 0, 1, 2)]
    pruned = t.commit_path([1, 3])
    one = grown()
    p1, p3 = one.commit(1), one.commit(3)
    assert _columns(t) == _columns(one) and t.root == one.root == 3
    assert sorted(pruned.injected) == sorted(p1.injected + p3.injected) == [2, 6]
    assert sorted(pruned.expanded) == sorted(p1.expanded + p3.expanded) == [2]
    assert t.match_path() == [], "nothing known after 3"
    t.set_target_next([3], [99])
    assert t.match_path() == [], "a miss stops the path (match_root handles it)"
    with pytest.raises(ValueError, match="not a path"):
        grown().commit_path([1, 5])


def _chain_case(prune_first: bool, full: bool = True) -> tuple[TokenTree, TokenTree]:
    """A tree (root 0 -> 1, 2, 3) and a three-round chain from nodes 1 and 2 with frontier 3, its rounds'
    proposals drawn at random (`full` False: rows of one or two children); applied as one growth and round by
    round to two copies (`prune_first`: 2 and 3 pruned by a commit of 1 before the job is applied)."""

    def tree(prune: bool = prune_first) -> TokenTree:
        t = make_tree()
        t.add_children(0, [(10, -0.1), (11, -0.4), (12, -0.9)])     # 1, 2, 3
        t.a.asked[1:4] = True
        if prune:
            t.commit(1)
        return t
    a = tree(prune=False).a
    chain = Chain(3, 2, 2, 100, 50, frozenset(), -1, a.id[1:3], a.depth[1:3], a.score[1:3], -1,
                  candidates(a.id[3:4], a.parent[3:4], a.depth[3:4], a.token[3:4], a.score[3:4], a.injected[3:4]))
    rng = np.random.default_rng(0)
    # round 1: 2's children (-0.41, -0.42) beat the frontier (-0.9) and 1's (-2.1, -3.1), so rounds 2 and 3
    # expand what was made below 2
    nxt = chain.step(ProposalRows.topk(np.array([[20, 21], [22, 23]]), np.array([[-2.0, -3.0], [-0.01, -0.02]])))
    while nxt is not None:
        m = len(chain.ids)
        rows = ProposalRows.topk(rng.integers(20, 90, (m, 2)), np.sort(-rng.random((m, 2)))[:, ::-1])
        if not full:                              # the second child of every other row is padding
            rows = ProposalRows(rows.tokens, rows.logps, np.array([2 - i % 2 for i in range(m)]), distinct=True)
            rows.logps[1::2, 1] = -np.inf
        nxt = chain.step(rows)
    assert chain.done[1].node_ids.tolist() == [102, 103] and chain.done[2].node_ids.tolist() == [104, 105], \
        "rounds 2 and 3 below 2 (104, 105: 102's children)"
    one, by_round = tree(), tree()
    kept, gone = one.add_grown(chain.growth())
    if full:
        assert kept == ([1] if prune_first else [1, 2, 102, 103, 104, 105]) and \
            gone.tolist() == ([102, 103, 104, 105] if prune_first else []), "2 pruned: what the rounds made below it"
    for done in chain.done:
        by_round.add_chained(done.node_ids, done.proposals, done.child_ids)
    return one, by_round


def test_a_chains_rounds_grow_the_tree_in_one_step_as_round_by_round():
    """`add_grown` (coordinator/core/tree_grow.py) against `add_chained` of each round: the same columns, best
    children and bins; with a node the job expanded pruned meanwhile, that node's children and what the rounds
    made below them are skipped by both."""
    one, by_round = _chain_case(prune_first=False)
    assert _columns(one) == _columns(by_round) and one.a.n == 4 + 3 * 4, "three rounds of 2 x 2 children"
    one, by_round = _chain_case(prune_first=True)
    assert _columns(one) == _columns(by_round)
    assert one.root == 1 and one.a.n > 1 and set(one.a.parent.tolist()) <= set(one.a.id.tolist()) | {-1}, \
        "1's rounds went in; nothing hangs below a node not in the tree (2's and 3's)"
    for prune_first in (False, True):             # rows shorter than topk (sampling, n-gram merges): padding
        one, by_round = _chain_case(prune_first, full=False)
        assert _columns(one) == _columns(by_round) and one.a.n < (4 if not prune_first else 1) + 3 * 4


def test_only_a_top_k_says_every_cell_is_a_proposal():
    """`ProposalRows.full` (the hot paths skip the validity mask on it) is True for `topk` rows only: rows made by
    hand or with padding must say False (it once defaulted to a method of the same name, which is truthy)."""
    assert ProposalRows.topk(np.array([[1, 2]]), np.array([[-0.1, -0.2]])).full is True
    assert ProposalRows.of([[(1, -0.1)], []]).full is False
    assert ProposalRows(np.zeros((1, 2), np.int64), np.zeros((1, 2)), np.array([1])).full is False
