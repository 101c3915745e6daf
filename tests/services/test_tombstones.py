"""Per-request tombstones on the stages stay bounded (services/nodes.py): ids below the tip's id that the
table neither holds nor expects are dead by the watermark, so the listed tombstones do not grow with the
request, while late rows of pruned nodes are still dropped — early and late prunes alike.

The reference is the same table with the watermark held at 0: every tombstone listed for ever (the
behaviour before the watermark)."""
from __future__ import annotations

from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.fuzz_harness import check_invariants
from services.kv_cache import CacheGeometry, RequestKV
from services.nodes import Admit, NodeTable, ProtocolError

OK, DROP = Admit.OK, Admit.DROP


class Unbounded(NodeTable):
    """Reference: the watermark never moves, so every tombstone stays listed."""

    def _committed(self, node_id: int, position: int, forget: bool = True) -> None:
        self.tip_position = max(self.tip_position, position)


def test_docstring_example_watermark() -> None:
    t = NodeTable()
    for row in [(0, -1, 0), (1, 0, 1), (2, 1, 2), (3, 1, 2)]:
        assert t.admit(*row) is OK
    t.commit([0, 1])
    t.commit([2])
    assert t.admit(4, 3, 3) is DROP
    assert t.prune([3]) == [3]
    assert t.tombstones.watermark == 2 and sorted(t.tombstones) == [3, 4]
    t.commit([5])
    assert t.admit(5, 2, 3) is OK
    assert t.tombstones.watermark == 5 and len(t.tombstones) == 0
    assert {3, 4} <= t.tombstones and 5 not in t.tombstones and 2 not in t.tombstones
    assert t.admit(3, 1, 2) is DROP and t.admit(6, 4, 4) is DROP       # late rows: still dropped
    with pytest.raises(ProtocolError, match="pruned"):
        t.commit([3])


@pytest.mark.parametrize("early", [False, True])
def test_tombstones_stay_bounded_over_many_rounds(early: bool) -> None:
    g = CacheGeometry(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
                      initial_slots=4)
    r = RequestKV(g)
    r.table.commit([0])
    r.admit(0, -1, 0)
    tip, position, next_id, pruned, most = 0, 0, 1, [], 0
    for _ in range(2000):
        a, b, c = next_id, next_id + 1, next_id + 2
        next_id += 3
        assert r.admit(a, tip, position + 1) is not None
        if early:                            # the prune reaches the stage before the rows it names
            r.commit([a])
            r.prune([b, c])
            assert r.admit(b, tip, position + 1) is None and r.admit(c, b, position + 2) is None
        else:
            assert r.admit(b, tip, position + 1) is not None and r.admit(c, b, position + 2) is not None
            r.commit([a])
            assert r.prune([b, c]) == 2
        pruned += [b, c]
        tip, position = a, position + 1
        most = max(most, len(r.table.tombstones))
    assert most <= 2, "listed tombstones: only ids allocated after the tip's"
    assert r.table.tombstones.watermark == tip
    assert set(pruned) <= r.table.tombstones                # every pruned id is still dead
    for b in pruned[:40:2] + pruned[-6::2]:                 # late rows, long after and just after
        assert r.admit(b, b - 1, 1) is None
        assert r.admit(b + 1, b, 2) is None
    with pytest.raises(ProtocolError, match="pruned"):
        r.commit([pruned[0]])
    assert len(r.table.tombstones) <= 2
    assert r.high_water <= 2001 + 2, "the committed chain plus the 2 slots pruned rows reuse"
    check_invariants(r)


# -- random coordinator-like traffic, compared with the unbounded reference ---------------------------
OPS = st.lists(st.tuples(st.sampled_from(["grow", "grow", "commit", "data", "data", "control"]),
                         st.integers(0, 1000)), max_size=80)


