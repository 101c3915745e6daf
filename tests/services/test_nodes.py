"""Unit tests for services/nodes.py (NodeTable) and services/kv_cache.py (RequestKV, KVCache)."""
from __future__ import annotations

import pytest
import torch

from services.kv_cache import CacheGeometry, KVCache, KVExhausted, RequestKV, slots_allocated
from services.nodes import Admit, NodeTable, ProtocolError

OK, DROP = Admit.OK, Admit.DROP


def geometry(initial_slots: int = 2) -> CacheGeometry:
    return CacheGeometry(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32,
                         device=torch.device("cpu"), initial_slots=initial_slots)


def chain(t: NodeTable, n: int) -> None:
    """Admit nodes 0..n-1 as a chain rooted at 0."""
    for i in range(n):
        assert t.admit(i, i - 1, i) is OK


# -- NodeTable: admission and control ---------------------------------------------------------------
def test_chain_admission() -> None:
    t = NodeTable()
    chain(t, 3)
    assert set(t.nodes) == {0, 1, 2}
    assert [t.nodes[i].parent for i in range(3)] == [-1, 0, 1]
    assert t.nodes[0].children == [1] and t.nodes[1].children == [2] and t.nodes[2].children == []
    assert (t.live_count, t.committed_count, t.tip_position) == (3, 0, -1)


def test_commit_held_nodes_moves_tip() -> None:
    t = NodeTable()
    chain(t, 3)
    t.commit([0, 1])
    assert (t.committed_count, t.live_count, t.tip_position) == (2, 1, 1)


def test_pending_commit_takes_effect_when_row_arrives() -> None:
    t = NodeTable()
    t.commit([0, 1])                       # before any row
    assert t.pending_commit == {0, 1} and t.nodes == {} and t.tip_position == -1
    assert t.admit(0, -1, 0) is OK
    assert t.nodes[0].committed and t.tip_position == 0 and t.pending_commit == {1}
    assert t.admit(1, 0, 1) is OK
    assert t.nodes[1].committed and t.tip_position == 1 and t.pending_commit == set()
    assert t.committed_count == 2


def test_prune_cascades_and_remembers_tombstones() -> None:
    t = NodeTable()
    chain(t, 1)                            # 0
    t.commit([0])
    assert t.admit(1, 0, 1) is OK          # 0 -> 1 -> {2, 3}, 0 -> 4
    assert t.admit(2, 1, 2) is OK
    assert t.admit(3, 1, 2) is OK
    assert t.admit(4, 0, 1) is OK
    assert sorted(t.prune([1])) == [1, 2, 3]
    assert set(t.nodes) == {0, 4}
    assert t.nodes[0].children == [4]
    assert t.tombstones == {1, 2, 3}
    assert t.prune([1, 2]) == []           # idempotent
    # a late row under a pruned node is dropped and itself tombstoned
    assert t.admit(5, 2, 3) is DROP
    assert 5 in t.tombstones and 5 not in t.nodes
    assert t.admit(6, 5, 4) is DROP        # ... and so is its child
    assert 6 in t.tombstones


def test_prune_before_row_arrives() -> None:
    t = NodeTable()
    chain(t, 1)
    assert t.prune([7]) == []
    assert t.tombstones == {7}
    assert t.admit(7, 0, 1) is DROP
    assert 7 not in t.nodes and t.nodes[0].children == []


def test_pruned_row_arriving_again_is_dropped() -> None:
    t = NodeTable()
    chain(t, 2)
    assert t.prune([1]) == [1]
    assert t.admit(1, 0, 1) is DROP


def test_prune_cancels_pending_commit() -> None:
    t = NodeTable()
    t.commit([3])
    t.prune([3])
    assert t.pending_commit == set() and 3 in t.tombstones


