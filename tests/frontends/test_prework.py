"""coordinator/frontends/prework.py: pre-admission work is bounded in all and per client, and refused
before any of it is done."""
from __future__ import annotations

import asyncio
import threading

import pytest

from coordinator.core.admission import Overloaded
from coordinator.frontends.prework import Prework


async def test_work_beyond_the_limits_is_refused_before_it_runs():
    prework = Prework(threads=1, limit=4, per_client=2)
    gate, ran = threading.Event(), []

    def job(name: str) -> str:
        ran.append(name)
        gate.wait(10)
        return name
    held = [asyncio.create_task(prework.run("a", job, "a1")), asyncio.create_task(prework.run("a", job, "a2")),
            asyncio.create_task(prework.run("b", job, "b1"))]
    await asyncio.sleep(0)
    assert prework.busy == 3
    with pytest.raises(Overloaded, match="this client has 2"):
        await prework.run("a", job, "a3")
    held.append(asyncio.create_task(prework.run("c", job, "c1")))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="4 requests are being prepared"):
        await prework.run("d", job, "d1")
    gate.set()
    assert await asyncio.gather(*held) == ["a1", "a2", "b1", "c1"]
    assert sorted(ran) == ["a1", "a2", "b1", "c1"] and prework.busy == 0, "the refused never ran"
    assert await prework.run("d", job, "d1") == "d1"
    prework.close()


async def test_prework_runs_on_its_own_threads_not_the_default_executor():
    prework = Prework(threads=2, limit=4)
    name = await prework.run("", lambda: threading.current_thread().name)
    assert name.startswith("specpipe-prework")
    prework.close()


async def test_a_clients_admitted_requests_count_with_its_work_in_preparation():
    """per_client 2: a client holding one admitted request may have one more being prepared, not two; one
    holding two may have none; another client is not affected."""
    admitted = {"a": 1, "b": 2}
    prework = Prework(threads=2, limit=8, per_client=2, held=lambda client: admitted.get(client, 0))
    gate = threading.Event()
    held = asyncio.create_task(prework.run("a", gate.wait, 10))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="this client has 2 requests being prepared, running or queued"):
        await prework.run("a", str, "a2")
    with pytest.raises(Overloaded, match="this client has 2"):
        prework.admit("b")
    assert await prework.run("c", str, "c1") == "c1"
    gate.set()
    assert await held is True
    admitted["a"] = 0
    assert await prework.run("a", str, "a2") == "a2"
    prework.close()
