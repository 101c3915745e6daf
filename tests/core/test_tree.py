"""TokenTree (coordinator/core/tree.py): growth policies, verification (commit / restart), queries.

Expected values are worked out by hand from the module's docstring contract."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.tree import TokenTree
from coordinator.core.tree_columns import NO_ROW, NodeArrays
from coordinator.core.vocabulary import TREE_POLICIES
from helpers.ids import make_tree


def test_docstring_worked_example():
    a, b, c, d, e, x = 10, 11, 12, 13, 14, 15
    t = make_tree(root_id=0, root_depth=4)
    assert t.root == 0 and t.root_node.injected and t.root_node.committed
    assert t.add_children(0, [(a, -0.1), (b, -1.0), (c, -2.0)]) == [1, 2, 3]
    assert [t.nodes[i].depth for i in (1, 2, 3)] == [5, 5, 5]
    assert [t.nodes[i].token for i in (1, 2, 3)] == [a, b, c]
    assert t.select_layer(2) == [1, 2]
    assert t.nodes[1].injected and t.nodes[2].injected and not t.nodes[3].injected
    assert t.add_children(1, [(d, -0.2)]) == [4]
    assert t.add_children(2, [(e, -0.1)]) == [5]
    assert t.nodes[4].score == pytest.approx(-0.3)
    assert t.nodes[5].score == pytest.approx(-1.1)
    assert t.select_layer(2) == [4, 5]
    assert t.nodes[4].depth == 6 and t.nodes[5].depth == 6
    # target_next(0) = b: a hit on 2
    t.root_node.target_next = b
    assert t.matching_child(0, b) == 2
    assert sorted(t.commit(2)) == [1, 4]          # candidate 3 is dropped but not reported
    assert t.root == 2 and t.root_node.committed
    assert set(t.nodes) == {2, 5}
    # target_next(2) = x: a miss
    assert t.matching_child(2, x) is None
    bonus, pruned = t.restart(x)
    assert bonus == 6 and list(pruned) == [5] and pruned.injected == [5] and pruned.expanded == []
    assert t.root == 6 and set(t.nodes) == {6}
    node = t.nodes[6]
    assert node.token == x and node.committed and not node.injected and node.depth == 6


def test_add_children_skips_duplicates_marks_expanded_and_accumulates_scores():
    t = make_tree()
    assert not t.root_node.expanded
    assert t.add_children(0, [(7, -0.5), (7, -0.1), (8, -1.0)]) == [1, 2]
    assert t.root_node.expanded
    assert t.add_children(0, [(8, -0.2), (9, -2.0)]) == [3]     # 8 is already a child of 0
    assert t.root_node.children == [1, 2, 3]
    assert [t.nodes[i].token for i in (1, 2, 3)] == [7, 8, 9]
    assert t.nodes[1].score == pytest.approx(-0.5)              # the first proposal of 7 wins
    assert t.nodes[3].score == pytest.approx(-2.0)
    # the same token under another parent is fine; scores add up along the path
    assert not t.nodes[1].expanded
    assert t.add_children(1, [(7, -0.25), (8, -0.75)]) == [4, 5]
    assert t.nodes[1].expanded
    assert t.nodes[4].score == pytest.approx(-0.75) and t.nodes[4].depth == 2
    assert t.nodes[5].score == pytest.approx(-1.25) and t.nodes[4].parent == 1
    assert t.add_children(4, [(3, -1.0)]) == [6]
    assert t.nodes[6].score == pytest.approx(-1.75) and t.nodes[6].depth == 3
    # an empty proposal list still marks the node expanded
    assert t.add_children(6, []) == [] and t.nodes[6].expanded


def test_add_asked_adds_a_top_k_for_asked_nodes_and_drops_the_rows_of_pruned_ones():
    """A draft job's proposals (`ask`, then `add_asked`): the hot path for a full top-k, the rows of nodes
    pruned meanwhile dropped, committed rows in front (`first`) skipped, and a node that was expanded before
    its ask (`mark_asked` leaves it unmarked) deduplicated as `add_children` does."""
    from coordinator.core.proposals import ProposalRows
    t = make_tree()
    assert t.add_children(0, [(7, -0.5), (8, -1.0)]) == [1, 2]
    t.ask(np.array([1, 2]), root_parent=-1)
    assert t.nodes[1].asked and t.nodes[2].asked
    top = ProposalRows.topk(np.array([[3, 4], [5, 6]]), np.array([[-0.1, -0.2], [-0.3, -0.4]]))
    assert t.add_asked([1, 2], top) == [1, 2]
    assert t.nodes[1].children == [3, 4] and t.nodes[2].children == [5, 6]
    assert t.nodes[1].expanded and not t.nodes[1].asked
    assert t.nodes[6].score == pytest.approx(-1.4) and t.nodes[6].depth == 2
    assert t.nodes[1].target_next is None and t.a.best_row[t.row(1)] == t.row(3)
    # 3, 4 and 5 asked; a hit on 2 prunes 1's subtree (3, 4) while the job runs: only 5's row is kept; the
    # first row belongs to a committed node the draft had not computed (`unseen`)
    t.ask(np.array([t.row(3), t.row(4), t.row(5)]), root_parent=-1)
    t.a.injected[t.row(2)] = True
    t.commit(2)
    rows = ProposalRows.topk(np.array([[9, 8], [1, 2], [3, 4], [5, 6]]), np.zeros((4, 2)))
    assert t.add_asked([3, 4, 5], rows, first=1) == [5]
    assert t.nodes[5].children == [7, 8] and [t.nodes[i].token for i in (7, 8)] == [5, 6]
    # a node expanded before it was asked keeps its children once
    t.mark_asked([5])
    assert not t.nodes[5].asked
    assert t.add_asked([5], ProposalRows.topk(np.array([[5, 1]]), np.array([[-0.5, -0.6]]))) == [5]
    assert [t.nodes[i].token for i in t.nodes[5].children] == [5, 6, 1]


def test_add_asked_uses_the_rows_of_the_ask_only_while_no_row_has_moved():
    """`asked_at` = (`a.layout`, rows) from the ask: used as the nodes' rows while no row has moved since (the
    children land below the right nodes); after a commit moved the rows, the ids are looked up again, so
    stale rows are never used and a node pruned meanwhile is dropped. A new tree (a request id used again)
    never shares a stamp with an old one."""
    from coordinator.core.proposals import ProposalRows
    t = make_tree()
    assert t.add_children(0, [(7, -0.5), (8, -1.0)]) == [1, 2]
    rows = np.array([t.row(1), t.row(2)])
    t.ask(rows, root_parent=-1)
    at = (t.a.layout, rows)
    t.add_children(0, [(9, -2.0)])                          # rows appended at the end: none moves
    assert t.a.layout == at[0]
    top = ProposalRows.topk(np.array([[3, 4], [5, 6]]), np.array([[-0.1, -0.2], [-0.3, -0.4]]))
    assert t.add_asked([1, 2], top, asked_at=at) == [1, 2]
    assert t.nodes[1].children == [4, 5] and t.nodes[2].children == [6, 7]
    assert [t.nodes[i].token for i in (4, 5, 6, 7)] == [3, 4, 5, 6]
    # 4 and 6 asked; a hit on 2 prunes 1's subtree (4 among it) and moves 2's subtree up: rows at the ask
    # would now point at other nodes
    rows = np.array([t.row(4), t.row(6)])
    t.ask(rows, root_parent=-1)
    at = (t.a.layout, rows)
    t.a.injected[t.row(2)] = True
    t.commit(2)
    assert t.a.layout != at[0] and t.row(6) != rows[1]
    assert t.add_asked([4, 6], ProposalRows.topk(np.array([[1, 2], [3, 4]]), np.zeros((2, 2))), asked_at=at) == [6]
    assert [t.nodes[i].token for i in t.nodes[6].children] == [3, 4]
    assert make_tree().a.layout not in (t.a.layout, at[0])


def test_select_layer_takes_only_children_of_the_deepest_injected_layer():
    t = make_tree()
    t.add_children(0, [(1, -0.5), (2, -0.1), (3, -0.3)])          # 1, 2, 3 at depth 1
    assert t.select_layer(2) == [2, 3]                            # root is the deepest layer
    assert [t.nodes[i].injected for i in (1, 2, 3)] == [False, True, True]
    t.add_children(2, [(4, -0.05)])                               # 4: -0.15, depth 2
    t.add_children(3, [(5, -2.0)])                                # 5: -2.3, depth 2
    # candidate 1 (-0.5) beats 5 (-2.3) but sits at depth 1, not below the deepest layer
    assert t.select_layer(1) == [4]
    assert not t.nodes[1].injected and not t.nodes[5].injected
    # now the deepest injected layer is depth 2 (node 4), which has no children: nothing at all
    assert t.select_layer(5) == []
    assert not t.nodes[1].injected and not t.nodes[5].injected
    t.add_children(4, [(6, -1.0), (7, -0.5), (8, -3.0)])        # 6: -1.15, 7: -0.65, 8: -3.15
    assert t.select_layer(2) == [6, 7]                            # parents-before-children order, by id
    assert t.nodes[6].injected and t.nodes[7].injected and not t.nodes[8].injected


def test_select_layer_returns_sorted_ids_when_better_scores_have_higher_ids():
    t = make_tree()
    t.add_children(0, [(1, -3.0), (2, -2.0), (3, -1.0)])
    assert t.select_layer(2) == [2, 3]


def test_select_best_first_any_depth_but_only_with_injected_parent():
    t = make_tree()
    t.add_children(0, [(1, -1.0), (2, -0.1)])                     # 1: -1.0, 2: -0.1
    assert t.select_best_first(1) == [2]
    t.add_children(2, [(3, -0.1)])                                # 3: -0.2 at depth 2
    assert t.select_best_first(1) == [3]                          # deeper, better than 1
    t.add_children(1, [(4, 0.0)])                                 # 4: -1.0, parent 1 not injected
    t.add_children(3, [(5, -5.0)])                                # 5: -5.2, parent 3 injected
    assert t.select_best_first(2) == [1, 5]                       # 4 outscores 5 but is not eligible
    assert not t.nodes[4].injected
    assert t.select_best_first(5) == [4]                          # its parent is injected now
    assert t.select_best_first(5) == []


def test_select_best_first_orders_parents_before_children():
    t = make_tree()
    t.add_children(0, [(1, -0.1), (2, -3.0)])
    assert t.select_best_first(1) == [1]
    t.add_children(1, [(3, -0.1)])                                # 3: -0.2 at depth 2, beats 2 (-3.0)
    assert t.select_best_first(2) == [2, 3]                       # shallower first


def test_max_depth_limits_both_policies():
    t = make_tree(root_depth=4)
    t.add_children(0, [(1, -0.1), (2, -0.2)])                     # depth 5
    assert t.select_layer(2, max_depth=4) == []
    assert t.select_best_first(2, max_depth=4) == []
    assert not t.nodes[1].injected and not t.nodes[2].injected
    assert t.select_layer(1, max_depth=5) == [1]
    t.add_children(1, [(3, 0.0)])                                 # 3: -0.1 at depth 6, beats 2
    assert t.select_best_first(5, max_depth=5) == [2]
    assert not t.nodes[3].injected
    assert t.select("layer", 5, max_depth=5) == []
    assert t.select("best-first", 5, max_depth=6) == [3]


def test_select_dispatches_on_policy():
    assert TREE_POLICIES == ("layer", "best-first", "hybrid")

    def setup() -> TokenTree:
        t = make_tree()
        t.add_children(0, [(1, -0.1), (2, -2.0)])
        t.select_layer(1)                                         # injects 1
        t.add_children(1, [(3, -0.1)])                            # 3: -0.2 at depth 2
        return t

    assert setup().select("layer", 1) == [3]                      # deepest layer is depth 1
    t = setup()
    assert t.select("best-first", 2) == [2, 3]
    t = setup()
    with pytest.raises(ValueError):
        t.select("greedy", 2)
    assert not t.nodes[2].injected and not t.nodes[3].injected


def test_matching_child_only_matches_injected_children():
    t = make_tree()
    t.add_children(0, [(7, -0.1), (8, -0.2)])
    assert t.matching_child(0, 7) is None                         # not injected yet
    t.select_layer(1)                                             # injects 1 (token 7)
    assert t.matching_child(0, 7) == 1
    assert t.matching_child(0, 8) is None                         # 2 is still a candidate
    assert t.matching_child(0, 9) is None
    t.add_children(1, [(8, -0.1)])
    t.select_layer(1)                                             # injects 3 (token 8 under 1)
    assert t.matching_child(0, 8) is None                         # a grandchild is not a child
    assert t.matching_child(1, 8) == 3


def build_commit_tree() -> TokenTree:
    t = make_tree(root_depth=2)
    t.add_children(0, [(10, -0.1), (11, -0.2), (12, -3.0)])       # 1, 2 injected; 3 candidate
    assert t.select_layer(2) == [1, 2]
    t.add_children(2, [(20, -0.1), (21, -5.0)])                   # 4: -0.3, 5: -5.2
    t.add_children(1, [(22, -1.0)])                               # 6: -1.1
    assert t.select_layer(2) == [4, 6]                            # 5 stays a candidate
    t.add_children(4, [(23, -0.1)])                               # 7: -0.4
    assert t.select_layer(1) == [7]
    t.add_children(6, [(24, -0.1)])                               # 8: candidate below 6
    return t


def test_commit_returns_injected_nodes_of_sibling_subtrees():
    t = build_commit_tree()
    with pytest.raises(ValueError):
        t.commit(4)                                               # a grandchild, not a child
    with pytest.raises(ValueError):
        t.commit(0)                                               # the root itself
    assert t.root == 0 and len(t.nodes) == 9                      # nothing changed
    pruned = t.commit(1)
    assert sorted(pruned) == [2, 4, 7]                            # not candidates 3, 5; not root 0
    assert t.root == 1 and set(t.nodes) == {1, 6, 8}
    root = t.root_node
    assert root.committed and root.injected and root.depth == 3 and root.token == 10
    assert t.path_tokens(8) == [22, 24]
    assert t.live_injected() == [6]
    with pytest.raises(ValueError):
        t.commit(8)
    assert list(t.commit(6)) == []
    assert t.root == 6 and set(t.nodes) == {6, 8} and t.nodes[6].committed


def test_restart_prunes_everything_and_adds_a_bonus():
    t = build_commit_tree()                                       # ids 1..8 used
    bonus, pruned = t.restart(99)
    assert bonus == 9
    assert sorted(pruned) == [1, 2, 4, 6, 7]
    assert t.root == 9 and set(t.nodes) == {9}
    node = t.nodes[9]
    assert node.token == 99 and node.depth == 3 and node.committed and not node.injected
    assert node.children == []
    assert t.path_tokens(9) == [] and t.live_injected() == []


def test_restart_with_no_children_prunes_nothing():
    t = make_tree(root_id=5, root_depth=7)
    bonus, pruned = t.restart(3)
    assert (bonus, list(pruned)) == (6, [])
    assert t.root == 6 and t.nodes[6].depth == 8


def test_a_root_alone_restarts_and_verifies_on_its_fast_paths_as_on_the_columns():
    """A plain request's tree is its root alone: restart writes the bonus in place (NodeArrays.reset), a
    single target token and the root's segment row skip the column lookups. The tree after two such steps is
    the one the general paths give: the bonus's target token is unknown and it can grow children again."""
    t = make_tree(root_id=5, root_depth=7)
    t.set_target_next([5], [42])
    assert t.matching_child(5, 42) is None and t.root_node.target_next == 42
    assert t.segment_rows([5], root_parent=4) == ([4], [7], [t.nodes[5].token])
    bonus, pruned = t.restart(42)
    assert (bonus, list(pruned)) == (6, []) and t.root == 6
    assert t.segment_rows([6], root_parent=5) == ([5], [8], [42]) and t.root_node.target_next is None
    t.set_target_next([5], [1])                                   # an id no longer live: skipped
    assert t.root_node.target_next is None and t.a.where_one(5) == -1 and t.a.where_one(6) == 0
    t.add_children(6, [(7, -0.1), (8, -0.2)])
    t.set_target_next([6], [8])
    assert set(t.nodes) == {6, 7, 8} and t.nodes[7].parent == 6 and t.root_node.target_next == 8