def test_worked_example_from_docstring() -> None:
    t = NodeTable()
    chain(t, 3)                            # 0 -> 1 -> 2
    assert t.admit(3, 1, 2) is OK          # 1 -> 3
    t.commit([0, 1])
    assert t.tip_position == 1
    t.commit([2])
    assert t.tip_position == 2
    assert t.admit(4, 3, 3) is DROP        # 3's anchor is 1, below the tip
    assert 4 in t.tombstones
    assert t.prune([3]) == [3]
    assert t.tombstones == {3, 4}


def test_sibling_of_committed_node_dropped_on_arrival() -> None:
    t = NodeTable()
    chain(t, 3)
    t.commit([0, 1, 2])
    assert t.admit(5, 1, 2) is DROP        # sibling of committed 2
    assert 5 in t.tombstones
    assert t.admit(6, 0, 1) is DROP        # sibling of committed 1
    assert t.admit(7, 2, 3) is OK          # child of the tip


def test_sibling_admitted_before_pending_commit_arrives_then_its_child_dropped() -> None:
    t = NodeTable()
    chain(t, 2)
    t.commit([0, 1, 2])                    # 2 is pending
    assert t.admit(3, 1, 2) is OK          # tip is still 1 (2 not held yet)
    assert t.admit(2, 1, 2) is OK
    assert t.nodes[2].committed and t.tip_position == 2
    assert t.admit(4, 3, 3) is DROP
    assert t.admit(8, 2, 3) is OK


@pytest.mark.parametrize("rows, bad, match", [
    ([], (1, 99, 1), "unknown parent"),
    ([(0, -1, 0)], (1, 99, 1), "unknown parent"),
    ([(0, -1, 0)], (0, -1, 0), "already held"),
    ([(0, -1, 0), (1, 0, 1)], (1, 0, 1), "already held"),
    ([(0, -1, 0)], (1, 0, 2), "position"),
    ([(0, -1, 0)], (1, 0, 0), "position"),
    ([(0, -1, 0)], (1, -1, 0), "second root"),
    ([], (0, -1, 1), "position 0"),
    ([], (-2, -1, 0), "negative"),
    ([(0, -1, 0)], (-1, 0, 1), "negative"),
])
def test_admit_protocol_errors(rows: list[tuple[int, int, int]], bad: tuple[int, int, int], match: str) -> None:
    t = NodeTable()
    for r in rows:
        assert t.admit(*r) is OK
    with pytest.raises(ProtocolError, match=match):
        t.admit(*bad)


def test_commit_of_pruned_node_is_error() -> None:
    t = NodeTable()
    chain(t, 2)
    t.prune([1])
    with pytest.raises(ProtocolError, match="pruned"):
        t.commit([1])
    t.prune([9])                           # never held
    with pytest.raises(ProtocolError, match="pruned"):
        t.commit([9])


def test_prune_of_committed_node_is_error() -> None:
    t = NodeTable()
    chain(t, 2)
    t.commit([0])
    with pytest.raises(ProtocolError, match="committed"):
        t.prune([0])
    assert set(t.nodes) == {0, 1}


def test_a_control_message_that_commits_and_prunes_one_node_is_refused_held_or_not() -> None:
    """commit then prune in one message: a node it commits may not die by its prune, whether the table holds
    it (1) or only expects it (9, not arrived: the prune would silently cancel the commit); nothing changes."""
    t = NodeTable()
    chain(t, 2)
    t.commit([0])
    for commit, prune in (([1], [1]), ([9], [9]), ([1], [1, 5])):
        with pytest.raises(ProtocolError, match="committed"):
            t.check_control(commit, prune)
    assert t.check_control([9], [1]) == [1], "a node and another's prune go together"
    assert set(t.nodes) == {0, 1} and not t.pending_commit and not t.listed


def test_protocol_error_is_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


