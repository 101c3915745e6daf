"""KV storage of one stage: per request, K and V for each local layer in node slots.

Rows of the cache are *slots*; a node gets a slot when it is admitted and gives it back when pruned, so
KV never moves. Attention for a row is a boolean mask over slots built from the NodeTable: the committed
prefix up to the row's deepest committed ancestor, plus the row's uncommitted ancestors.

Shapes: k[layer], v[layer]: [capacity, kv_heads, head_dim]; slot_position: [capacity];
committed: [capacity] (bool).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.nodes import Admit, NodeTable, ProtocolError

INITIAL_SLOTS = 64
MiB = 1024 * 1024


class KVExhausted(ProtocolError):
    """The stage's KV limit does not allow the request to grow; it fails with RESOURCE_EXHAUSTED."""
    code = 8       # grpc.StatusCode.RESOURCE_EXHAUSTED


def slots_allocated(nodes: int) -> int:
    """Slots a request's cache holds once `nodes` slots were in use at once (it starts at INITIAL_SLOTS
    and doubles).

    >>> slots_allocated(1), slots_allocated(65), slots_allocated(300)
    (64, 128, 512)
    """
    cap = INITIAL_SLOTS
    while cap < nodes:
        cap *= 2
    return cap


@dataclass
class CacheGeometry:
    num_layers: int        # layers held by this stage
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    initial_slots: int = INITIAL_SLOTS

    @property
    def bytes_per_slot(self) -> int:
        """K and V of one node over this stage's layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class RequestKV:
    """Everything one request holds at one stage. Tensors are allocated with the first row; growth asks
    `reserve` (the stage cache's budget) first, and gives the bytes back (`reserve(-n)`) when the
    allocation itself fails, so the budget counts exactly the tensors held:

        reserve(+n)  ->  torch.zeros ... fails (out of memory)  ->  reserve(-n), re-raise
        the request's tensors, slots and node table are as before the row that asked for them"""
    geometry: CacheGeometry
    reserve: Callable[[int], None] = lambda extra_bytes: None
    table: NodeTable = field(default_factory=NodeTable)
    slot_of: dict[int, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    high_water: int = 0    # slots [0, high_water) have been used at least once
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    slot_position: torch.Tensor | None = None   # [capacity] int64
    committed: torch.Tensor | None = None       # [capacity] bool

    @property
    def capacity(self) -> int:
        return 0 if self.slot_position is None else int(self.slot_position.shape[0])

    def _allocate(self, capacity: int) -> None:
        """Grow to `capacity` slots, keeping the KV of the slots in use. Reserves the extra bytes first (may
        raise KVExhausted) and returns them when building the new tensors fails; nothing changes then."""
        g = self.geometry
        extra = (capacity - self.capacity) * g.bytes_per_slot
        self.reserve(extra)
        try:
            shape = (capacity, g.kv_heads, g.head_dim)
            old = self.high_water
            new_k = [torch.zeros(shape, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]
            new_v = [torch.zeros(shape, dtype=g.dtype, device=g.device) for _ in range(g.num_layers)]
            for i in range(len(self.k)):
                new_k[i][:old] = self.k[i][:old]
                new_v[i][:old] = self.v[i][:old]
            pos = torch.full((capacity,), -1, dtype=torch.int64, device=g.device)
            com = torch.zeros((capacity,), dtype=torch.bool, device=g.device)
            if self.slot_position is not None:
                pos[:old] = self.slot_position[:old]
                com[:old] = self.committed[:old]
        except torch.OutOfMemoryError as e:        # the device is full: this request fails, not the batch
            self.reserve(-extra)
            raise KVExhausted(f"out of device memory growing the KV cache to {capacity} slots "
                              f"({extra / MiB:.1f} MiB more): {str(e).splitlines()[0] if str(e) else 'OOM'}") from e
        except BaseException:
            self.reserve(-extra)
            raise
        self.k, self.v, self.slot_position, self.committed = new_k, new_v, pos, com

    def _take_slot(self) -> int:
        if self.free:
            return self.free.pop()
        if self.high_water == self.capacity:
            self._allocate(max(self.geometry.initial_slots, self.capacity * 2))
        self.high_water += 1
        return self.high_water - 1

    # -- admission and control ----------------------------------------------------------------------
    def admit(self, node_id: int, parent_id: int, position: int) -> int | None:
        """Admit a row; return its slot, or None when the row is dropped. The slot is taken before the
        table holds the row, so a failed allocation (KVExhausted, out of memory) leaves both unchanged."""
        verdict = self.table.judge(node_id, parent_id, position)
        if verdict is Admit.DROP:
            self.table.settle(verdict, node_id, parent_id, position)
            return None
        slot = self._take_slot()
        self.table.settle(verdict, node_id, parent_id, position)
        self.slot_of[node_id] = slot
        self.slot_position[slot] = position
        self.committed[slot] = self.table.nodes[node_id].committed
        return slot

    def commit(self, ids: list[int]) -> None:
        self.table.commit(ids)
        for node_id in ids:                        # (a few nodes a commit: element writes)
            slot = self.slot_of.get(node_id)
            if slot is not None:
                self.committed[slot] = True

    def prune(self, ids: list[int], doomed: list[int] | None = None) -> int:
        freed = self.table.prune(ids, doomed)
        slots = [self.slot_of.pop(node_id) for node_id in freed]
        if slots:                                  # one write (on a GPU one kernel), not one per node
            self.slot_position[torch.tensor(slots, dtype=torch.int64, device=self.slot_position.device)] = -1
            self.free.extend(slots)
        return len(freed)

    # -- attention ----------------------------------------------------------------------------------
    def attention_mask(self, node_ids: list[int]) -> torch.Tensor:
        """Boolean mask [rows, high_water]: True where row i may attend to a slot."""
        hw = self.high_water
        anchors = torch.empty(len(node_ids), dtype=torch.int64)
        rows: list[int] = []
        cols: list[int] = []
        for i, node_id in enumerate(node_ids):
            anchor, path = self.table.visible(node_id)
            anchors[i] = anchor
            for n in path:
                rows.append(i)
                cols.append(self.slot_of[n])
        anchors = anchors.to(self.slot_position.device)
        mask = self.committed[None, :hw] & (self.slot_position[None, :hw] <= anchors[:, None])
        if rows:
            mask[torch.tensor(rows, device=mask.device), torch.tensor(cols, device=mask.device)] = True
        return mask

    def nbytes(self) -> int:
        return self.capacity * self.geometry.bytes_per_slot


class KVCache:
    """All requests held by one stage. The stage runner is its only user. `limit_bytes` (0 = none) caps
    the K/V memory of all requests together; a request whose growth would pass it fails (KVExhausted)."""

    def __init__(self, geometry: CacheGeometry, released_memory: int = 4096, limit_bytes: int = 0) -> None:
        self.geometry = geometry
        self.limit_bytes = limit_bytes
        self.allocated = 0                      # bytes of K/V held by all requests
        self.requests: dict[str, RequestKV] = {}
        self._released: dict[str, None] = {}   # insertion-ordered set of recently released ids
        self._released_memory = released_memory

    def _reserve(self, extra: int) -> None:
        """Count `extra` more bytes of K/V (KVExhausted past the limit); a negative `extra` gives bytes back
        (an allocation that failed after reserving)."""
        if extra > 0 and self.limit_bytes and self.allocated + extra > self.limit_bytes:
            raise KVExhausted(f"KV cache limit of {self.limit_bytes / MiB:.1f} MiB reached "
                              f"({self.allocated / MiB:.1f} MiB held by {len(self.requests)} requests, "
                              f"{extra / MiB:.1f} MiB more needed)")
        self.allocated += extra

    def get(self, request_id: str, create: bool) -> RequestKV | None:
        """The request's state; None if it was released (late rows of an ended request are dropped)."""
        if request_id in self._released:
            return None
        state = self.requests.get(request_id)
        if state is None and create:
            state = self.requests[request_id] = RequestKV(self.geometry, self._reserve)
        return state

    def release(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.allocated -= state.nbytes()
        existed = state is not None
        self._released[request_id] = None
        while len(self._released) > self._released_memory:
            self._released.pop(next(iter(self._released)))
        return existed

    def nbytes(self) -> int:
        return self.allocated
