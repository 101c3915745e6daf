"""Property tests (hypothesis) of the pure cores: a stage's node table under random control and data
messages, the wire format of micro-batches, the speculative tree under random growth / commit / restart,
and greedy verification (= the longest path the target agrees with). Expected values come from small
reference models written here, never from the code under test."""
from __future__ import annotations

import copy
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.drafts.base import DraftSource
from coordinator.core.schedulers.base import Broadcast, Emit, Request, RequestState
from coordinator.core.schedulers.specpipe import SpecPipeScheduler
from coordinator.core.tree import TokenTree
from coordinator.core.vocabulary import TREE_POLICIES
from helpers.fuzz_harness import check_invariants
from helpers.ids import id_counter
from common.batch import MicroBatch, Segment, StageTrace
from services.kv_cache import CacheGeometry, RequestKV
from services.nodes import ProtocolError
from common.sampling import Sampling
from common.wire import batch_from_proto, batch_to_proto

# -- node table + KV slots: random control / data sequences ----------------------------------------
IDS = st.integers(-2, 9)        # small: collisions, unknown parents, negatives and re-used ids are common
OP = st.one_of(
    st.tuples(st.just("admit"), IDS, IDS, st.integers(-1, 6)),
    st.tuples(st.just("commit"), st.lists(IDS, max_size=4)),
    st.tuples(st.just("prune"), st.lists(IDS, max_size=4)),
    st.tuples(st.just("control"), st.lists(IDS, max_size=3), st.lists(IDS, max_size=3)),
)


def snapshot(r: RequestKV) -> tuple:
    t = r.table
    return (copy.deepcopy(t.nodes), set(t.pending_commit), set(t.tombstones), t.tip_position, dict(r.slot_of),
            list(r.free), r.high_water)


def subtree(r: RequestKV, ids: list[int]) -> set[int]:
    out, stack = set(), [i for i in ids if i in r.table.nodes]
    while stack:
        i = stack.pop()
        out.add(i)
        stack.extend(r.table.nodes[i].children)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(OP, max_size=25))
def test_node_table_is_all_or_nothing_and_stays_consistent(ops) -> None:
    """Whatever arrives, a rejected message changes nothing; an accepted prune removes exactly the held
    subtrees of the ids named, and the table, slots and masks stay consistent."""
    geometry = CacheGeometry(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32,
                             device=torch.device("cpu"), initial_slots=2)
    r = RequestKV(geometry)
    for op in ops:
        before = snapshot(r)
        held = set(r.table.nodes)
        try:
            if op[0] == "admit":
                r.admit(op[1], op[2], op[3])
            elif op[0] == "commit":
                r.commit(op[1])
                assert all(r.table.nodes[i].committed for i in op[1] if i in r.table.nodes)
            elif op[0] == "prune":
                doomed = subtree(r, op[1])
                freed = r.prune(op[1])
                assert freed == len(doomed) and set(r.table.nodes) == held - doomed
                assert set(op[1]) <= r.table.tombstones
            else:
                r.table.check_control(op[1], op[2])
                r.commit(op[1])
                r.prune(op[2])
        except ProtocolError:
            assert snapshot(r) == before, f"{op} was rejected but changed the table"
        check_invariants(r)


def test_rejected_prune_of_a_committed_descendant_leaves_nothing_half_done() -> None:
    """Regression: prune(1) where 1's child 3 is committed used to delete 1 before refusing, leaving 2 with
    a missing parent (the next child of 2 then failed with KeyError) and leaking 1's KV slot."""
    geometry = CacheGeometry(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32,
                             device=torch.device("cpu"), initial_slots=2)
    r = RequestKV(geometry)
    for node, parent, pos in [(0, -1, 0), (1, 0, 1), (2, 1, 2), (3, 1, 2)]:
        r.admit(node, parent, pos)
    r.commit([0, 3])
    try:
        r.prune([1])
        raise AssertionError("pruning above a committed node must be refused")
    except ProtocolError:
        pass
    assert set(r.table.nodes) == {0, 1, 2, 3} and set(r.slot_of) == {0, 1, 2, 3} and not r.table.tombstones
    assert r.admit(9, 2, 3) is None           # dropped (3's branch is committed), not a KeyError
    check_invariants(r)


