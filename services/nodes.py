"""Per-request node bookkeeping of a stage: which nodes it holds, which are committed, which are dead.

Pure Python; one NodeTable per request, owned by the stage's KV cache. It decides, for every incoming
row, whether the row is computed or dropped, and which held nodes a row may attend to.

Rules (DESIGN §3: control and data planes are separate streams, so commit/prune may arrive before or after
the rows they name):
- commit(ids): the nodes are part of the output. Ids not yet held are remembered and take effect when
  their row arrives. Committed nodes form one chain; `tip` is the deepest committed node held.
- prune(ids): the nodes and their held descendants are dead: their KV is freed and their ids become
  tombstones, kept until release. A later row with a tombstoned id or parent is dropped (and tombstoned).
- A row is also dropped when it can no longer be committed: its deepest committed ancestor C is not the
  tip, i.e. a sibling branch below C was committed.
- A row whose parent was never seen is a protocol error.

Worked example (positions in brackets):

    0[0] -> 1[1] -> 2[2]          commit(0, 1)    committed chain 0, 1; tip = 1
              \\-> 3[2]            rows 2 and 3 are live children of the tip
    commit(2)                     tip = 2; 3's deepest committed ancestor is 1 != tip: 3 is dead
    admit(4, parent=3)            -> DROP (parent not live); 4 becomes a tombstone
    prune(3)                      frees 3, remembers it
"""
from __future__ import annotations

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


class NodeTable:
    def __init__(self) -> None:
        self.nodes: dict[int, Node] = {}
        self.pending_commit: set[int] = set()
        self.tombstones: set[int] = set()
        self.tip_position = -1   # position of the deepest committed node held

    # -- data plane ---------------------------------------------------------------------------------
    def admit(self, node_id: int, parent_id: int, position: int) -> Admit:
        """Check one incoming row and, if it is live, hold it. Raises ProtocolError on bad input."""
        _check_id(node_id)
        if node_id in self.nodes:
            raise ProtocolError(f"node {node_id} is already held")
        if node_id in self.tombstones:
            return Admit.DROP
        if parent_id in self.tombstones:
            self.tombstones.add(node_id)
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
        committed = node_id in self.pending_commit
        if not committed and self._anchor_position(parent_id) < self.tip_position:
            self.tombstones.add(node_id)
            return Admit.DROP
        self.pending_commit.discard(node_id)
        self.nodes[node_id] = Node(parent_id, position, committed)
        if parent_id != -1:
            self.nodes[parent_id].children.append(node_id)
        if committed:
            self.tip_position = max(self.tip_position, position)
        return Admit.OK

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
    def check_control(self, commit: list[int], prune: list[int]) -> None:
        """Raise ProtocolError if commit(commit) then prune(prune) would fail; changes nothing."""
        self._check_commit(commit)
        self._doomed(prune, committing={i for i in commit if i in self.nodes})

    def commit(self, ids: list[int]) -> None:
        """Mark nodes committed (remembered until their row arrives when not held yet). All or nothing:
        raises ProtocolError, changing nothing, for a negative id or a pruned node."""
        self._check_commit(ids)
        for node_id in ids:
            node = self.nodes.get(node_id)
            if node is None:
                self.pending_commit.add(node_id)
                continue
            node.committed = True
            self.tip_position = max(self.tip_position, node.position)

    def prune(self, ids: list[int]) -> list[int]:
        """Kill nodes and their held subtrees; return the held node ids that were freed. All or nothing:
        raises ProtocolError, changing nothing, for a negative id or when a committed node would die."""
        freed: list[int] = []
        for node_id in self._doomed(ids):
            self.tombstones.add(node_id)
            self.pending_commit.discard(node_id)
            node = self.nodes.pop(node_id, None)
            if node is None:
                continue
            freed.append(node_id)
            parent = self.nodes.get(node.parent)
            if parent is not None:
                parent.children.remove(node_id)
        return freed

    def _check_commit(self, ids: list[int]) -> None:
        for node_id in ids:
            _check_id(node_id)
            if node_id not in self.nodes and node_id in self.tombstones:
                raise ProtocolError(f"cannot commit pruned node {node_id}")

    def _doomed(self, ids: list[int], committing: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """The ids prune(ids) tombstones — the named nodes and their held descendants not yet tombstoned —
        parents before children; raises ProtocolError when one of them is committed (or in `committing`)."""
        doomed: list[int] = []
        seen: set[int] = set()
        stack = list(ids)
        while stack:
            node_id = stack.pop()
            if node_id in self.tombstones or node_id in seen:
                continue
            _check_id(node_id)
            seen.add(node_id)
            node = self.nodes.get(node_id)
            if node is not None:
                if node.committed or node_id in committing:
                    raise ProtocolError(f"cannot prune committed node {node_id}")
                stack.extend(node.children)
            doomed.append(node_id)
        return doomed

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
