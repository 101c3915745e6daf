"""Admission control (pure): running limit, FIFO queue, KV reservation."""
from __future__ import annotations

import pytest

from coordinator.core.admission import Admission, Overloaded, kv_need


def test_runs_queues_then_refuses_and_releases_in_order() -> None:
    a = Admission(max_active=2, max_queue=2)
    assert a.offer("a", 64) and a.offer("b", 64)
    assert not a.offer("c", 64) and not a.offer("d", 64)
    with pytest.raises(Overloaded, match="2 requests running and 2 waiting"):
        a.offer("e", 64)
    assert a.release("b") == ["c"]
    assert a.release("zzz") == []             # unknown ids are harmless
    assert a.release("a") == ["d"]
    assert set(a.active) == {"c", "d"} and not a.queue


def test_a_queued_request_can_leave() -> None:
    a = Admission(max_active=1, max_queue=2)
    a.offer("a", 64)
    a.offer("b", 64)
    a.offer("c", 64)
    assert a.release("b") == []               # b left the queue; a still runs
    assert a.release("a") == ["c"]


def test_kv_reservation_limits_admission_and_refuses_the_impossible() -> None:
    a = Admission(max_active=10, max_queue=5, kv_slots=1024)
    assert a.offer("a", 512) and a.offer("b", 256)
    assert not a.offer("c", 512)              # 512 + 256 + 512 > 1024: waits
    assert not a.offer("d", 64), "FIFO: nobody overtakes a waiting request"
    with pytest.raises(Overloaded, match="more than the 1024"):
        a.offer("e", 2048)
    assert a.release("b") == ["c"]            # 512 + 512 fit; d's 64 more do not
    assert a.reserved == 1024
    assert a.release("a") == ["d"]
    assert a.reserved == 576


def test_kv_need_covers_sequence_and_speculation_and_rounds_like_the_cache() -> None:
    assert kv_need(10, 20, 4, 1) == 64
    assert kv_need(40, 100, 8, 17) == 512      # 40 + 100 + 136 = 276 -> 512
    assert kv_need(64, 0, 1, 0) == 64 and kv_need(65, 0, 1, 0) == 128


def test_per_client_limit_counts_running_and_queued_and_frees_on_release():
    a = Admission(max_active=1, max_queue=4, max_per_client=2)
    assert a.offer("a1", 1, client="alice") is True
    assert a.offer("a2", 1, client="alice") is False          # queued behind a1: still counts
    with pytest.raises(Overloaded, match="already has 2 requests"):
        a.offer("a3", 1, client="alice")
    assert a.offer("b1", 1, client="bob") is False             # other clients are not affected
    assert a.offer("x", 1) is False                            # an unnamed client is not counted
    assert a.release("a1") == ["a2"]
    assert a.offer("a3", 1, client="alice") is False           # a1 ended: alice has one again
    a.release("a2"), a.release("a3"), a.release("b1"), a.release("x")
    assert a.client_of == {} and not a.active and not a.queue