# -- wire: random micro-batches ---------------------------------------------------------------------
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
I32 = st.integers(-(1 << 31), (1 << 31) - 1)
F32 = st.floats(width=32, allow_nan=False)


@st.composite
def segments(draw) -> Segment:
    n = draw(st.integers(0, 4))
    return Segment(draw(st.text(max_size=8)), draw(st.lists(I64, min_size=n, max_size=n)),
                   draw(st.lists(I64, min_size=n, max_size=n)), draw(st.lists(I32, min_size=n, max_size=n)),
                   draw(st.lists(I32, min_size=n, max_size=n)), draw(st.lists(st.booleans(), min_size=n, max_size=n)),
                   draw(st.text(max_size=8)), draw(I32), draw(I32),
                   Sampling(draw(F32), draw(F32.filter(lambda x: x != 0.0)), draw(I32),
                            draw(st.integers(0, (1 << 64) - 1))))


@st.composite
def tensors(draw) -> torch.Tensor | None:
    if draw(st.booleans()):
        return None
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    raw = draw(st.binary(min_size=math.prod(shape) * 8, max_size=math.prod(shape) * 8))
    u8 = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    size = torch.empty((), dtype=dtype).element_size()
    t = (u8[:math.prod(shape)] & 1).bool() if dtype == torch.bool else u8[:math.prod(shape) * size].view(dtype)
    return t.reshape(shape)


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and a.reshape(-1).view(torch.uint8).equal(
        b.reshape(-1).view(torch.uint8))


@settings(max_examples=150, deadline=None)
@given(st.integers(0, (1 << 64) - 1), st.lists(segments(), max_size=3), tensors(), tensors(),
       st.lists(I32, max_size=4), st.booleans(),
       st.lists(st.builds(StageTrace, I32, I32, I32, st.floats(allow_nan=False), st.floats(allow_nan=False)),
                max_size=2))
def test_micro_batch_survives_the_wire_bit_exactly(batch_id, segs, hidden, logprobs, argmax, lp, trace) -> None:
    """Any micro-batch, including bfloat16 and empty tensors and NaN bit patterns, comes back identical."""
    b = MicroBatch(batch_id, segs, hidden, argmax, logprobs, lp, trace)
    msg = batch_to_proto(b)
    back = batch_from_proto(type(msg).FromString(msg.SerializeToString()))
    assert back.batch_id == batch_id and back.argmax == argmax and back.return_logprobs == lp
    assert back.trace == trace and back.segments == segs
    assert same_bits(back.hidden, hidden) and same_bits(back.logprobs, logprobs)


# -- the speculative tree under random growth, commit and restart -----------------------------------
def make_tree(depth: int = 3) -> TokenTree:
    return TokenTree(0, 9, depth, id_counter(1))


def descendants(tree: TokenTree, node_id: int) -> set[int]:
    out, stack = set(), [node_id]
    while stack:
        i = stack.pop()
        out.add(i)
        stack.extend(tree.nodes[i].children)
    return out


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_tree_commit_keeps_exactly_the_chosen_subtree_and_its_paths(data) -> None:
    tree = make_tree(data.draw(st.integers(0, 4)))
    for _ in range(data.draw(st.integers(1, 30))):
        op = data.draw(st.sampled_from(["grow", "grow", "select", "commit", "restart"]))
        old = copy.deepcopy(tree.nodes)
        old_root = tree.root
        if op == "grow":
            parent = data.draw(st.sampled_from(sorted(tree.nodes)))
            tree.add_children(parent, data.draw(st.lists(st.tuples(st.integers(0, 5), st.floats(-4, 0)), max_size=3)))
        elif op == "select":
            tree.root_node.injected = True
            chosen = tree.select(data.draw(st.sampled_from(TREE_POLICIES)), data.draw(st.integers(1, 4)))
            assert all(i in old and not old[i].injected and tree.nodes[i].injected for i in chosen)
        elif op == "commit":
            hits = [c for c in tree.root_node.children if tree.nodes[c].injected]
            if not hits:
                continue
            child = data.draw(st.sampled_from(hits))
            keep = descendants(tree, child)
            old_paths = {i: tree.path_tokens(i) for i in keep}
            pruned = tree.commit(child)
            assert set(tree.nodes) == keep, "commit keeps exactly the chosen child's subtree"
            assert tree.root == child and tree.root_node.committed and tree.root_node.depth == old[child].depth
            for i in keep:   # the path from the old root now starts at the new root
                assert old_paths[i] == [old[child].token] + tree.path_tokens(i)
            dropped = set(old) - keep - {old_root}
            assert set(pruned) == {i for i in dropped if old[i].injected or old[i].expanded}
        else:
            token = data.draw(st.integers(0, 5))
            bonus, pruned = tree.restart(token)
            assert set(tree.nodes) == {bonus} and bonus not in old
            assert tree.root_node.token == token and tree.root_node.depth == old[old_root].depth + 1
            assert set(pruned) == {i for i in set(old) - {old_root} if old[i].injected or old[i].expanded}
        for i, n in tree.nodes.items():       # every live node's parent is live, depths follow parents
            if i != tree.root:
                assert n.parent in tree.nodes and n.depth == tree.nodes[n.parent].depth + 1
                assert not n.injected or tree.nodes[n.parent].injected


