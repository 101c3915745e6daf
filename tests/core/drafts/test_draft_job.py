"""A draft job's bookkeeping: a request's failing op fails that request, and its release still runs, so the
draft keeps nothing of a request that ended (KV, sampling state, kept q)."""
from __future__ import annotations

from common.sampling import Sampling

from coordinator.core.drafts.base import DraftNode, DraftNodes
from coordinator.core.drafts.job import DraftJob, DraftOp, OpKind
from coordinator.core.drafts.model import ModelDraft, quantized_copy


class FailingCommit(ModelDraft):
    def control(self, request_id, commit, tokens, prune):
        raise RuntimeError("the draft's KV table is broken (simulated)")


def test_a_release_after_a_failing_op_of_the_same_request_still_runs(tiny_model):
    """The request ended with a commit queued: [COMMIT a, RELEASE a] go in one job. The commit fails (a's
    error); the release must run all the same, or a's KV and sampling state stay for ever (nobody asks
    for a again). `b`, untouched by the failure, is prefilled and kept."""
    draft = FailingCommit(quantized_copy(str(tiny_model)))
    sampled = Sampling(temperature=0.8, seed=3)
    draft.begin_many([("a", [5, 6, 7, 8], sampled, True), ("b", [9, 10, 11], sampled, True)])
    assert draft.runner.cache.nbytes() > 0 and set(draft.sampling) == {"a", "b"}
    job = DraftJob(ops=[DraftOp(OpKind.COMMIT, "a", (3,), (8,)), DraftOp(OpKind.RELEASE, "a")])
    results = job.run(draft)
    assert set(results.errors) == {"a"} and "broken" in str(results.errors["a"])
    assert set(draft.sampling) == {"b"} and set(draft.runner.cache.requests) == {"b"}, "a's state gone, b's kept"
    DraftJob(ops=[DraftOp(OpKind.RELEASE, "b")]).run(draft)
    assert not draft.sampling and not draft.runner.cache.requests and draft.runner.cache.nbytes() == 0


class FailingRelease(ModelDraft):
    def release(self, request_id):
        self.runner.apply = None             # the KV table's release raises: the rest must still be forgotten
        try:
            super().release(request_id)
        finally:
            del self.runner.apply


def test_a_release_whose_kv_release_fails_still_forgets_the_sampling_state(tiny_model):
    draft = FailingRelease(quantized_copy(str(tiny_model)))
    draft.begin_many([("a", [5, 6, 7, 8], Sampling(temperature=0.8, seed=3), True)])
    results = DraftJob(ops=[DraftOp(OpKind.RELEASE, "a")]).run(draft)
    assert set(results.errors) == {"a"}
    assert not draft.sampling and not draft._q


def test_draft_nodes_reads_as_the_list_of_head_then_columns():
    """A job's nodes to expand: committed nodes the draft has not computed, then tree nodes given as columns;
    read, compared and measured as the list of DraftNode tuples they stand for."""
    head = [DraftNode(3, 2, 3, 9)]
    nodes = DraftNodes(head, [7, 8], [3, 3], [4, 4], [40, 41])
    assert len(nodes) == 3 and len(DraftNodes([], [], [], [], [])) == 0
    expected = [DraftNode(3, 2, 3, 9), DraftNode(7, 3, 4, 40), DraftNode(8, 3, 4, 41)]
    assert nodes == expected and list(nodes) == expected and nodes[-1] == DraftNode(8, 3, 4, 41)
    assert nodes[1:] == expected[1:] and [n.node_id for n in nodes] == [3, 7, 8]
    assert nodes != expected[:2] and DraftNodes([], [7], [3], [4], [40]) == DraftNodes([], [7], [3], [4], [40])


class Counting(ModelDraft):
    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.controls: list[tuple[str, list[int], list[int]]] = []

    def control(self, request_id, commit, tokens, prune):
        self.controls.append((request_id, list(commit), list(prune)))
        super().control(request_id, commit, tokens, prune)


def test_a_jobs_commits_and_prunes_go_in_one_control_per_request_and_leave_the_table_as_op_by_op(tiny_model):
    """Two results' bookkeeping for a (commit 3 and prune 11's subtree, then commit 10 and 15 — a child of 10
    the draft has not computed: expected — and prune 12 and 16, never held) and b's release go as b's release
    and one control for a (commits [3, 10, 15], prunes [11, 12, 16]); a's KV table ends as the same ops applied
    one by one leave it: rows, slots, commits expected, tombstones, tip."""
    model = quantized_copy(str(tiny_model))
    drafts = [Counting(model), Counting(model)]
    for d in drafts:
        d.begin_many([("a", [5, 6, 7, 8], Sampling(), False), ("b", [9, 10, 11], Sampling(), False)])
        d.expand("a", [DraftNode(3, 2, 3, 8)], 2)
        d.expand("a", [DraftNode(10, 3, 4, 20), DraftNode(11, 3, 4, 21), DraftNode(12, 3, 4, 22)], 2)
        d.expand("a", [DraftNode(13, 11, 5, 23), DraftNode(14, 10, 5, 24)], 2)
    ops = [DraftOp(OpKind.COMMIT, "a", (3,), (8,)), DraftOp(OpKind.PRUNE, "a", (11,)),
           DraftOp(OpKind.RELEASE, "b"), DraftOp(OpKind.COMMIT, "a", (10, 15), (20, 25)),
           DraftOp(OpKind.PRUNE, "a", (12, 16))]
    results = DraftJob(ops=list(ops)).run(drafts[0])
    assert not results.errors
    assert drafts[0].controls == [("a", [3, 10, 15], [11, 12, 16])], "b's release flushed nothing of a's; one control"
    for op in ops:                                  # the same ops, one by one
        if op.kind is OpKind.COMMIT:
            drafts[1].commit(op.request_id, list(op.node_ids), list(op.tokens))
        elif op.kind is OpKind.PRUNE:
            drafts[1].prune(op.request_id, list(op.node_ids))
        else:
            drafts[1].release(op.request_id)
    coalesced, single = (d.runner.cache.get("a", create=False) for d in drafts)
    assert set(coalesced.table.nodes) == set(single.table.nodes) == {0, 1, 2, 3, 10, 14}
    assert {i: n.committed for i, n in coalesced.table.nodes.items()} == \
        {i: n.committed for i, n in single.table.nodes.items()}
    assert coalesced.table.watermark == single.table.watermark == 10
    assert sorted(coalesced.free) == sorted(single.free) and len(coalesced.free) == 3, "11, 12, 13's slots freed"
    assert coalesced.table.pending_commit == single.table.pending_commit == {15}
    assert coalesced.table.tip_position == single.table.tip_position == 4
    assert [i in coalesced.table.tombstones for i in range(20)] == [i in single.table.tombstones for i in range(20)]
    assert {13, 16} <= coalesced.table.tombstones and 15 not in coalesced.table.tombstones
    assert not drafts[0].runner.cache.get("b", create=False) and not drafts[1].runner.cache.get("b", create=False)
