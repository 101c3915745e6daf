"""The work before a request is admitted — tokenising, chat templates, parsing large JSON, /tokenize — on a
bounded pool of its own, so that a flood of it neither delays the engine's scheduler calls (they keep the
default executor) nor queues without end.

At most `limit` such jobs wait or run at once, and of one client at most `per_client` requests being prepared
or already admitted (`held(client)`: its requests running or queued; 0: no such limit); one more is refused at
once with `Overloaded` (RESOURCE_EXHAUSTED / 429), before any of its work is done — a client at its limit is
not tokenised only to be refused by the admission after.

    prework = Prework(threads=2, limit=64, per_client=8, held=admission.held_by)
    ids = await prework.run("10.0.0.7", tokenizer.encode, text)    # or Overloaded
"""
from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from coordinator.core.admission import Overloaded

T = TypeVar("T")


class Prework:
    def __init__(self, threads: int = 1, limit: int = 64, per_client: int = 0,
                 held: Callable[[str], int] = lambda client: 0) -> None:
        if threads < 1 or limit < 1 or per_client < 0:
            raise ValueError("prework needs at least one thread and a limit of at least 1")
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="specpipe-prework")
        self.limit, self.per_client, self.held = limit, per_client, held
        self.clients: Counter[str] = Counter()      # jobs waiting or running, per client ("" counts in all only)

    @property
    def busy(self) -> int:
        return self.clients.total()

    def admit(self, client: str) -> None:
        """Raise Overloaded where a job of `client` would be refused now (`run` checks again): for work that
        is all pre-admission (/tokenize), refused before its body is even read."""
        if self.busy >= self.limit:
            raise Overloaded(f"{self.limit} requests are being prepared (tokenised, parsed); retry shortly")
        if self.per_client and client and self.clients[client] + self.held(client) >= self.per_client:
            raise Overloaded(f"this client has {self.per_client} requests being prepared, running or queued "
                             "(--max-per-client); retry when one is done")

    async def run(self, client: str, fn: Callable[..., T], *args: Any) -> T:
        self.admit(client)
        self.clients[client] += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
        finally:
            self.clients[client] -= 1
            if not self.clients[client]:
                del self.clients[client]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