def test_visible_on_hand_built_tree() -> None:
    # 0[0]c -> 1[1]c -> 2[2] -> 3[3];  1 -> 4[2];  3 -> 5[4]
    t = NodeTable()
    for row in [(0, -1, 0), (1, 0, 1), (2, 1, 2), (3, 2, 3), (4, 1, 2), (5, 3, 4)]:
        assert t.admit(*row) is OK
    assert t.visible(5) == (-1, [5, 3, 2, 1, 0])
    t.commit([0, 1])
    assert t.visible(0) == (0, [])
    assert t.visible(1) == (1, [])
    assert t.visible(2) == (1, [2])
    assert t.visible(3) == (1, [3, 2])
    assert t.visible(5) == (1, [5, 3, 2])
    assert t.visible(4) == (1, [4])
    t.commit([2])
    assert t.visible(5) == (2, [5, 3])
    assert t.visible(4) == (1, [4])


# -- RequestKV --------------------------------------------------------------------------------------
def build_tree() -> RequestKV:
    """0[0]c -> 1[1]c -> 2[2] -> 3[3];  1 -> 4[2]; slots 0..4 in admission order."""
    r = RequestKV(geometry())
    for node, parent, pos in [(0, -1, 0), (1, 0, 1), (2, 1, 2), (3, 2, 3), (4, 1, 2)]:
        assert r.admit(node, parent, pos) == node
    r.commit([0, 1])
    return r


def mask(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "x" for c in row] for row in rows])


def test_attention_mask_hand_computed() -> None:
    r = build_tree()
    got = r.attention_mask([0, 1, 2, 3, 4])
    assert got.dtype == torch.bool
    assert torch.equal(got, mask(["x....",
                                  "xx...",
                                  "xxx..",
                                  "xxxx.",
                                  "xx..x"]))


def test_attention_mask_after_commit_excludes_committed_beyond_anchor() -> None:
    r = build_tree()
    r.commit([2])
    assert r.committed.tolist()[:5] == [True, True, True, False, False]
    assert torch.equal(r.attention_mask([3, 4, 2]), mask(["xxxx.", "xx..x", "xxx.."]))


def test_attention_mask_without_committed_nodes() -> None:
    r = RequestKV(geometry())
    for node, parent, pos in [(0, -1, 0), (1, 0, 1), (2, 0, 1)]:
        r.admit(node, parent, pos)
    assert torch.equal(r.attention_mask([2, 1, 0]), mask(["x.x", "xx.", "x.."]))


def test_pending_commit_row_gets_committed_slot() -> None:
    r = RequestKV(geometry())
    r.commit([0])
    assert r.admit(0, -1, 0) == 0
    assert r.committed.tolist()[0] is True
    assert r.admit(1, 0, 1) == 1
    assert torch.equal(r.attention_mask([1]), mask(["xx"]))


def test_dropped_row_gets_no_slot() -> None:
    r = build_tree()
    r.prune([4])
    assert r.admit(9, 4, 3) is None
    assert 9 not in r.slot_of


def test_prune_frees_slots_and_they_are_reused() -> None:
    r = build_tree()
    assert r.high_water == 5
    assert r.prune([2]) == 2               # frees nodes 2 and 3 (slots 2, 3)
    assert set(r.slot_of) == {0, 1, 4}
    assert r.slot_position.tolist()[:5] == [0, 1, -1, -1, 2]
    assert torch.equal(r.attention_mask([4]), mask(["xx..x"]))
    s6 = r.admit(6, 4, 3)
    s7 = r.admit(7, 6, 4)
    assert {s6, s7} == {2, 3}
    assert r.high_water == 5
    assert r.slot_position[s6].item() == 3 and r.slot_position[s7].item() == 4
    expected = torch.zeros(5, dtype=torch.bool)
    expected[[0, 1, 4, s6, s7]] = True
    assert torch.equal(r.attention_mask([7])[0], expected)
    assert r.admit(8, 7, 5) == 5           # free list empty: a fresh slot