def test_path_tokens_and_live_injected():
    t = make_tree(root_depth=10)
    assert t.path_tokens(0) == [] and t.live_injected() == []
    t.add_children(0, [(7, -0.1), (8, -0.2)])
    t.add_children(1, [(9, -0.1)])
    t.add_children(3, [(4, -0.1)])
    assert t.path_tokens(1) == [7]
    assert t.path_tokens(4) == [7, 9, 4]
    assert t.path_tokens(2) == [8]
    assert t.live_injected() == []                                # candidates only
    t.select_layer(1)                                             # 1
    t.select_layer(1)                                             # 3
    assert sorted(t.live_injected()) == [1, 3]                    # root (committed) excluded


# -- property test --------------------------------------------------------------------------------
OPS = st.sampled_from(["add", "select", "commit", "restart"])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_operations_keep_invariants(data):
    t = make_tree(root_depth=data.draw(st.integers(0, 5)))
    ever_pruned: set[int] = set()
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(OPS)
        injected_before = {i for i, n in t.nodes.items() if n.injected}
        computed_before = {i for i, n in t.nodes.items() if n.injected or n.expanded}
        old_root = t.root
        pruned = None
        if op == "add":
            parent = data.draw(st.sampled_from(sorted(t.nodes)))
            props = data.draw(st.lists(st.tuples(st.integers(0, 4), st.floats(-5.0, 0.0)), max_size=4))
            t.add_children(parent, props)
        elif op == "select":
            if not t.root_node.injected:                          # the scheduler injects a bonus first
                t.root_node.injected = True
            policy = data.draw(st.sampled_from(TREE_POLICIES))
            width = data.draw(st.integers(0, 4))
            max_depth = data.draw(st.none() | st.integers(t.root_node.depth, t.root_node.depth + 6))
            chosen = t.select(policy, width, max_depth)
            assert len(chosen) <= width
            assert all(i not in injected_before and t.nodes[i].injected for i in chosen)
        elif op == "commit":
            hits = [c for c in t.root_node.children if t.nodes[c].injected]
            if not hits:
                continue
            pruned = t.commit(data.draw(st.sampled_from(hits)))
        else:
            bonus, pruned = t.restart(data.draw(st.integers(0, 4)))
            assert set(t.nodes) == {bonus} and t.root == bonus and bonus not in ever_pruned
        if pruned is not None:
            assert len(pruned) == len(set(pruned))
            assert not set(pruned) & set(t.nodes)
            assert not set(pruned) & ever_pruned
            # exactly the computed (injected or draft-expanded) nodes that left the tree, except the old root
            assert set(pruned) == computed_before - set(t.nodes) - {old_root}
            ever_pruned |= set(pruned)
        assert t.root in t.nodes and t.root_node.committed
        for i, n in t.nodes.items():
            assert n.id == i
            assert all(c in t.nodes and t.nodes[c].parent == i for c in n.children)
            if i == t.root:
                continue
            assert n.parent in t.nodes and i in t.nodes[n.parent].children
            assert n.depth == t.nodes[n.parent].depth + 1
            if n.injected:
                assert t.nodes[n.parent].injected
            assert not n.committed
        for i, n in t.nodes.items():      # best_row: the row of the child best by (score, -id), through moves
            best = int(t.a.best_row[t.row(i)])
            if n.children:
                assert int(t.a.id[best]) == max(n.children, key=lambda c: (t.nodes[c].score, -c))
            else:
                assert best == NO_ROW


