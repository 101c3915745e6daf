"""How a token tree (coordinator/core/tree.py) keeps its nodes: one numpy column per field, one row per live
node, rows in id order (row 0 is the root), so the hot path works on whole columns; and views of one node
(`tree.nodes[i]`) for cold paths and tests.

    a = NodeArrays()
    a.append(ids, parents, tokens, depths, scores)    # new rows at the end (ids above every live id)
    a.keep(rows)                                      # only these rows stay, in place
    a.clear()                                         # no rows
    a.score[a.injected]                               # columns are numpy views of the live rows
    a.where(ids)                                      # rows of ids (-1: not live), by a dense lookup
    a.best_row[r]                                     # the row of r's best child (NO_ROW: none), remapped
                                                      # by keep: spine walks follow rows, no id lookups
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch

NO_TOKEN = -1          # target_next not known yet
NO_ROW = -1            # best_row: no child
UNKNOWN = -1           # conf: no calibrated expansion yet (coordinator/core/calibration.py)
_LAYOUTS = itertools.count(1)   # NodeArrays.layout stamps


class Tree(Protocol):
    """What a node view reads of its tree (coordinator/core/tree.py TokenTree)."""
    a: "NodeArrays"
    root: int
    q: dict[int, torch.Tensor | None]
    target_p: dict[int, torch.Tensor | None]

    def row(self, node_id: int, strict: bool = True) -> int: ...

    def children(self, node_id: int) -> list[int]: ...


class NodeArrays:
    """One column per field, one row per live node, rows in id order (row 0 is the root). The columns are
    views of buffers that grow by doubling, so adding nodes writes only the new rows."""
    COLUMNS = {"id": np.int64,            # [n] node id
               "parent": np.int64,        # [n] the parent's id (-1 above the root)
               "token": np.int64,         # [n]
               "depth": np.int64,         # [n] = the token's position in the sequence
               "score": np.float64,       # [n] cumulative log-score for ranking: the draft's log-probabilities, or
                                          # their calibrated values (coordinator/core/calibration.py)
               "injected": np.bool_,      # [n]
               "expanded": np.bool_,      # [n] the draft has proposed this node's children
               "asked": np.bool_,         # [n] a draft job in flight computes this node's children
               "target_next": np.int64,   # [n] the target's token after this node (NO_TOKEN: not known yet)
               "best_row": np.int64,      # [n] row of the best child by (score, -id) (NO_ROW: none)
               "conf": np.int8}           # [n] calibration bin of the draft's first choice here (-1: unknown)

    def __init__(self, capacity: int = 256) -> None:
        self._buf = {c: np.empty(capacity, t) for c, t in self.COLUMNS.items()}
        self.n = 0
        self.layout = next(_LAYOUTS)   # a stamp, new whenever rows move (`keep`, `reset`) and never the same
        # for two trees: rows read under an equal stamp are still the same nodes' rows
        # id -> row: _where[1 + id - base] for ids from base (the first live id) to the last; -1 where not
        # live, and -1 at both ends (index 0 and the last), so a clipped lookup of any id is one `take`. Ids
        # live in a span the request's counter handed out since its root was made, so it stays small.
        self.base = 0
        self._where = np.full(capacity + 2, -1, np.int64)
        self._views()

    def _views(self) -> None:
        n, b = self.n, self._buf      # (spelled out: this runs on every append and commit)
        self.id, self.parent, self.token, self.depth = b["id"][:n], b["parent"][:n], b["token"][:n], b["depth"][:n]
        self.score, self.injected, self.expanded = b["score"][:n], b["injected"][:n], b["expanded"][:n]
        self.asked, self.target_next, self.best_row = b["asked"][:n], b["target_next"][:n], b["best_row"][:n]
        self.conf = b["conf"][:n]

    def where(self, ids: np.ndarray) -> np.ndarray:
        """[len(ids)] the row of each id, -1 for an id that is not live."""
        return self._where.take(np.asarray(ids, np.int64) - (self.base - 1), mode="clip")

    def where_one(self, node_id: int) -> int:
        """The row of one id, -1 when it is not live."""
        i = node_id - self.base + 1
        return int(self._where[i]) if 0 < i < len(self._where) else -1

    def append(self, ids: np.ndarray, parents: np.ndarray, tokens: np.ndarray, depths: np.ndarray,
               scores: np.ndarray) -> None:
        """New nodes (ids above every live id, ascending), not injected, not expanded, with no target token or
        child."""
        m, n = len(ids), self.n
        if not m:
            return
        if n == 0:
            self.base = int(ids[0])
            self._where[:] = -1
        span = int(ids[-1]) - self.base + 1
        if span + 2 > len(self._where):             # (room for the sentinel at the end)
            grown = np.full(max(2 * len(self._where), span + 2), -1, np.int64)
            grown[:len(self._where)] = self._where
            self._where = grown
        lo = int(ids[0]) - self.base + 1
        if span + 1 - lo == m:                        # consecutive ids (a draft's proposals): a slice
            self._where[lo:lo + m] = np.arange(n, n + m)
        else:
            self._where[np.asarray(ids) - (self.base - 1)] = np.arange(n, n + m)
        if n + m > len(self._buf["id"]):
            grow = max(2 * len(self._buf["id"]), n + m)
            for c, b in self._buf.items():
                self._buf[c] = np.empty(grow, b.dtype)
                self._buf[c][:n] = b[:n]
        for c, values in (("id", ids), ("parent", parents), ("token", tokens), ("depth", depths),
                          ("score", scores), ("injected", False), ("expanded", False), ("asked", False),
                          ("target_next", NO_TOKEN), ("best_row", NO_ROW), ("conf", UNKNOWN)):
            self._buf[c][n:n + m] = values
        self.n = n + m
        self._views()

    def keep(self, rows: np.ndarray) -> None:
        """Keep only these rows (ascending), in place; a best child that is not kept becomes NO_ROW."""
        k, n = len(rows), self.n
        self.layout = next(_LAYOUTS)
        if n:
            self._where[1:int(self.id[-1]) - self.base + 2] = -1
        for b in self._buf.values():
            b[:k] = b[rows]
        self.n = k
        self._views()
        if k:
            new_rows = np.arange(k)
            remap = np.full(n + 1, NO_ROW, np.int64)       # old row -> new row; [-1] (for NO_ROW): NO_ROW
            remap[rows] = new_rows
            self.best_row[:] = remap.take(self.best_row)
            self.base = int(self.id[0])
            self._where[self.id - (self.base - 1)] = new_rows

    def clear(self) -> None:
        self.keep(np.zeros(0, np.int64))

    def reset(self, node_id: int, token: int, depth: int) -> None:
        """One root node (parent -1, score 0, nothing known of it) in place of every row: a restart's bonus,
        written in place (what `clear` then `append` do, without their whole-column work)."""
        self.layout = next(_LAYOUTS)
        if self.n:
            self._where[1:int(self.id[-1]) - self.base + 2] = -1
        for c, value in (("id", node_id), ("parent", -1), ("token", token), ("depth", depth), ("score", 0.0),
                         ("injected", False), ("expanded", False), ("asked", False), ("target_next", NO_TOKEN),
                         ("best_row", NO_ROW), ("conf", UNKNOWN)):
            self._buf[c][0] = value
        self.base, self._where[1], self.n = node_id, 0, 1
        self._views()


class NodeView:
    """One node of a tree, read (and for `injected`, `expanded`, `target_next`, `q`, `target_p` written)
    through to the arrays. For cold paths: the hot path works on whole columns."""

    def __init__(self, tree: Tree, node_id: int) -> None:
        self._tree, self.id = tree, node_id

    def _get(self, column: str):
        return getattr(self._tree.a, column)[self._tree.row(self.id)].item()

    def _set(self, column: str, value) -> None:
        getattr(self._tree.a, column)[self._tree.row(self.id)] = value

    parent = property(lambda self: self._get("parent"))
    token = property(lambda self: self._get("token"))
    depth = property(lambda self: self._get("depth"))
    score = property(lambda self: self._get("score"))
    injected = property(lambda self: self._get("injected"), lambda self, v: self._set("injected", bool(v)))
    expanded = property(lambda self: self._get("expanded"), lambda self, v: self._set("expanded", bool(v)))
    asked = property(lambda self: self._get("asked"))

    @property
    def committed(self) -> bool:
        return self.id == self._tree.root

    @property
    def target_next(self) -> int | None:
        t = self._get("target_next")
        return None if t == NO_TOKEN else t

    @target_next.setter
    def target_next(self, token: int | None) -> None:
        self._set("target_next", NO_TOKEN if token is None else token)

    @property
    def children(self) -> list[int]:
        """Child ids in the order the draft proposed them."""
        return self._tree.children(self.id)

    @property
    def q(self) -> torch.Tensor | None:          # [vocab] draft's warped log-probs here (rejection)
        return self._tree.q.get(self.id)

    @q.setter
    def q(self, value: torch.Tensor | None) -> None:
        self._tree.q[self.id] = value

    @property
    def target_p(self) -> torch.Tensor | None:   # [vocab] target's warped log-probs here (rejection)
        return self._tree.target_p.get(self.id)

    @target_p.setter
    def target_p(self, value: torch.Tensor | None) -> None:
        self._tree.target_p[self.id] = value

    def __repr__(self) -> str:
        return f"NodeView(id={self.id}, token={self.token}, depth={self.depth}, score={self.score:.3f})"


class NodeTable:
    """`tree.nodes`: a read-only mapping id -> NodeView over the live nodes."""

    def __init__(self, tree: Tree) -> None:
        self._tree = tree

    def __getitem__(self, node_id: int) -> NodeView:
        if node_id not in self:
            raise KeyError(node_id)
        return NodeView(self._tree, node_id)

    def get(self, node_id: int, default=None) -> NodeView | None:
        return self[node_id] if node_id in self else default

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, (int, np.integer)) and self._tree.row(int(node_id), strict=False) >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(self._tree.a.id.tolist())

    def __len__(self) -> int:
        return len(self._tree.a.id)

    def keys(self) -> list[int]:
        return self._tree.a.id.tolist()

    def values(self) -> list[NodeView]:
        return [NodeView(self._tree, i) for i in self.keys()]

    def items(self) -> list[tuple[int, NodeView]]:
        return [(i, NodeView(self._tree, i)) for i in self.keys()]
