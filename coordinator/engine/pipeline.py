"""The one owner of the live pipeline: the one open now, the one a re-partition drains, the lock whoever
replaces it holds, and whether the coordinator is closing. Recovery (recovery.py) and re-partitions
(scaling.py) change the pipeline only through these methods, and only these call the engine's
hold / suspend / restart / swap_transport.

    a re-partition, holding the lock:   drain() -> [suspend() after a drain timeout] -> retire() -> swap(new)
    a recovery, holding the lock:       suspend(failed) -> restart(new)   (suspend() again if that fails)
    the drained pipeline fails:         suspend(failed) from recovery, without the lock (a hand-over: the
                                        re-partition's swap then runs the requests again on its pipeline)

Example: serving on P, a re-partition to 2 stages: drain() (current P, draining P, engine HELD), the
requests finish, retire() (P closed: current None, draining None), swap(Q) (current Q, engine RUNNING).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Generic, TypeVar

from common.tls import TLSFiles

from coordinator.engine.engine import Engine
from coordinator.engine.state import EngineState
from coordinator.engine.transports.base import Pipeline

P = TypeVar("P", bound=Pipeline)


class OwnershipError(RuntimeError):
    """A call against the owner's contract (a bug of its caller): a change of the pipeline from a task that
    does not hold the lock (`replacing`), or out of order."""


class Pipelines(Generic[P]):
    """`open` opens a pipeline over stage addresses (not installed: `restart` / `swap` install it);
    `kv_slots` is the per-request KV budget a pipeline's stages allow (None: no limit); `num_layers` and
    `tls` are what re-configuring the stages needs (scaling.configure, release_held)."""

    def __init__(self, engine: Engine, current: P | None, open: Callable[[list[str]], Awaitable[P]],
                 kv_slots: Callable[[P], int | None], num_layers: int, tls: TLSFiles | None) -> None:
        self.engine = engine
        self.num_layers, self.tls = num_layers, tls
        self._open, self._kv_slots = open, kv_slots
        self._current: P | None = current      # None while replaced, or scaled to zero
        self._draining: P | None = None        # set by drain(), cleared by retire()
        self._lock = asyncio.Lock()
        self._holder: asyncio.Task[object] | None = None
        self._closing = False

    @property
    def current(self) -> P | None:
        """The open pipeline (the engine's transport, except while it is being replaced)."""
        return self._current

    @property
    def draining(self) -> P | None:
        """The pipeline a re-partition is draining: its failure is handed to that re-partition."""
        return self._draining

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def busy(self) -> bool:
        """Whether a task is replacing the pipeline now."""
        return self._lock.locked()

    @asynccontextmanager
    async def replacing(self) -> AsyncIterator[None]:
        """Hold the lock (after whoever holds it now): inside, this task alone may change the pipeline."""
        async with self._lock:
            self._holder = asyncio.current_task()
            try:
                yield
            finally:
                self._holder = None

    def _require_holder(self, what: str) -> None:
        if self._holder is None or self._holder is not asyncio.current_task():
            raise OwnershipError(f"{what} needs the pipeline lock (Pipelines.replacing)")

    async def open(self, addresses: list[str]) -> P:
        """A new pipeline over these stages, not installed (anyone may open one)."""
        return await self._open(addresses)

    def drain(self) -> None:
        """Begin a re-partition (holder): the engine holds new requests (HELD) and the current pipeline is
        the one being drained, so that its failure is handed to this re-partition."""
        self._require_holder("drain")
        self.engine.hold()
        self._draining = self._current

    async def suspend(self, failed: P | None = None) -> set[str]:
        """Take a failed pipeline down: abort it (`failed`, else the current one), stop using it (the
        engine is SUSPENDED: its requests wait for `restart` or `swap`); returns the attempt ids its stages
        may still hold. The holder may call it; anyone may for the pipeline being drained (a hand-over)."""
        if failed is None or failed is not self._draining:
            self._require_holder("suspend")
        target = failed if failed is not None else self._current
        if failed is None or failed is self._current:
            self._current = None
        if target is not None:
            await target.abort()
        return await self.engine.suspend()

    async def retire(self) -> None:
        """End a drain (holder): close the drained pipeline, unless a failure or a drain timeout has taken
        it down already (what is in transit, the releases among it, still reaches the stages)."""
        self._require_holder("retire")
        if self._current is not None:
            await self._current.close()
            self._current = None
        self._draining = None

    async def restart(self, pipeline: P) -> int:
        """After `suspend` (holder): install `pipeline` and run every suspended request again on it;
        returns how many. If this raises, `current` may be set: `suspend()` takes it down again."""
        self._require_holder("restart")
        self._current = pipeline
        return await self.engine.restart(pipeline, self._kv_slots(pipeline))

    async def swap(self, pipeline: P | None, why: str = "") -> None:
        """After `retire` (holder): go on over `pipeline` (requests a failure suspended meanwhile run again
        on it), or over none: every request then fails with UNAVAILABLE and `why`."""
        self._require_holder("swap")
        if self._current is not None:
            raise OwnershipError("swap needs the drained pipeline retired first")
        suspended = self.engine.state is EngineState.SUSPENDED
        if pipeline is None:
            if suspended:                # requests held after a stage failure cannot run anywhere
                self.engine.fail_running(why)
            await self.engine.swap_transport(None, None, why=why)
            return
        self._current = pipeline
        if suspended:
            await self.engine.restart(pipeline, self._kv_slots(pipeline))
        else:
            await self.engine.swap_transport(pipeline, self._kv_slots(pipeline))

    def begin_close(self) -> None:
        """The coordinator is closing: health says so and no re-partition starts (running requests go on)."""
        self._closing = True

    async def close(self) -> None:
        """Close the open pipeline (after the engine closed)."""
        self.begin_close()
        if self._current is not None:
            await self._current.close()
