"""The pipeline owner's contract (coordinator/engine/pipeline.py) and the engine states it drives
(coordinator/engine/state.py), over fake pipelines that record what reaches them: who may change the
pipeline, what drain / suspend / retire / restart / swap leave behind, and that requests follow."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from coordinator.core.schedulers.base import Finish, Request
from coordinator.core.stats import RequestStats, TTFTPhase
from coordinator.core.status import FinishReason, Status
from coordinator.engine.engine import Engine
from coordinator.engine.live import MAX_FRUITLESS, LiveRequest, Requests
from coordinator.engine.pipeline import OwnershipError, Pipelines
from coordinator.engine.state import EngineState, EngineStateError, Unavailable
from helpers.wait import wait_until
from common.batch import Control, MicroBatch

WAIT_S = 10.0      # a bound on waits for conditions, so that a broken run fails instead of hanging


class FakePipeline:
    """Records injected batches and broadcasts; never returns a result (requests stay running)."""

    def __init__(self, name: str, stages: int = 2) -> None:
        self.addresses = [f"{name}-{i}:1" for i in range(stages)]
        self.injected: list[MicroBatch] = []
        self.broadcasts: list[Control] = []
        self.aborted = self.closed = False
        self._injected = asyncio.Event()
        self._results: asyncio.Queue[MicroBatch] = asyncio.Queue()

    @property
    def num_stages(self) -> int:
        return len(self.addresses)

    async def inject(self, batch: MicroBatch) -> None:
        self.injected.append(batch)
        self._injected.set()

    async def broadcast(self, control: Control) -> None:
        self.broadcasts.append(control)

    async def results(self) -> AsyncIterator[MicroBatch]:
        while True:
            yield await self._results.get()

    async def abort(self) -> None:
        self.aborted = True

    async def close(self) -> None:
        self.closed = True

    async def wait_injected(self) -> list[str]:
        """Until a batch went in; the request ids of every batch so far."""
        await asyncio.wait_for(self._injected.wait(), WAIT_S)
        return [s.request_id for b in self.injected for s in b.segments]


async def owner(first: FakePipeline) -> Pipelines[FakePipeline]:
    engine = Engine(first, default_method="pp")
    await engine.start()

    async def open_pipeline(addresses: list[str]) -> FakePipeline:
        return FakePipeline(addresses[0].split("-")[0], len(addresses))
    return Pipelines(engine, first, open_pipeline, lambda p: None, num_layers=4, tls=None)


async def test_only_the_lock_holder_changes_the_pipeline() -> None:
    p_old = FakePipeline("p")
    p = await owner(p_old)
    try:
        for call in (p.drain, p.retire, p.suspend, lambda: p.restart(FakePipeline("q")),
                     lambda: p.swap(FakePipeline("q"))):
            with pytest.raises(OwnershipError, match="lock"):
                result = call()
                if asyncio.iscoroutine(result):
                    await result
        assert p.current is p_old and p.engine.state is EngineState.RUNNING and not p_old.aborted

        async with p.replacing():
            assert p.busy
            p.drain()
        assert not p.busy

        async def other_task() -> None:          # a holder's lock is not another task's
            with pytest.raises(OwnershipError):
                await p.retire()
        async with p.replacing():
            await asyncio.create_task(other_task())
    finally:
        await p.engine.close()


async def test_a_repartition_drains_retires_and_swaps_and_the_queued_request_runs_on_the_new_pipeline() -> None:
    old = FakePipeline("p")
    p = await owner(old)
    try:
        async with p.replacing():
            p.drain()
            assert (p.current, p.draining, p.engine.state) == (old, old, EngineState.HELD)
            assert p.engine.admission.held and not p.engine.serving
            submit = asyncio.create_task(p.engine.submit([1, 2, 3], 4, request_id="a"))
            await wait_until(lambda: "a" in p.engine.admission.queue, WAIT_S, interval=0.005, what="a queued")
            with pytest.raises(OwnershipError, match="retired"):     # the drained pipeline is still open
                await p.swap(FakePipeline("x"))
            await p.retire()
            assert old.closed and not old.aborted and p.current is None and p.draining is None
            new = FakePipeline("q", stages=3)
            await p.swap(new)
            assert p.current is new and p.engine.transport is new and p.engine.state is EngineState.RUNNING
        rid, _ = await asyncio.wait_for(submit, WAIT_S)
        assert rid == "a" and await new.wait_injected() == ["a"] and not old.injected
        assert p.engine.scheduler("pp").num_stages == 3                  # schedulers rebuilt for the depth
    finally:
        await p.engine.close()


async def test_suspend_then_restart_runs_the_request_again_under_a_new_attempt_id() -> None:
    old = FakePipeline("p")
    p = await owner(old)
    try:
        await p.engine.submit([5, 6], 8, request_id="a")
        assert await old.wait_injected() == ["a"]
        async with p.replacing():
            orphans = await p.suspend(old)
            assert "a" in orphans and old.aborted and p.current is None
            assert p.engine.state is EngineState.SUSPENDED and p.engine.transport is old   # its depth stays
            new = FakePipeline("q")
            assert await p.restart(new) == 1
            assert p.current is new and p.engine.state is EngineState.RUNNING
            with pytest.raises(EngineStateError, match="suspended"):     # nothing to run again
                await p.restart(FakePipeline("r"))
        assert await new.wait_injected() == ["a.r1"]
    finally:
        await p.engine.close()


async def test_a_failure_of_the_drained_pipeline_is_handed_over_to_the_repartition() -> None:
    old = FakePipeline("p")
    p = await owner(old)
    try:
        await p.engine.submit([5, 6], 8, request_id="a")
        await old.wait_injected()
        drained, resume = asyncio.Event(), asyncio.Event()

        async def repartition() -> None:
            async with p.replacing():
                p.drain()
                drained.set()
                await asyncio.wait_for(p.engine.drained(), WAIT_S)   # ends: the hand-over suspends
                await resume.wait()
                await p.retire()
                await p.swap(FakePipeline("q"))
        task = asyncio.create_task(repartition())
        await asyncio.wait_for(drained.wait(), WAIT_S)
        with pytest.raises(OwnershipError):                   # not the lock holder, not the drained one
            await p.suspend(FakePipeline("x"))
        await p.suspend(old)                                  # what Recovery._hand_over does
        assert old.aborted and p.current is None and p.engine.state is EngineState.SUSPENDED
        resume.set()
        await asyncio.wait_for(task, WAIT_S)
        assert not old.closed and p.engine.state is EngineState.RUNNING
        assert await p.current.wait_injected() == ["a.r1"]    # swap restarted the suspended request
    finally:
        await p.engine.close()


async def test_swapping_to_no_pipeline_refuses_requests_until_one_comes() -> None:
    old = FakePipeline("p")
    p = await owner(old)
    try:
        await p.engine.submit([5, 6], 8, request_id="a")
        await old.wait_injected()
        async with p.replacing():
            await p.suspend()                                  # a failure, then the stages are gone
            await p.retire()
            await p.swap(None, "scaled to zero")
        assert p.engine.state is EngineState.UNAVAILABLE and p.engine.why == "scaled to zero"
        assert p.engine.active == 0                            # the suspended request failed
        with pytest.raises(Unavailable, match="scaled to zero"):
            await p.engine.submit([1], 2)
        async with p.replacing():
            await p.swap(FakePipeline("q"))
        assert p.engine.serving
    finally:
        await p.engine.close()


async def test_closing_is_said_once_and_closes_the_open_pipeline() -> None:
    old = FakePipeline("p")
    p = await owner(old)
    p.begin_close()
    assert p.closing and not old.closed
    await p.engine.close()
    await p.close()
    assert old.closed


async def test_engine_states_without_recovery() -> None:
    old = FakePipeline("p")
    engine = Engine(old, default_method="pp")
    await engine.start()
    try:
        rid, events = await engine.submit([1, 2], 8, request_id="a")
        engine.fail_all(RuntimeError("results stream broke"))
        fin = await asyncio.wait_for(events.get(), WAIT_S)
        assert isinstance(fin, Finish) and fin.reason is FinishReason.ERROR and fin.error_code is Status.UNAVAILABLE
        assert engine.state is EngineState.FAILED and engine.why == "the pipeline failed: results stream broke"
        engine.hold()                                          # a re-partition of a failed pipeline
        assert engine.state is EngineState.FAILED
        with pytest.raises(Unavailable, match="results stream broke"):
            await engine.submit([1], 2)
        await wait_until(lambda: not engine.admission.active, WAIT_S, interval=0.005, what="a released")
        await engine.swap_transport(FakePipeline("q"), None)
        assert engine.state is EngineState.RUNNING and engine.why == ""
        await engine.submit([1, 2], 8, request_id="b")
        with pytest.raises(EngineStateError, match="drained"):
            await engine.swap_transport(None, None, "no")
    finally:
        await engine.close()


def test_next_attempt_resumes_after_the_streamed_tokens_and_gives_up_without_progress() -> None:
    table = Requests()
    live = LiveRequest(None, asyncio.Queue(), 0.0, Request("a", [1, 2], 20), "pp", None, "a")   # type: ignore[arg-type]
    live.started, live.emitted = True, [7] * 7
    table.add(live)
    assert table.next_attempt(live) == Request("a.r1", [1, 2] + [7] * 7, 13)
    assert table.current("a.r1") is live and table.current("a") is None and table.client("a") is live
    for k in range(1, MAX_FRUITLESS):                          # failures with no token in between
        assert isinstance(table.next_attempt(live), Request) and live.attempt_id == f"a.r{k + 1}"
    end = table.next_attempt(live)
    assert isinstance(end, Finish) and end.reason is FinishReason.ERROR and end.error_code is Status.INTERNAL
    live.cancel_reason = FinishReason.CANCELLED
    assert table.next_attempt(live) == Finish(live.attempt_id, FinishReason.CANCELLED, RequestStats())


def test_ttft_phases_on_hand_set_times_add_up_to_the_ttft_and_count_a_re_run_in_the_pipeline() -> None:
    """Submitted at 0 s, admitted at 0.002, first rows sent at 0.014 (a later send changes nothing), the
    prompt's second chunk (its last row, position 9) back at 5.616 (the first chunk's result at 2.0 does not
    end the phase), first token at 5.624: phases 2 / 12 / 5602 / 8 ms. A re-run before any token moves the
    end of the pipeline phase to the re-run's own prompt result (prompt + the tokens streamed = still 10)."""
    from coordinator.core.schedulers.base import Emit
    from common.batch import Segment

    def batch(rid: str, positions: list[int]) -> MicroBatch:
        return MicroBatch(1, [Segment(rid, positions, [-1] * len(positions), positions, [0] * len(positions),
                                      [False] * len(positions))])

    table = Requests()
    live = LiveRequest(None, asyncio.Queue(), 0.0, Request("a", list(range(10)), 4), "pp", None, "a")   # type: ignore[arg-type]
    table.add(live)
    live.admitted = 0.002
    assert live.ttft_phases() == {}, "no token yet"
    table.sent(batch("a", [0, 1, 2, 3, 4]), 0.014)
    table.sent(batch("a", [5, 6, 7, 8, 9]), 0.5)
    table.returned(batch("a", [0, 1, 2, 3, 4]), 2.0)
    assert live.prefilled is None
    table.returned(batch("a", [5, 6, 7, 8, 9]), 5.616)
    table.emit(Emit("a", [42]), 5.624)
    table.returned(batch("a", [9]), 7.0)                        # after the first token: no change
    phases = live.ttft_phases()
    assert phases == pytest.approx({TTFTPhase.QUEUE: 2.0, TTFTPhase.COORDINATOR: 12.0,
                                    TTFTPhase.PIPELINE: 5602.0, TTFTPhase.EMIT: 8.0})
    stats = live.final_stats(RequestStats(steps=3), 9.0)
    assert sum(phases.values()) == pytest.approx(stats.ttft_ms)
    assert stats.as_dict()["ttft_pipeline_ms"] == phases[TTFTPhase.PIPELINE]

    other = LiveRequest(None, asyncio.Queue(), 0.0, Request("b", list(range(10)), 4), "pp", None, "b")   # type: ignore[arg-type]
    table.add(other)
    other.admitted = 0.0
    table.sent(batch("b", list(range(10))), 0.001)
    table.next_attempt(other)                                   # a stage failed before b's first token
    table.returned(batch("b", list(range(10))), 3.0)            # the failed attempt's result: stale id
    assert other.prefilled is None
    table.returned(batch("b.r1", list(range(10))), 4.0)
    table.emit(Emit("b.r1", [1]), 4.5)
    assert other.ttft_phases()[TTFTPhase.PIPELINE] == pytest.approx(3999.0)
