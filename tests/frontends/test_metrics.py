"""Prometheus metrics: real stages and a coordinator serve a request, /metrics is scraped over HTTP and the
observations are checked against what the request produced (its stream, its stats, the stages' Info).

prometheus-client keeps one global registry per process, shared by the in-process stages and the
coordinator (and by earlier tests), so checks compare a scrape before with one after, per label."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from coordinator.engine.local import free_port, free_ports
from coordinator.config import CoordinatorConfig
from coordinator.core.stats import RequestStats, SpecCounters
from coordinator.core.validate import InvalidRequest
from coordinator.frontends.metrics import RequestMetrics, outcome_of
from coordinator.frontends.server import start
from coordinator.frontends.service import GenerateInput, GenerationFailed
from helpers.pipe import Pipe, prefill
from helpers.stage_servers import stage_servers
from helpers.wait import wait_until, wait_until_blocking
from protos import generation_pb2, generation_pb2_grpc, stage_pb2, stage_pb2_grpc
from common.batch import MicroBatch, Segment
from services.config import MiB, StageConfig
from common.wire import batch_to_proto

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse(r.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture(scope="module")
def metrics_port():
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1")
    yield port
    server.shutdown()
    thread.join(timeout=5)


# -- RequestMetrics on a fake clock -----------------------------------------------------------------

class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_token_gaps_ttft_and_outcome_on_a_fake_clock(metrics_port):
    before = scrape(metrics_port)
    clock = Clock(10.0)
    with RequestMetrics("tree", clock=clock) as m:
        clock.t = 10.5
        m.tokens(2)             # TTFT 0.5; one gap of 0 (second token of the first chunk)
        clock.t = 11.1
        m.tokens(3)             # three gaps of 0.2
        clock.t = 11.5
        m.tokens(1)             # one gap of 0.4
        m.finished("length", RequestStats(steps=12, tokens=6, decode_steps=10, batches=8.0, control_ms=12.0,
                                          sized_width=4, sized_topk=8, sized_calibration=0.8,
                                          spec=SpecCounters(hits=4, misses=2, lag_steps=3, refill_steps=2)))
    after = scrape(metrics_port)
    d = lambda name, **kw: delta(before, after, name, method="tree", **kw)      # noqa: E731
    assert d("specpipe_time_to_first_token_seconds_count") == 1
    assert d("specpipe_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert d("specpipe_time_between_tokens_seconds_count") == 5                     # 6 tokens, 5 gaps
    assert d("specpipe_time_between_tokens_seconds_sum") == pytest.approx(1.0)       # first to last token
    assert d("specpipe_time_between_tokens_seconds_bucket", le="0.0005") == 1
    assert d("specpipe_time_between_tokens_seconds_bucket", le="0.25") == 4
    assert d("specpipe_time_between_tokens_seconds_bucket", le="0.5") == 5
    assert d("specpipe_generated_tokens_total") == 6
    assert d("specpipe_requests_total", outcome="length") == 1
    assert d("specpipe_tokens_per_step_sum") == pytest.approx(0.5)
    assert d("specpipe_decode_tokens_per_step_sum") == pytest.approx(0.5)
    assert d("specpipe_stalled_steps_total", kind="lag") == 3 and d("specpipe_stalled_steps_total", kind="refill") == 2
    assert d("specpipe_draft_hit_rate_sum") == pytest.approx(4 / 6)
    assert d("specpipe_acceptance_length_sum") == pytest.approx(3.0)
    assert d("specpipe_draft_tokens_total", result="hit") == 4 and d("specpipe_draft_tokens_total", result="miss") == 2
    assert d("specpipe_control_seconds_per_step_sum") == pytest.approx(0.0015)   # 12 ms over 8 results
    assert value(after, "specpipe_sized_width", method="tree") == 4               # the cost rule's last width
    assert value(after, "specpipe_sized_topk", method="tree") == 8                # ... and topk
    assert value(after, "specpipe_sized_calibration", method="tree") == pytest.approx(0.8)   # ... its model's fit


def test_outcomes_of_errors_are_bounded_labels(metrics_port):
    assert outcome_of(GeneratorExit()) == outcome_of(asyncio.CancelledError()) == "cancelled"
    assert outcome_of(GenerationFailed("busy", code=8)) == "resource_exhausted"
    assert outcome_of(GenerationFailed("gone", code=14)) == "unavailable"
    assert outcome_of(InvalidRequest("empty prompt")) == "invalid_argument"
    assert outcome_of(KeyError("x")) == "internal"
    before = scrape(metrics_port)
    with pytest.raises(InvalidRequest):
        with RequestMetrics("warp-drive") as m:          # an unknown method is not a new label value
            raise InvalidRequest("unknown method")
    m.record_outcome("length")                           # counted once, with the first outcome
    after = scrape(metrics_port)
    assert delta(before, after, "specpipe_requests_total", method="unknown", outcome="invalid_argument") == 1
    assert delta(before, after, "specpipe_requests_total", method="unknown", outcome="length") == 0


# -- real stages and a coordinator --------------------------------------------------------------------

@pytest.mark.grpc
async def test_a_request_is_reflected_in_coordinator_and_stage_metrics(tiny_model, metrics_port):
    async with stage_servers(str(tiny_model), 2, stage_time_ms="2", kv_limit_mb=64) as (addrs, servicers):
        server, coord = await start(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), port=0,
                                                      max_active=1))
        channels = [grpc.aio.insecure_channel(a) for a in [f"127.0.0.1:{server.port}", *addrs]]
        stub = generation_pb2_grpc.GenerationStub(channels[0])
        stages = [stage_pb2_grpc.StageStub(c) for c in channels[1:]]
        try:
            before = scrape(metrics_port)
            async with servicers[1]._busy:          # stage 1 holds every micro-batch until this block ends
                sent = time.perf_counter()
                first = stub.Generate(generation_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7], max_new_tokens=16, ignore_eos=True, method="specpipe"), timeout=60)
                await wait_until(lambda: stage_holds(stages[0]))              # its prefill is on stage 0
                held = time.perf_counter()                  # its prompt was sent before, its result comes after
                second = stub.Generate(generation_pb2.GenerateRequest(
                    prompt_token_ids=[8, 9], max_new_tokens=4, ignore_eos=True, method="pp"), timeout=60)
                await wait_until(lambda: len(coord.engine.admission.queue) == 1)  # max_active=1: it waits
                queued = time.perf_counter()                # it was submitted before, admitted after `first` ends
                during = await asyncio.to_thread(scrape, metrics_port)
            released = time.perf_counter()
            msgs = await read_all(first)
            window_s = time.perf_counter() - sent            # the request's whole life lies within it
            second_msgs = await read_all(second)
            with pytest.raises(grpc.aio.AioRpcError):                  # a refused request is counted too
                await stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=[5], method="beam")).read()
            infos = await settle(stages)
            after = await asyncio.to_thread(scrape, metrics_port)
        finally:
            for c in channels:
                await c.close()
            await server.stop(0)
            await coord.close()

    assert value(during, "specpipe_active_requests") == 1 and value(during, "specpipe_queued_requests") == 1
    assert value(during, "specpipe_stage_active_requests", stage="0") == 1
    assert value(during, "specpipe_stage_kv_bytes", stage="0") > 0
    assert [t for m in second_msgs for t in m.token_ids] and second_msgs[-1].finish_reason == "length"
    tokens = [t for m in msgs for t in m.token_ids]
    stats = msgs[-1].stats
    assert len(tokens) == 16 and msgs[-1].finish_reason == "length"

    d = lambda name, **kw: delta(before, after, name, **kw)      # noqa: E731
    assert d("specpipe_requests_total", method="specpipe", outcome="length") == 1
    assert d("specpipe_requests_total", method="unknown", outcome="invalid_argument") == 1
    assert d("specpipe_generated_tokens_total", method="specpipe") == 16
    assert d("specpipe_time_to_first_token_seconds_count", method="specpipe") == 1
    assert d("specpipe_time_between_tokens_seconds_count", method="specpipe") == 15
    ttft_s = d("specpipe_time_to_first_token_seconds_sum", method="specpipe")
    tbt_s = d("specpipe_time_between_tokens_seconds_sum", method="specpipe")      # first to last token
    assert ttft_s > 0 and tbt_s > 0 and ttft_s + tbt_s <= window_s
    assert d("specpipe_tokens_per_step_sum", method="specpipe") == pytest.approx(stats.tokens_per_step)
    assert d("specpipe_decode_tokens_per_step_count", method="specpipe") == 1
    assert d("specpipe_control_seconds_per_step_count", method="specpipe") == 1 and stats.counters["control_ms"] > 0
    assert d("specpipe_stalled_steps_total", method="specpipe", kind="lag") == stats.counters["lag_steps"]
    assert d("specpipe_stalled_steps_total", method="specpipe", kind="refill") == stats.counters["refill_steps"]
    hits, misses = stats.counters["hits"], stats.counters["misses"]
    assert d("specpipe_draft_tokens_total", method="specpipe", result="hit") == hits
    assert d("specpipe_draft_hit_rate_sum", method="specpipe") == pytest.approx(hits / (hits + misses))
    # every committed token is an accepted draft token, a bonus, or (the cost rule exploring) a plain one
    assert hits + misses + stats.counters.get("plain_tokens", 0) == 16
    assert d("specpipe_acceptance_length_sum", method="specpipe") == pytest.approx((hits + misses) / max(misses, 1))
    # time to first token in phases: one observation each, adding up to the engine's ttft_ms; the hold at
    # stage 1 is in the first request's pipeline phase, the wait for the first request in the second's queue
    phase = lambda method, p: d("specpipe_time_to_first_token_phase_seconds_sum", method=method, phase=p)  # noqa: E731
    names = ("queue", "coordinator", "pipeline", "emit")
    for method, s_ in (("specpipe", stats), ("pp", second_msgs[-1].stats)):
        for p in names:
            assert d("specpipe_time_to_first_token_phase_seconds_count", method=method, phase=p) == 1, (method, p)
            assert phase(method, p) == pytest.approx(s_.counters[f"ttft_{p}_ms"] / 1e3) and phase(method, p) >= 0
        assert sum(s_.counters[f"ttft_{p}_ms"] for p in names) == pytest.approx(s_.ttft_ms), method
    assert phase("specpipe", "pipeline") >= released - held
    assert phase("pp", "queue") >= released - queued
    # the load gauges are back to zero once the request ended
    assert value(after, "specpipe_active_requests") == 0 and value(after, "specpipe_queued_requests") == 0

    for i, info in enumerate(infos):
        s = str(i)
        assert info.batches > 0
        assert d("specpipe_stage_batches_total", stage=s) == info.batches
        assert d("specpipe_stage_compute_seconds_count", stage=s) == info.batches
        assert d("specpipe_stage_wait_seconds_count", stage=s) == info.batches      # --stage-time-ms 2
        assert d("specpipe_stage_rows_total", stage=s, result="computed") == info.rows_computed
        assert d("specpipe_stage_rows_total", stage=s, result="dropped") == info.rows_dropped
        assert d("specpipe_stage_control_messages_total", stage=s, result="applied") > 0
        assert value(after, "specpipe_stage_active_requests", stage=s) == 0 == info.active_requests
        assert value(after, "specpipe_stage_kv_bytes", stage=s) == info.kv_bytes
        assert value(after, "specpipe_stage_kv_limit_bytes", stage=s) == 64 * MiB
    assert d("specpipe_stage_sent_bytes_total", stage="0", hop="next_stage") > 0
    assert d("specpipe_stage_sent_bytes_total", stage="1", hop="results") > 0
    assert d("specpipe_stage_sent_bytes_total", stage="0", hop="results") == 0


async def read_all(call) -> list:
    msgs = []
    while (m := await call.read()) != grpc.aio.EOF:
        msgs.append(m)
    return msgs


async def stage_holds(stub) -> bool:
    return (await stub.Info(stage_pb2.InfoRequest())).active_requests == 1


async def settle(stubs) -> list[stage_pb2.StageInfo]:
    """Every stage's Info once the request's release has reached all of them."""
    infos: list[stage_pb2.StageInfo] = []

    async def released() -> bool:
        nonlocal infos
        infos = [await s.Info(stage_pb2.InfoRequest()) for s in stubs]
        return not any(i.active_requests for i in infos)
    await wait_until(released, timeout=10, interval=0.05,
                     what=lambda: f"stages free (they hold {[i.active_requests for i in infos]})")
    return infos


@pytest.mark.grpc
async def test_a_cancelled_stream_is_counted_and_releases_its_slot(tiny_model, metrics_port):
    async with stage_servers(str(tiny_model), 2, stage_time_ms="5") as (addrs, _):
        server, coord = await start(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), port=0))
        try:
            before = scrape(metrics_port)
            stream = coord.generate(GenerateInput(prompt_token_ids=[4, 5], max_new_tokens=60, method="pp",
                                                  ignore_eos=True))
            first = await anext(stream)
            await stream.aclose()                 # the client left after its first token
            await wait_until(lambda: not coord.engine.admission.active, timeout=10, what="the slot released")
            after = await asyncio.to_thread(scrape, metrics_port)
        finally:
            await server.stop(0)
            await coord.close()
    assert first.token_ids
    assert delta(before, after, "specpipe_requests_total", method="pp", outcome="cancelled") == 1
    assert delta(before, after, "specpipe_generated_tokens_total", method="pp") == len(first.token_ids)
    assert value(after, "specpipe_active_requests") == 0


@pytest.mark.grpc
async def test_rejected_micro_batches_by_status(tiny_model, metrics_port):
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        async with Pipe(addrs) as pipe:
            before = await asyncio.to_thread(scrape, metrics_port)
            seg = Segment("bad", [0], [-1], [0], [5], [True])
            out = await pipe.send(batch_to_proto(MicroBatch(7, [seg], hidden=torch.zeros(1, 63))), stage=1)
            assert out.segments[0].error
            await pipe.send(prefill("fine", [5, 6]))
            after = await asyncio.to_thread(scrape, metrics_port)
    assert delta(before, after, "specpipe_stage_rejected_batches_total", stage="1", code="invalid_argument") == 1
    assert delta(before, after, "specpipe_stage_rejected_batches_total", stage="0", code="invalid_argument") == 0
    assert delta(before, after, "specpipe_stage_batches_total", stage="1") == 1      # only the good one


# -- the stage process's --metrics-port -----------------------------------------------------------------

def test_stage_metrics_port_flag_and_environment(monkeypatch):
    import argparse

    def parse_args(*argv: str) -> StageConfig:
        p = argparse.ArgumentParser()
        StageConfig.add_arguments(p)
        return StageConfig.from_args(p.parse_args(list(argv)))

    assert parse_args().metrics_port == 0
    assert parse_args("--metrics-port", "9102").metrics_port == 9102
    monkeypatch.setenv("SPECPIPE_METRICS_PORT", "9103")
    assert parse_args().metrics_port == 9103
    with pytest.raises(ValueError, match="metrics_port"):
        parse_args("--metrics-port", "70000")


@pytest.mark.grpc
def test_stage_process_serves_metrics(tiny_model, tmp_path: Path):
    port, metrics = free_ports(2)
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "services.server", "--model", str(tiny_model), "--stage", "0",
                             "--num-stages", "1", "--port", str(port), "--port-file", str(port_file),
                             "--metrics-port", str(metrics), "--kv-limit-mb", "3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_blocking(lambda: port_file.exists() or proc.poll() is not None, timeout=120, interval=0.1,
                            what="the stage's port file")
        assert proc.poll() is None, f"stage did not start: {proc.stderr.read()}"
        samples = scrape(metrics)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert value(samples, "specpipe_stage_kv_limit_bytes", stage="0") == 3 * MiB
    assert value(samples, "specpipe_stage_active_requests", stage="0") == 0
    assert ("specpipe_stage_batches_total", frozenset({("stage", "0")})) not in samples    # nothing computed yet