def test_hybrid_takes_the_spine_to_the_horizon_then_fills_best_first() -> None:
    """Root 0 (depth 0). Layer 1: a (-0.1) injected, b (-0.5), e (-0.6) candidates. a's child c (-3.0) is
    the spine; best-first alone takes b and e first and does not deepen, hybrid takes c first."""
    def setup():
        t = make_tree()
        a, b, e = t.add_children(0, [(10, -0.1), (11, -0.5), (12, -0.6)])
        assert t.select_layer(1) == [a]
        (c,) = t.add_children(a, [(13, -2.9)])                    # cumulative -3.0 at depth 2
        return t, b, c, e
    t, b, c, e = setup()
    assert t.select("best-first", 2) == [b, e]                      # control: best-first stays shallow
    t, b, c, e = setup()
    assert t.select("hybrid", 2, horizon=4) == [b, c]               # the spine (c) plus the best other (b)
    assert t.nodes[c].injected and t.nodes[b].injected and not t.nodes[e].injected
    t, b, c, e = setup()
    assert t.select("hybrid", 2, horizon=1) == [b, e]               # c is beyond a horizon of 1 layer


def test_select_ahead_takes_a_node_and_its_expanded_descendants_in_one_call() -> None:
    """The docstring's example: 3 rides with its parent 1 because the draft expanded 1 before it went in."""
    t = make_tree()
    one, two = t.add_children(0, [(10, -0.1), (11, -0.5)])
    (three,) = t.add_children(one, [(12, -0.2)])                   # 1 expanded ahead of injection
    assert t.select_best_first(3) == [one, two]                      # one layer: 3 not eligible
    t = make_tree()
    one, two = t.add_children(0, [(10, -0.1), (11, -0.5)])
    (three,) = t.add_children(one, [(12, -0.2)])
    assert t.select_ahead(3) == [one, two, three]                    # depth order: parents first
    assert t.lead() == 2
    assert t.select_ahead(3) == []                                   # nothing left to take