def test_capacity_grows_and_kv_survives() -> None:
    r = RequestKV(geometry(initial_slots=2))
    assert r.capacity == 0 and r.nbytes() == 0, "nothing is allocated before the first row"
    r.admit(0, -1, 0)
    assert r.capacity == 2 and r.nbytes() == 2 * 2 * 1 * 2 * 4
    r.admit(1, 0, 1)
    r.commit([0])
    r.k[0][0] = torch.tensor([[1.0, 2.0]])
    r.k[0][1] = torch.tensor([[3.0, 4.0]])
    r.v[0][0] = torch.tensor([[-1.0, -2.0]])
    r.v[0][1] = torch.tensor([[-3.0, -4.0]])
    assert r.admit(2, 1, 2) == 2           # third slot: grows to 4
    assert r.capacity == 4 and r.nbytes() == 2 * 4 * 1 * 2 * 4
    assert r.k[0].shape == (4, 1, 2) and r.v[0].shape == (4, 1, 2)
    assert r.k[0][:2].flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert r.v[0][:2].flatten().tolist() == [-1.0, -2.0, -3.0, -4.0]
    assert r.slot_position.tolist() == [0, 1, 2, -1]
    assert r.committed.tolist() == [True, False, False, False]
    for i in range(3, 9):
        assert r.admit(i, i - 1, i) == i
    assert r.capacity == 16
    assert r.k[0][:2].flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert torch.equal(r.attention_mask([8])[0], torch.tensor([True] * 9))


# -- KVCache ----------------------------------------------------------------------------------------
def test_kvcache_get_create_release() -> None:
    c = KVCache(geometry())
    assert c.get("a", create=False) is None
    a = c.get("a", create=True)
    assert isinstance(a, RequestKV)
    assert c.get("a", create=False) is a and c.get("a", create=True) is a
    assert c.nbytes() == 0
    a.admit(0, -1, 0)
    assert c.nbytes() == 32 == a.nbytes()        # 2 slots x (K + V) x 2 floats x 4 bytes
    assert c.release("a") is True
    assert c.get("a", create=True) is None
    assert c.get("a", create=False) is None
    assert "a" not in c.requests and c.nbytes() == 0


def test_kvcache_release_unknown_still_blocks_late_rows() -> None:
    c = KVCache(geometry())
    assert c.release("ghost") is False
    assert c.get("ghost", create=True) is None


def test_kvcache_released_memory_is_bounded() -> None:
    c = KVCache(geometry(), released_memory=2)
    for rid in ["a", "b", "c"]:
        c.get(rid, create=True)
        c.release(rid)
    assert c.get("a", create=True) is not None   # forgotten: oldest beyond the memory
    assert c.get("b", create=True) is None
    assert c.get("c", create=True) is None


# -- KV limit ---------------------------------------------------------------------------------------
def test_kv_limit_counts_every_request_and_refuses_growth_beyond_it() -> None:
    g = geometry(initial_slots=2)
    assert g.bytes_per_slot == 16                   # K + V, 1 layer, 1 head, 2 floats
    c = KVCache(g, limit_bytes=96)                  # 6 slots for all requests together
    a, b = c.get("a", create=True), c.get("b", create=True)
    for i in range(4):                              # a: 2 slots, then grows to 4
        a.admit(i, i - 1, i)
    b.admit(0, -1, 0)                               # b: 2 slots
    assert c.nbytes() == 96 == a.nbytes() + b.nbytes()
    b.admit(1, 0, 1)                                # fits in b's 2 slots
    with pytest.raises(KVExhausted, match="limit"):
        b.admit(2, 1, 2)                            # b would grow to 4 slots: 128 bytes > 96
    assert KVExhausted.code == 8                    # answered as RESOURCE_EXHAUSTED
    assert c.nbytes() == 96
    c.release("a")
    assert c.nbytes() == 32
    c2 = c.get("c", create=True)
    c2.admit(0, -1, 0)
    assert c.nbytes() == 64


def test_slots_allocated_follows_doubling() -> None:
    r = RequestKV(geometry(initial_slots=64))
    for n in range(1, 300):
        r.admit(n - 1, n - 2, n - 1)
        assert r.capacity == slots_allocated(n), n
