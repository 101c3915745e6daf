"""The array tree (coordinator/core/tree.py) against the object tree it replaced (tests/helpers/reference_tree.py):
under random growth (one node or many at once, repeated tokens, tied scores), selection by every policy,
the draft's run-ahead choice, hits, warm restarts and misses, both make the same choices, hand out the same
ids, prune the same nodes and hold the same nodes with the same fields."""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.proposals import ProposalRows
from coordinator.core.tree import TokenTree
from coordinator.core.vocabulary import TREE_POLICIES
from helpers.ids import id_counter
from helpers.reference_tree import TokenTree as ReferenceTree

SCORES = st.sampled_from([0.0, -0.25, -0.5, -1.0, -2.0, -3.5])        # few values: many exact ties
PROPOSALS = st.lists(st.tuples(st.integers(0, 5), SCORES), max_size=4)


def same(t: TokenTree, ref: ReferenceTree) -> None:
    assert t.root == ref.root and sorted(t.nodes) == sorted(ref.nodes)
    for i, r in ref.nodes.items():
        n = t.nodes[i]
        assert (n.parent if i != t.root else -1, n.token, n.depth, n.injected, n.expanded, n.committed) == \
            (r.parent, r.token, r.depth, r.injected, r.expanded, r.committed), i
        assert n.score == r.score and n.children == r.children and n.target_next == r.target_next


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_the_array_tree_matches_the_object_tree(data) -> None:
    depth = data.draw(st.integers(0, 4))
    t = TokenTree(0, 9, depth, id_counter(1))
    ids = itertools.count(1)
    ref = ReferenceTree(0, 9, depth, lambda: next(ids))
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["add", "add_many", "expand", "select", "commit", "reroot", "restart",
                                        "target"]))
        if op == "add":
            parent = data.draw(st.sampled_from(sorted(ref.nodes)))
            props = data.draw(PROPOSALS)
            assert t.add_children(parent, props) == ref.add_children(parent, props)
        elif op == "add_many":                 # what a draft call does: several parents, arrays
            parents = data.draw(st.lists(st.sampled_from(sorted(ref.nodes)), min_size=1, max_size=3))
            rows = [data.draw(PROPOSALS) for _ in parents]
            got = t.add_children_many(parents, ProposalRows.of(rows)).tolist()
            assert got == [i for p, r in zip(parents, rows) for i in ref.add_children(p, r)]
        elif op == "expand":
            count = data.draw(st.integers(0, 5))
            max_depth = data.draw(st.none() | st.integers(depth, depth + 8))
            skip = frozenset(data.draw(st.lists(st.integers(0, 5), max_size=2)))
            lead = data.draw(st.integers(0, 4))
            only = data.draw(st.booleans())
            got = t.to_expand(count, max_depth, skip, spine_lead=lead, injected_only=only).tolist()
            assert got == [n.id for n in ref.to_expand(count, max_depth, skip, spine_lead=lead, injected_only=only)]
        elif op == "select":
            policy = data.draw(st.sampled_from(TREE_POLICIES + ("best-first-one-layer",)))
            width = data.draw(st.integers(0, 5))
            max_depth = data.draw(st.none() | st.integers(depth, depth + 8))
            if policy == "best-first-one-layer":
                assert t.select_best_first(width, max_depth) == ref.select_best_first(width, max_depth)
            else:
                horizon = data.draw(st.integers(1, 5))
                assert t.select(policy, width, max_depth, horizon) == ref.select(policy, width, max_depth, horizon)
        elif op == "commit":
            hits = [c for c in ref.root_node.children if ref.nodes[c].injected]
            if hits:
                child = data.draw(st.sampled_from(hits))
                a, b = t.commit(child), ref.commit(child)
                assert sorted(a.injected) == sorted(b.injected) and sorted(a.expanded) == sorted(b.expanded)
        elif op == "reroot":
            cold = [c for c in ref.root_node.children if not ref.nodes[c].injected]
            if cold:
                child = data.draw(st.sampled_from(cold))
                a, b = t.reroot(child), ref.reroot(child)
                assert sorted(a.injected) == sorted(b.injected) and sorted(a.expanded) == sorted(b.expanded)
        elif op == "restart":
            token = data.draw(st.integers(0, 5))
            (bonus, a), (ref_bonus, b) = t.restart(token), ref.restart(token)
            assert bonus == ref_bonus and sorted(a) == sorted(b)
        else:
            injected = sorted(i for i, n in ref.nodes.items() if n.injected)
            if not injected:
                continue
            node, token = data.draw(st.sampled_from(injected)), data.draw(st.integers(0, 5))
            t.set_target_next([node], [token])
            ref.nodes[node].target_next = token
            assert t.matching_child(node, token) == ref.matching_child(node, token)
            kids = ref.nodes[ref.root].children              # the root's, in the draft's order
            tokens = [ref.nodes[c].token for c in kids]
            assert t.match_root(token) == (ref.matching_child(ref.root, token),
                                           tokens.index(token) if token in tokens else -1,
                                           sum(ref.nodes[c].injected for c in kids))
        same(t, ref)