class Coordinator:
    """A speculative tree with increasing node ids; a commit of a child of the tip prunes every other
    branch. Rows (data plane) and control messages are two FIFO streams the test interleaves."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {0: -1}
        self.position: dict[int, int] = {0: 0}
        self.children: dict[int, list[int]] = {0: []}
        self.tip, self.next_id = 0, 1
        self.rows: deque[tuple[int, int, int]] = deque([(0, -1, 0)])
        self.controls: deque[tuple[list[int], list[int]]] = deque([([0], [])])

    def live(self) -> list[int]:
        out, stack = [], [self.tip]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(self.children[n])
        return sorted(out)

    def grow(self, k: int) -> None:
        live = self.live()
        p, n = live[k % len(live)], self.next_id
        self.next_id += 1
        self.parent[n], self.position[n], self.children[n] = p, self.position[p] + 1, []
        self.children[p].append(n)
        self.rows.append((n, p, self.position[n]))

    def commit(self, k: int) -> None:
        kids = self.children[self.tip]
        if not kids:
            return
        c = kids[k % len(kids)]
        dropped, stack = [], [x for x in kids if x != c]
        while stack:
            n = stack.pop()
            dropped.append(n)
            stack.extend(self.children[n])
        self.controls.append(([c], sorted(dropped)))
        self.tip = c


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_bounded_table_agrees_with_unbounded_reference(ops: list[tuple[str, int]]) -> None:
    coord, table, ref = Coordinator(), NodeTable(), Unbounded()

    def deliver(kind: str) -> None:
        if kind == "data" and coord.rows:
            row = coord.rows.popleft()
            assert table.admit(*row) is ref.admit(*row), row
        elif kind == "control" and coord.controls:
            commit, prune = coord.controls.popleft()
            for t in (table, ref):
                t.check_control(commit, prune)
                t.commit(commit)
                t.prune(prune)

    for kind, k in ops:
        if kind == "grow":
            coord.grow(k)
        elif kind == "commit":
            coord.commit(k)
        else:
            deliver(kind)
        assert set(table.nodes) == set(ref.nodes) and table.tip_position == ref.tip_position
        assert table.pending_commit == ref.pending_commit
        ids = range(coord.next_id)
        assert [i in table.tombstones for i in ids] == [i in ref.tombstones for i in ids]
        assert all(i >= table.watermark or i in table.pending_commit for i in table.listed)
    while coord.rows or coord.controls:
        deliver("data")
        deliver("control")
    assert set(table.nodes) == set(ref.nodes)
    assert all(i >= table.watermark for i in table.listed)


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(2, 4))
def test_a_run_of_control_messages_applied_as_one_leaves_the_table_as_one_by_one(ops: list[tuple[str, int]],
                                                                                  run: int) -> None:
    """The draft applies a job's queued controls of a request as one message, its commits then its prunes
    (coordinator/core/drafts/job.py): for coordinator-like traffic — commits of held and expected nodes, prunes
    of live, late and never-held ids, rows arriving before and after — the table ends as the messages applied
    one by one leave it: rows, expected commits, tombstones, tip and watermark."""
    coord, single, coalesced = Coordinator(), NodeTable(), NodeTable()

    def check() -> None:
        assert set(single.nodes) == set(coalesced.nodes)
        assert {i: n.committed for i, n in single.nodes.items()} == {i: n.committed for i, n in coalesced.nodes.items()}
        assert single.pending_commit == coalesced.pending_commit and single.tip_position == coalesced.tip_position
        assert single.watermark == coalesced.watermark
        ids = range(coord.next_id)
        assert [i in single.tombstones for i in ids] == [i in coalesced.tombstones for i in ids]

    for kind, k in ops:
        if kind == "grow":
            coord.grow(k)
        elif kind == "commit":
            coord.commit(k)
        elif kind == "data" and coord.rows:
            row = coord.rows.popleft()
            assert single.admit(*row) is coalesced.admit(*row), row
        elif kind == "control" and coord.controls:
            msgs = [coord.controls.popleft() for _ in range(min(run, len(coord.controls)))]
            for commit, prune in msgs:
                single.check_control(commit, prune)
                single.commit(commit)
                single.prune(prune)
            commit = [i for c, _ in msgs for i in c]
            prune = [i for _, p in msgs for i in p]
            doomed = coalesced.check_control(commit, prune)
            coalesced.commit(commit)
            coalesced.prune(prune, doomed)
        check()
