"""NgramDraft (coordinator/core/drafts/ngram.py): prompt lookup over the committed text plus a node's path.

Expected proposals are worked out by hand from the module docstring and the DraftSource contract."""
from __future__ import annotations

import math

import pytest

from coordinator.core.drafts.base import DraftNode, DraftSource
from coordinator.core.drafts.ngram import NgramDraft


def last_prompt_node(prompt: list[int]) -> DraftNode:
    """The prompt is committed as nodes 0..n-1; node i has parent i-1 and position i."""
    n = len(prompt) - 1
    return DraftNode(n, n - 1, n, prompt[n])


def propose(prompt: list[int], k: int = 4, **kw) -> list[tuple[int, float]]:
    d = NgramDraft(**kw)
    d.begin("r", prompt)
    (out,) = d.expand("r", [last_prompt_node(prompt)], k)
    return out


def test_is_a_draft_source():
    d = NgramDraft()
    assert isinstance(d, DraftSource) and d.name == "ngram" and d.compute_s == 0.0


def test_docstring_example_prompt_lookup():
    d = NgramDraft()
    d.begin("r", [5, 6, 7, 5, 6])
    assert d.expand("r", [DraftNode(4, 3, 4, 6)], 4) == [[(7, 0.0)]]


def test_trigram_match_wins_over_bigram():
    # [1, 2, 3] was followed by 9; the bigram [2, 3] was followed by 9 and by 8
    assert propose([1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3]) == [(9, 0.0)]


def test_bigram_match_wins_over_unigram():
    # no earlier [6, 1, 2]; [1, 2] was followed by 5; [2] alone was followed by 5 and 6
    assert propose([7, 1, 2, 5, 2, 6, 1, 2]) == [(5, 0.0)]


def test_unigram_fallback():
    assert propose([3, 4, 9, 3]) == [(4, 0.0)]


def test_max_n_limits_the_longest_ngram():
    # with max_n=2 the trigram [1, 2, 3] is never tried: the bigram [2, 3] saw 9 and 8 once each
    out = propose([1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3], max_n=2)
    assert sorted(out) == [(8, pytest.approx(math.log(0.5))), (9, pytest.approx(math.log(0.5)))]


def test_two_continuations_seen_once_each():
    # [1, 2] was followed by 3 and by 4
    out = propose([1, 2, 3, 1, 2, 4, 1, 2], k=4)
    assert len(out) == 2
    assert {t for t, _ in out} == {3, 4}
    assert all(lp == pytest.approx(math.log(0.5)) for _, lp in out)


def test_counts_become_log_probabilities_best_first():
    # [1, 2] was followed by 3 twice and by 4 once
    out = propose([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2], k=4)
    assert [t for t, _ in out] == [3, 4]
    assert out[0][1] == pytest.approx(math.log(2 / 3))
    assert out[1][1] == pytest.approx(math.log(1 / 3))


def test_at_most_k_proposals():
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]
    out = propose(prompt, k=1)
    assert len(out) == 1 and out[0][0] == 3 and out[0][1] == pytest.approx(math.log(2 / 3))
    # three different continuations of [1]; k=2 keeps two of them, each log(1/3)
    out = propose([1, 5, 1, 6, 1, 7, 1], k=2)
    assert len(out) == 2
    assert {t for t, _ in out} <= {5, 6, 7}
    assert all(lp == pytest.approx(math.log(1 / 3)) for _, lp in out)


def test_no_match_is_empty():
    assert propose([1, 2, 3]) == []
    assert propose([4]) == []


def test_window_limits_the_context():
    # the last 3 tokens are [9, 8, 5]: the earlier 5 -> 6 lies outside the window
    assert propose([5, 6, 9, 8, 5]) == [(6, 0.0)]
    assert propose([5, 6, 9, 8, 5], window=3) == []


def test_uncommitted_tree_path_is_context():
    d = NgramDraft()
    d.begin("r", [5, 6, 7, 8])                                     # nothing follows 8 in the prompt
    assert d.expand("r", [DraftNode(3, 2, 3, 8)], 4) == [[]]
    # node 100 (token 5) hangs below the last prompt node 3: context [5, 6, 7, 8, 5]
    assert d.expand("r", [DraftNode(100, 3, 4, 5)], 4) == [[(6, 0.0)]]
    # node 101 (token 6) below 100: context [5, 6, 7, 8, 5, 6]
    assert d.expand("r", [DraftNode(101, 100, 5, 6)], 4) == [[(7, 0.0)]]
    # a sibling of 101 with token 9: context [5, 6, 7, 8, 5, 9] -> nothing after 9
    assert d.expand("r", [DraftNode(102, 100, 5, 9)], 4) == [[]]