def test_select_ahead_puts_an_uninjected_root_first_and_respects_max_depth() -> None:
    t = make_tree(root_depth=4)
    t.root_node.injected = False                                     # a bonus waiting to go in
    a, b = t.add_children(0, [(10, -0.1), (11, -0.2)])
    (c,) = t.add_children(a, [(12, -0.1)])
    assert t.select_ahead(1) == [0]                                  # the root even at width 1
    t = make_tree(root_depth=4)
    t.root_node.injected = False
    a, b = t.add_children(0, [(10, -0.1), (11, -0.2)])
    (c,) = t.add_children(a, [(12, -0.1)])
    assert t.select_ahead(10, max_depth=5) == [0, a, b]              # c (depth 6) is past max_depth


def test_to_expand_ranks_by_score_skips_eos_and_the_last_position() -> None:
    t = make_tree(root_depth=0)
    t.root_node.expanded = True
    a, b, eos = t.add_children(0, [(10, -0.1), (11, -0.9), (2, -0.05)])
    (c,) = t.add_children(a, [(12, -0.3)])                          # -0.4, depth 2
    assert t.nodes[a].expanded and not t.nodes[b].expanded
    assert t.to_expand(1, skip=frozenset({2})).tolist() == [c]      # -0.4 beats b's -0.9
    assert t.to_expand(2, skip=frozenset({2})).tolist() == [b, c]   # returned parents first
    assert eos in t.to_expand(1).tolist()                           # without skip, EOS is best
    assert set(t.to_expand(5, max_depth=2, skip=frozenset({2})).tolist()) == {b}   # c's children past the end


