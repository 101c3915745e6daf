"""Per-request node bookkeeping of a stage: which nodes it holds, which are committed, which are dead.

Pure Python; one NodeTable per request, owned by the stage's KV cache. It decides, for every incoming
row, whether the row is computed or dropped, and which held nodes a row may attend to.

Rules (docs/architecture.md, "Data plane and control plane": the planes are separate streams, so commit and
prune may arrive before or after the rows they name):
- commit(ids): the nodes are part of the output. Ids not yet held are remembered and take effect when
  their row arrives. Committed nodes form one chain; `tip` is the deepest committed node held.
- prune(ids): the nodes and their held descendants are dead: their KV is freed and their ids become
  tombstones. A later row with a tombstoned id or parent is dropped (and tombstoned).
- Tombstones stay bounded by a watermark: the id of the tip. The coordinator gives a request's nodes
  increasing ids (RequestState.new_node), and a child is made after its parent, so every descendant of the
  tip has a larger id than the tip. A node with a smaller id that is neither held nor expected (pending
  commit) can therefore never be committed: a row for it is dropped whether it arrives early or late, like
  a tombstone's. Listed tombstones below the watermark are forgotten as the tip moves; what stays listed are
  ids allocated after the tip's, a number set by the coordinator's speculation, not by the request's length.
  (For messages no correct coordinator sends, a new id below the watermark is dropped rather than refused,
  and committing one is refused as a pruned node's.)
- A row is also dropped when it can no longer be committed: its deepest committed ancestor C is not the
  tip, i.e. a sibling branch below C was committed.
- A row whose parent was never seen is a protocol error.

Worked example (positions in brackets):

    0[0] -> 1[1] -> 2[2]          commit(0, 1)    committed chain 0, 1; tip = 1
              \\-> 3[2]            rows 2 and 3 are live children of the tip
    commit(2)                     tip = 2; 3's deepest committed ancestor is 1 != tip: 3 is dead
    admit(4, parent=3)            -> DROP (parent not live); 4 becomes a tombstone
    prune(3)                      frees 3, remembers it (listed: 3 and 4 are above the watermark, 2)
    commit(5) + admit(5, parent=2) tip = 5: the watermark is 5, the list forgets 3 and 4 (still dead)
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Set
from dataclasses import dataclass, field
from enum import Enum


class ProtocolError(ValueError):
    """A message that no correct coordinator sends (unknown parent, duplicate node, bad position)."""
    code = 3       # grpc.StatusCode.INVALID_ARGUMENT; the core does not import grpc


class Admit(Enum):
    OK = "ok"
    DROP = "drop"


@dataclass
class Node:
    parent: int
    position: int
    committed: bool = False
    children: list[int] = field(default_factory=list)


class Tombstones(Set[int]):
    """The dead ids of one request, a read-only view of its table: the listed ids (`listed`, at or above
    the watermark) and, implied, every id below the watermark that the table neither holds nor expects.
    Membership covers both; iteration and len() cover the listed ids only, so `other <= tombstones`
    (every id of `other` is dead) is answered by membership.

    >>> t = NodeTable()
    >>> t.commit([0, 1]); _ = t.admit(0, -1, 0); _ = t.admit(1, 0, 1)      # tip: node 1
    >>> t.tombstones.watermark, 0 in t.tombstones, 7 in t.tombstones
    (1, False, False)
    >>> _ = t.prune([7]); sorted(t.tombstones), 7 in t.tombstones
    ([7], True)
    """

    def __init__(self, table: "NodeTable") -> None:
        self._table = table

    @property
    def watermark(self) -> int:
        return self._table.watermark

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, int) and self._table.is_dead(node_id)

    def __iter__(self) -> Iterator[int]:
        return iter(self._table.listed)

    def __len__(self) -> int:
        return len(self._table.listed)

    def __ge__(self, other: Iterable[object]) -> bool:       # type: ignore[override]
        return all(i in self for i in other)

    @classmethod
    def _from_iterable(cls, it: Iterable[int]) -> set[int]:    # what `&`, `|`, `-` build: a plain set
        return set(it)

    def __repr__(self) -> str:
        return f"Tombstones(listed={sorted(self._table.listed)}, watermark={self.watermark})"


class NodeTable:
    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {}
        self.pending_commit: set[int] = set()
        self.listed: set[int] = set()   # tombstones at or above the watermark (see Tombstones)
        self.watermark = 0       # id of the tip (0 before there is one): ids below it are dead unless expected
        self.tip_position = -1   # position of the deepest committed node held

    @property
    def tombstones(self) -> Tombstones:
        """The dead ids (listed plus implied by the watermark)."""
        return Tombstones(self)

    def is_dead(self, node_id: int) -> bool:
        """Whether a row with this id is dropped: pruned, dropped before, or below the watermark and neither
        held nor pending commit."""
        if node_id in self.nodes:
            return False
        if node_id in self.listed:
            return True
        return 0 <= node_id < self.watermark and node_id not in self.pending_commit

    # -- data plane ---------------------------------------------------------------------------------
    def admit(self, node_id: int, parent_id: int, position: int) -> Admit:
        """Check one incoming row and, if it is live, hold it. Raises ProtocolError on bad input."""
        verdict = self.judge(node_id, parent_id, position)
        self.settle(verdict, node_id, parent_id, position)
        return verdict

    def judge(self, node_id: int, parent_id: int, position: int) -> Admit:
        """What admit would answer, changing nothing (a caller that must allocate before holding the row
        judges, allocates, then settles). Raises ProtocolError on bad input."""
        _check_id(node_id)
        if node_id in self.nodes:
            raise ProtocolError(f"node {node_id} is already held")
        if self.is_dead(node_id) or (parent_id != -1 and self.is_dead(parent_id)):
            return Admit.DROP
        if parent_id == -1:
            if position != 0:
                raise ProtocolError(f"root node {node_id} must have position 0, not {position}")
            if any(n.parent == -1 for n in self.nodes.values()):
                raise ProtocolError(f"node {node_id} is a second root")
        else:
            parent = self.nodes.get(parent_id)
            if parent is None:
                raise ProtocolError(f"node {node_id} has unknown parent {parent_id}")
            if position != parent.position + 1:
                raise ProtocolError(
                    f"node {node_id} has position {position}, its parent {parent_id} has {parent.position}")
        if node_id not in self.pending_commit and self._anchor_position(parent_id) < self.tip_position:
            return Admit.DROP
        return Admit.OK

    def settle(self, verdict: Admit, node_id: int, parent_id: int, position: int) -> None:
        """Apply the verdict judge gave for this row (with no change to the table in between): hold the
        row, or tombstone its id."""
        if verdict is Admit.DROP:
            self._bury(node_id)
            return
        committed = node_id in self.pending_commit
        self.pending_commit.discard(node_id)
        self.nodes[node_id] = Node(parent_id, position, committed)
        if parent_id != -1:
            self.nodes[parent_id].children.append(node_id)
        if committed:
            self._committed(node_id, position)

    def visible(self, node_id: int) -> tuple[int, list[int]]:
        """What a held node attends to: (p, uncommitted) = every committed node with position <= p, plus
        the uncommitted nodes on its path to the root (itself included when uncommitted)."""
        path: list[int] = []
        cur = node_id
        while cur != -1:
            node = self.nodes[cur]
            if node.committed:
                return node.position, path
            path.append(cur)
            cur = node.parent
        return -1, path

    # -- control plane ------------------------------------------------------------------------------
    def check_control(self, commit: list[int], prune: list[int]) -> list[int]:
        """Raise ProtocolError if commit(commit) then prune(prune) would fail; changes nothing. Returns the ids
        the prune tombstones (`prune(prune, doomed=)` after the commit: what the commit makes dead by its
        watermark is not held, and burying it again is a no-op). A message that commits an id and prunes it is
        refused, whether the table holds it or only expects it (so is one pruning a held ancestor of a held node
        it commits): the prune would silently undo the commit."""
        self._check_commit(commit)
        return self._doomed(prune, committing=set(commit))

    def commit(self, ids: list[int]) -> None:
        """Mark nodes committed (remembered until their row arrives when not held yet). All or nothing:
        raises ProtocolError, changing nothing, for a negative id or a pruned node."""
        self._check_commit(ids)
        watermark = self.watermark
        for node_id in ids:
            node = self.nodes.get(node_id)
            if node is None:
                self.pending_commit.add(node_id)
                continue
            node.committed = True
            self._committed(node_id, node.position, forget=False)
        if self.watermark != watermark:                 # (once for the whole commit, not per node)
            self._forget_below()

    def prune(self, ids: list[int], doomed: list[int] | None = None) -> list[int]:
        """Kill nodes and their held subtrees; return the held node ids that were freed. All or nothing:
        raises ProtocolError, changing nothing, for a negative id or when a committed node would die.
        `doomed`: what `check_control` returned for these ids (not found again)."""
        freed: list[int] = []
        nodes, pending = self.nodes, self.pending_commit
        for node_id in self._doomed(ids) if doomed is None else doomed:
            pending.discard(node_id)
            node = nodes.pop(node_id, None)
            if node_id >= self.watermark:             # (`_bury`, no longer expected: listed unless implied)
                self.listed.add(node_id)
            if node is None:
                continue
            freed.append(node_id)
            parent = nodes.get(node.parent)
            if parent is not None:
                parent.children.remove(node_id)
        return freed

    def _check_commit(self, ids: list[int]) -> None:
        for node_id in ids:
            _check_id(node_id)
            if self.is_dead(node_id):
                raise ProtocolError(f"cannot commit pruned node {node_id}")

    def _doomed(self, ids: list[int], committing: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """The ids prune(ids) tombstones — the named nodes and their held descendants not yet tombstoned —
        parents before children; raises ProtocolError when one of them is committed (or in `committing`).
        (`is_dead` and `_check_id` spelled out: this runs once per node of every prune.)"""
        doomed: list[int] = []
        seen: set[int] = set()
        stack = list(ids)
        nodes, listed, pending, watermark = self.nodes, self.listed, self.pending_commit, self.watermark
        while stack:
            node_id = stack.pop()
            if node_id < 0:
                _check_id(node_id)
            if node_id in seen:
                continue
            node = nodes.get(node_id)
            if node is None and (node_id in listed or (node_id < watermark and node_id not in pending)):
                continue                                  # dead already
            seen.add(node_id)
            if node_id in committing or (node is not None and node.committed):
                raise ProtocolError(f"cannot prune committed node {node_id}")
            if node is not None:
                stack.extend(node.children)
            doomed.append(node_id)
        return doomed

    # -- tombstones and the tip ---------------------------------------------------------------------
    def _bury(self, node_id: int) -> None:
        """Make a node id (not held) dead: listed unless the watermark already implies it."""
        if node_id >= self.watermark or node_id in self.pending_commit:
            self.listed.add(node_id)

    def _committed(self, node_id: int, position: int, forget: bool = True) -> None:
        """A held node is now committed; when it is the new tip, raise the watermark to its id and (`forget`)
        forget the listed tombstones that the watermark now implies."""
        if position <= self.tip_position:
            return
        self.tip_position = position
        if node_id > self.watermark:
            self.watermark = node_id
            if forget:
                self._forget_below()

    def _forget_below(self) -> None:
        """Drop the listed tombstones the watermark implies (below it and not expected)."""
        self.listed = {i for i in self.listed if i >= self.watermark or i in self.pending_commit}

    # -- queries ------------------------------------------------------------------------------------
    def _anchor_position(self, parent_id: int) -> int:
        """Position of the deepest committed ancestor of a new child of parent_id (-1 if none)."""
        return self.visible(parent_id)[0] if parent_id != -1 else -1

    @property
    def committed_count(self) -> int:
        return sum(1 for n in self.nodes.values() if n.committed)

    @property
    def live_count(self) -> int:
        return len(self.nodes) - self.committed_count


def _check_id(node_id: int) -> None:
    if node_id < 0:
        raise ProtocolError(f"node id {node_id} is negative")