def test_several_nodes_in_one_call_parent_earlier_in_the_list():
    d = NgramDraft()
    d.begin("r", [5, 6, 7, 8])
    out = d.expand("r", [DraftNode(3, 2, 3, 8), DraftNode(100, 3, 4, 5), DraftNode(101, 100, 5, 6)], 4)
    assert out == [[], [(6, 0.0)], [(7, 0.0)]]


def test_committed_tokens_become_history():
    d = NgramDraft()
    d.begin("r", [4])
    d.commit("r", [1, 2, 3], [5, 6, 7])                            # history [4, 5, 6, 7]
    # node 10 (token 5) below node 3: context [4, 5, 6, 7, 5] -> 5 was followed by 6
    assert d.expand("r", [DraftNode(10, 3, 4, 5)], 4) == [[(6, 0.0)]]


def test_without_commit_unknown_tokens_are_not_history():
    d = NgramDraft()
    d.begin("r", [4])
    # node 3 was never seen: the context is [4, 5] only
    assert d.expand("r", [DraftNode(10, 3, 4, 5)], 4) == [[]]


def test_committed_path_nodes_are_not_counted_twice():
    d = NgramDraft()
    d.begin("r", [1, 2, 1, 3])
    d.expand("r", [DraftNode(10, 3, 4, 1)], 4)
    d.commit("r", [10], [1])                                       # history [1, 2, 1, 3, 1]
    # node 11 (token 1) below 10: context [1, 2, 1, 3, 1, 1]; [3, 1, 1] and [1, 1] never occurred,
    # [1] was followed by 2, 3 and 1 once each (counting 10's token twice would match [1, 1] -> 1)
    out = d.expand("r", [DraftNode(11, 10, 5, 1)], 4)[0]
    assert sorted(t for t, _ in out) == [1, 2, 3]
    assert all(lp == pytest.approx(math.log(1 / 3)) for _, lp in out)


def test_expand_before_commit_of_the_same_node():
    d = NgramDraft()
    d.begin("r", [1, 2, 1, 3])
    # node 10 (token 1) below 3: context [1, 2, 1, 3, 1]; [3, 1] unseen; [1] followed by 2 and 3
    out = d.expand("r", [DraftNode(10, 3, 4, 1)], 4)[0]
    assert sorted(t for t, _ in out) == [2, 3]
    assert all(lp == pytest.approx(math.log(0.5)) for _, lp in out)


def test_pruned_nodes_leave_the_path():
    prompt = [5, 6, 7, 2, 6, 9, 4]                                 # ids 0..6
    d = NgramDraft()
    d.begin("r", prompt)
    d.expand("r", [DraftNode(100, 6, 7, 5)], 4)
    # control: node 101 (token 6) below 100: context [..., 4, 5, 6]; [5, 6] was followed by 7
    assert d.expand("r", [DraftNode(101, 100, 8, 6)], 4) == [[(7, 0.0)]]
    d.prune("r", [100, 101])
    # 100 is forgotten: node 102's path is [6] only, context [..., 9, 4, 6]; [4, 6] unseen,
    # [6] was followed by 7 and by 9
    out = d.expand("r", [DraftNode(102, 100, 8, 6)], 4)[0]
    assert sorted(t for t, _ in out) == [7, 9]
    assert all(lp == pytest.approx(math.log(0.5)) for _, lp in out)


def test_requests_are_independent():
    d = NgramDraft()
    d.begin("a", [5, 6, 7, 5, 6])
    d.begin("b", [1, 2, 3])
    assert d.expand("b", [DraftNode(2, 1, 2, 3)], 4) == [[]]
    assert d.expand("a", [DraftNode(4, 3, 4, 6)], 4) == [[(7, 0.0)]]


def test_release_forgets_the_request():
    d = NgramDraft()
    d.begin("r", [5, 6, 7, 5, 6])
    d.begin("other", [5, 6, 7, 5, 6])
    d.release("r")
    with pytest.raises(KeyError):
        d.expand("r", [DraftNode(4, 3, 4, 6)], 4)
    with pytest.raises(KeyError):
        d.commit("r", [5], [7])
    d.release("r")                                                 # releasing twice is harmless
    d.release("never-begun")
    assert d.expand("other", [DraftNode(4, 3, 4, 6)], 4) == [[(7, 0.0)]]
    # a request id can start over after release, with a fresh history
    d.begin("r", [1, 2, 3])
    assert d.expand("r", [DraftNode(2, 1, 2, 3)], 4) == [[]]


def test_compute_s_grows_with_each_expand():
    d = NgramDraft()
    d.begin("r", list(range(50)) * 20)
    assert d.compute_s == 0.0
    d.expand("r", [DraftNode(999, 998, 999, 49)], 4)
    first = d.compute_s
    assert first > 0.0
    d.expand("r", [DraftNode(1000, 999, 1000, 0)], 4)
    assert d.compute_s > first