def test_to_expand_puts_the_spine_tip_first_within_the_horizon() -> None:
    """Siblings near the root outscore the spine's tip; hybrid's run-ahead still deepens the spine."""
    t = make_tree(root_depth=0)
    t.root_node.expanded = True
    a, b, e = t.add_children(0, [(10, -1.0), (11, -1.1), (12, -1.2)])
    (c,) = t.add_children(a, [(13, -1.0)])                          # spine tip c at -2.0
    assert t.to_expand(1).tolist() == [b]                     # by score alone
    assert t.to_expand(1, spine_lead=4).tolist() == [c]       # the spine first
    assert t.to_expand(1, spine_lead=2).tolist() == [b]       # c is 2 layers down: past a lead of 2
    assert t.to_expand(2, spine_lead=4).tolist() == [b, c]


def test_reroot_keeps_the_expanded_subtree_of_a_proposed_child() -> None:
    """Warm restart: the target's token is child b, proposed but not injected; b and its expanded subtree
    stay, everything else is pruned (injected nodes for the stages, expanded ones for the draft)."""
    t = make_tree(root_depth=3)
    t.root_node.expanded = True
    a, b = t.add_children(0, [(10, -0.1), (11, -0.5)])
    assert t.select_layer(1) == [a]
    t.nodes[a].expanded = True
    (a1,) = t.add_children(a, [(12, -0.1)])
    (b1, b2) = t.add_children(b, [(13, -0.1), (14, -0.2)])           # b expanded ahead of injection
    with pytest.raises(ValueError):
        t.reroot(a)                                                  # injected: that is a hit, not a miss
    pruned = t.reroot(b)
    assert t.root == b and t.root_node.committed and not t.root_node.injected and t.root_node.depth == 4
    assert set(t.nodes) == {b, b1, b2}
    assert pruned.injected == [a] and pruned.expanded == [a] and a1 not in list(pruned)