# -- greedy verification = the longest path the target agrees with ----------------------------------
class NullDraft(DraftSource):
    def begin(self, request_id, prompt_ids, sampling=None, keep_q=False) -> None:
        pass

    def expand(self, request_id, nodes, k):
        return [[] for _ in nodes]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_greedy_verification_commits_the_longest_matching_path(data) -> None:
    sched = SpecPipeScheduler(4, NullDraft(), width=4, policy=data.draw(st.sampled_from(TREE_POLICIES)))
    state = RequestState(Request("r", [5, 6, 7], max_new_tokens=10_000))
    state.committed, state.next_node = [0, 1, 2], 3
    sched.requests["r"] = state
    tree = sched.trees["r"] = TokenTree(2, 7, 2, state.new_node)
    for _ in range(data.draw(st.integers(0, 6))):           # a random tree, partly injected
        grown = [i for i, n in tree.nodes.items() if n.injected]
        parent = data.draw(st.sampled_from(sorted(grown)))
        tree.add_children(parent, [(t, -1.0) for t in data.draw(st.lists(st.integers(0, 3), max_size=3))])
        tree.select(sched.policy, data.draw(st.integers(1, 4)))
    for i, n in tree.nodes.items():                         # the target's token after returned nodes
        if n.injected and data.draw(st.booleans()):
            n.target_next = data.draw(st.integers(0, 3))
    old = copy.deepcopy(tree.nodes)

    expected, path, node = [], [], old[2]                   # reference: walk while the target agrees
    while node.target_next is not None:
        expected.append(node.target_next)
        hit = next((c for c in node.children if old[c].injected and old[c].token == node.target_next), None)
        if hit is None:
            break                                           # the bonus: the target's own token
        path.append(hit)
        node = old[hit]

    assert sched._verify(state, tree)
    actions = sched.poll()
    assert state.generated == expected
    assert [t for a in actions if isinstance(a, Emit) for t in a.token_ids] == expected
    commits = [i for a in actions if isinstance(a, Broadcast) for i in a.control.commit]
    pruned = [i for a in actions if isinstance(a, Broadcast) for i in a.control.prune]
    assert commits[:len(path)] == path and len(commits) == len(expected)
    computed = {i for i, n in old.items() if n.injected and i != 2}      # the stages hear of injected nodes
    last = old[path[-1]] if path else old[2]
    warm = next((c for c in last.children if not old[c].injected and old[c].token == expected[-1]), None) \
        if expected and len(expected) > len(path) and sched.policy != "layer" else None
    if warm is not None:                                    # ended with a warm restart into a proposed child
        assert tree.root == warm == commits[-1] and set(tree.nodes) == descendants_of(old, warm)
        assert set(pruned) == computed - set(path)
    elif len(expected) > len(path):                         # ended with a bonus
        assert set(tree.nodes) == {tree.root} and tree.root == commits[-1] and tree.root not in old
        assert set(pruned) == computed - set(path)
    else:
        assert tree.root == (path[-1] if path else 2)
        assert set(tree.nodes) == descendants_of(old, tree.root)
        assert set(pruned) == computed - descendants_of(old, tree.root) - set(path)
    assert len(pruned) == len(set(pruned))


def descendants_of(nodes: dict, root: int) -> set[int]:
    out, stack = set(), [root]
    while stack:
        i = stack.pop()
        out.add(i)
        stack.extend(nodes[i].children)
    return out
