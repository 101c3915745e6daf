"""Admission control (pure): how many requests run at once, how many may wait, and whether their KV fits.

A request asks for `need` KV slots (`kv_need`: the most nodes it can hold at one stage, rounded up the
way stage caches grow). It runs when fewer than `max_active` requests run and the slots reserved by the
running ones plus its own fit in `kv_slots` (the smallest stage's limit; None = no limit); otherwise it
waits in a FIFO queue of at most `max_queue` requests; beyond that it is refused (`Overloaded`, which the
API answers with RESOURCE_EXHAUSTED). A request that could never fit is refused at once.

    a = Admission(max_active=1, max_queue=1, kv_slots=None)
    a.offer("x", 64) -> True (runs)    a.offer("y", 64) -> False (waits)    a.offer("z", 64) -> Overloaded
    a.release("x") -> ["y"]            (y runs now)
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.kv_cache import slots_allocated


class Overloaded(Exception):
    """The server cannot take this request now (queue full; `retryable`) or ever (too large for the KV
    limit; not retryable). Not a RuntimeError: only this refusal may be answered with RESOURCE_EXHAUSTED."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


def kv_need(prompt_tokens: int, max_new_tokens: int, num_stages: int, tree_rows: int) -> int:
    """Slots a request may hold at one stage: its whole sequence plus the speculative rows that can be in
    flight at once (`tree_rows` per micro-batch, S micro-batches), as allocated by a stage cache.

    >>> kv_need(40, 100, 8, 16)   # 140 + 128 = 268 nodes -> a cache of 512 slots
    512
    """
    return slots_allocated(prompt_tokens + max_new_tokens + num_stages * tree_rows)


@dataclass
class Admission:
    max_active: int
    max_queue: int
    kv_slots: int | None = None
    active: dict[str, int] = field(default_factory=dict)                    # request -> reserved slots
    queue: OrderedDict[str, int] = field(default_factory=OrderedDict)       # waiting, oldest first
    held: bool = False       # while re-partitioning: nothing starts, new requests queue (bounded)
    max_per_client: int = 0  # running + queued requests of one client (0: no limit)
    client_of: dict[str, str] = field(default_factory=dict)                 # request -> client, when named

    def __post_init__(self) -> None:
        if self.max_active < 1 or self.max_queue < 0:
            raise ValueError("max_active must be at least 1 and max_queue at least 0")

    @property
    def reserved(self) -> int:
        return sum(self.active.values())

    def offer(self, request_id: str, need: int, client: str = "") -> bool:
        """True: run now. False: queued. Raises Overloaded when the queue is full, it can never fit, or its
        client already has `max_per_client` requests running or queued (`client` "": not counted)."""
        if request_id in self.active or request_id in self.queue:
            raise ValueError(f"request id {request_id} is already admitted")
        if client and self.max_per_client:
            held = self.held_by(client)
            if held >= self.max_per_client:
                raise Overloaded(f"this client already has {held} requests running or queued (limit "
                                 f"{self.max_per_client}); retry when one ends")
        if self.kv_slots is not None and need > self.kv_slots:
            raise Overloaded(f"the request needs {need} KV slots per stage (prompt, max_new_tokens and "
                             f"speculation headroom), more than the {self.kv_slots} a stage holds; "
                             "ask for fewer tokens", retryable=False)
        if not self.queue and self._fits(need):
            self.active[request_id] = need
        elif len(self.queue) >= self.max_queue:
            raise Overloaded(f"server busy: {len(self.active)} requests running and {len(self.queue)} waiting "
                             f"(limits {self.max_active} and {self.max_queue}); retry later")
        else:
            self.queue[request_id] = need
        if client:
            self.client_of[request_id] = client
        return request_id in self.active

    def held_by(self, client: str) -> int:
        """Requests of `client` running or queued."""
        return sum(1 for c in self.client_of.values() if c == client)

    def release(self, request_id: str) -> list[str]:
        """A request ended (or left the queue); returns the queued requests that may start now, in order."""
        self.active.pop(request_id, None)
        self.queue.pop(request_id, None)
        self.client_of.pop(request_id, None)
        started = []
        while self.queue:
            nxt, need = next(iter(self.queue.items()))
            if not self._fits(need):
                break
            del self.queue[nxt]
            self.active[nxt] = need
            started.append(nxt)
        return started

    def hold(self) -> None:
        """Start nothing new until `resume` (running requests go on; new ones wait in the queue)."""
        self.held = True

    def resume(self, kv_slots: int | None) -> list[str]:
        """End a hold with the (new) KV limit; returns the queued requests that may start now."""
        self.held, self.kv_slots = False, kv_slots
        return self.release("")

    def _fits(self, need: int) -> bool:
        if self.held or len(self.active) >= self.max_active:
            return False
        return self.kv_slots is None or self.reserved + need <= self.kv_slots