def test_the_id_lookup_answers_every_id_through_appends_keeps_growth_and_reset():
    """NodeArrays.where / where_one against a dict of the live ids, for ids below the first live one, inside
    the span (live and removed), past the last, and far outside: -1 wherever an id is not live, through a
    keep, a growth of the table past its capacity, and a reset."""
    a = NodeArrays(capacity=4)
    live: dict[int, int] = {}

    def check() -> None:
        probe = np.arange(-3, 60)
        want = np.array([live.get(int(i), -1) for i in probe])
        assert a.where(probe).tolist() == want.tolist()
        assert [a.where_one(int(i)) for i in probe] == want.tolist()
        assert a.where(np.array([-10**12, 10**12])).tolist() == [-1, -1]

    def append(ids: list[int]) -> None:
        n = a.n
        z = np.zeros(len(ids))
        a.append(np.array(ids), z.astype(np.int64), z.astype(np.int64), z.astype(np.int64), z)
        live.update({i: n + k for k, i in enumerate(ids)})

    check()                                   # empty: nothing is live
    append([10, 11, 12])
    check()
    append([15, 16])                          # a gap (13, 14 never made)
    check()
    a.keep(np.array([1, 3]))                  # 11 and 15 stay, as rows 0 and 1
    live = {11: 0, 15: 1}
    check()
    append(list(range(20, 50)))               # grows the table past its capacity
    check()
    a.reset(55, token=1, depth=3)
    live = {55: 0}
    check()
