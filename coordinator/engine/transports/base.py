"""What the engine sends micro-batches over (`Transport`), and what a replaceable pipeline adds (`Pipeline`).

The transport: grpc.py (real stages). The loops that run a scheduler without the engine — stage runners in this
process, a simulated clock — are coordinator/engine/loops/.
Only a `Pipeline` is swapped at run time (coordinator/engine/pipeline.py): the gRPC one.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from common.batch import Control, MicroBatch


class Transport(Protocol):
    @property
    def num_stages(self) -> int: ...

    async def inject(self, batch: MicroBatch) -> None: ...
    async def broadcast(self, control: Control) -> None: ...
    def results(self) -> AsyncIterator[MicroBatch]: ...


class Pipeline(Transport, Protocol):
    """A transport over stages at addresses, that can be dropped at once (after a failure) or closed
    (after a drain: what is in transit still arrives)."""

    @property
    def addresses(self) -> list[str]: ...

    async def abort(self) -> None: ...
    async def close(self) -> None: ...
