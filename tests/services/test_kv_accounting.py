"""KV accounting stays exact when an allocation fails (services/kv_cache.py): the bytes a failed growth
reserved are given back, and the request's tensors, slots and node table are as before the row."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from helpers.fuzz_harness import check_invariants
from services.kv_cache import CacheGeometry, KVCache, KVExhausted, RequestKV


def geometry(initial_slots: int = 2) -> CacheGeometry:
    return CacheGeometry(num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32,
                         device=torch.device("cpu"), initial_slots=initial_slots)


class FailOn:
    """Wraps a torch factory; the calls numbered in `failing` (1-based) raise torch's out-of-memory error."""

    def __init__(self, real: Callable[..., torch.Tensor], failing: range | set[int] | None = None) -> None:
        self.real, self.failing, self.calls = real, {1} if failing is None else failing, 0

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.calls += 1
        if self.calls in self.failing:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.real(*args, **kwargs)


def fill(r: RequestKV) -> list[list[float]]:
    """Write recognisable K/V into the slots in use; return them, to compare after a failed growth."""
    for layer in range(len(r.k)):
        for s in range(r.high_water):
            r.k[layer][s] = torch.tensor([[layer * 10.0 + s, 1.0]])
            r.v[layer][s] = torch.tensor([[-(layer * 10.0 + s), 2.0]])
    return [t[:r.high_water].flatten().tolist() for t in r.k + r.v]


# factory, call that fails: the K of the first layer, the V of the last, the slot positions
FAILURES = [("zeros", 1), ("zeros", 4), ("full", 1)]


@pytest.mark.parametrize("factory, nth", FAILURES)
def test_failed_first_allocation_reserves_nothing(monkeypatch: pytest.MonkeyPatch, factory: str,
                                                  nth: int) -> None:
    c = KVCache(geometry())
    r = c.get("a", create=True)
    monkeypatch.setattr(torch, factory, FailOn(getattr(torch, factory), {nth}))
    with pytest.raises(RuntimeError, match="out of memory"):
        r.admit(0, -1, 0)
    assert c.nbytes() == 0 and r.capacity == 0 and r.nbytes() == 0
    assert r.table.nodes == {} and r.slot_of == {} and r.high_water == 0
    assert 0 not in r.table.tombstones          # not dropped: the same row may come again
    assert r.admit(0, -1, 0) == 0               # the next try works (the factory fails only once)
    assert c.nbytes() == r.nbytes() == 2 * geometry().bytes_per_slot
    check_invariants(r)


@pytest.mark.parametrize("factory, nth", FAILURES)
def test_failed_growth_keeps_accounting_and_kv(monkeypatch: pytest.MonkeyPatch, factory: str, nth: int) -> None:
    g = geometry()
    c = KVCache(g)
    r = c.get("a", create=True)
    r.commit([0])
    assert r.admit(0, -1, 0) == 0 and r.admit(1, 0, 1) == 1     # 2 slots: full
    kv = fill(r)
    before = c.nbytes()
    assert before == 2 * g.bytes_per_slot
    monkeypatch.setattr(torch, factory, FailOn(getattr(torch, factory), {nth}))
    with pytest.raises(RuntimeError, match="out of memory"):
        r.admit(2, 1, 2)                                         # needs 4 slots
    assert c.nbytes() == before == r.nbytes() and r.capacity == 2
    assert set(r.table.nodes) == {0, 1} and r.table.nodes[1].children == [] and r.high_water == 2
    assert [t[:2].flatten().tolist() for t in r.k + r.v] == kv
    check_invariants(r)
    assert r.admit(2, 1, 2) == 2                                 # later growth works and keeps the KV
    assert c.nbytes() == r.nbytes() == 4 * g.bytes_per_slot
    assert [t[:2].flatten().tolist() for t in r.k + r.v] == kv
    check_invariants(r)
    assert c.release("a") and c.nbytes() == 0                    # exact down to zero


def test_failed_allocation_does_not_eat_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a limit, bytes of a failed growth stay available: another request can take them."""
    g = geometry()
    c = KVCache(g, limit_bytes=4 * g.bytes_per_slot)
    a = c.get("a", create=True)
    a.admit(0, -1, 0)
    a.admit(1, 0, 1)
    monkeypatch.setattr(torch, "zeros", FailOn(torch.zeros, range(1, 1000)))
    for _ in range(3):                       # each failed retry used to keep 2 more slots reserved
        with pytest.raises(RuntimeError, match="out of memory"):
            a.admit(2, 1, 2)
    monkeypatch.undo()
    assert c.nbytes() == 2 * g.bytes_per_slot
    b = c.get("b", create=True)
    assert b.admit(0, -1, 0) == 0            # 2 more slots: exactly the limit
    assert c.nbytes() == 4 * g.bytes_per_slot == c.limit_bytes
    with pytest.raises(KVExhausted):
        a.admit(2, 1, 2)                     # a real limit refusal still works, and reserves nothing
    assert c.nbytes() == 4 * g.bytes_per_slot and set(a.table.nodes) == {0, 1}
    c.release("b")
    assert a.admit(2, 1, 2) == 2 and c.nbytes() == 4 * g.bytes_per_slot


def test_negative_reserve_gives_bytes_back_without_a_limit_check() -> None:
    c = KVCache(geometry(), limit_bytes=10)
    c._reserve(8)
    c._reserve(-8)
    assert c.nbytes() == 0
    with pytest.raises(KVExhausted):
        c._reserve(11)
    assert c.nbytes() == 0


def test_dropped_row_never_allocates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row that is dropped takes no slot, so it cannot fail on memory either."""
    c = KVCache(geometry())
    r = c.get("a", create=True)
    r.prune([0])
    monkeypatch.setattr(torch, "zeros", FailOn(torch.zeros))
    assert r.admit(0, -1, 0) is None
    assert c.nbytes() == 0 and r.capacity == 0


def test_out_of_device_memory_fails_the_request_as_resource_exhausted(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's OutOfMemoryError while growing becomes KVExhausted (RESOURCE_EXHAUSTED for this request only,
    not INTERNAL for the whole micro-batch); the bytes reserved are given back."""
    c = KVCache(geometry())
    r = c.get("a", create=True)
    real = torch.zeros

    def oom(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(torch, "zeros", oom)
    with pytest.raises(KVExhausted, match="out of device memory growing the KV cache") as err:
        r.admit(0, -1, 0)
    assert err.value.code == 8 and c.nbytes() == 0 and r.capacity == 0
    monkeypatch.setattr(torch, "zeros", real)
    assert r.admit(0, -1, 0) == 0
