"""The stage's Prometheus metrics, in one place (prometheus-client's global registry).

Every series carries `stage`, the stage index at the time of the observation (Stage/Configure can change
it). Counters and histograms are updated by the servicer (services/servicer.py); the gauges are read when
scraped from every live servicer (`watch` / `forget`), so several in-process stages (tests) each show
their own, and a runner replaced by Configure is followed.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import Counter, Histogram
from prometheus_client.core import REGISTRY, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.batch import StageTrace
from services.config import StageConfig
from services.runner import StageRunner


class StageServicer(Protocol):
    """What the gauges read of a live stage (services/servicer.py's StageServicer)."""
    config: StageConfig
    runner: StageRunner

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

COMPUTE = Histogram("specpipe_stage_compute_seconds", "Compute time of one micro-batch step (decode, "
                    "layers, head; without the emulated wait)", ["stage"], buckets=STEP_BUCKETS)
WAIT = Histogram("specpipe_stage_wait_seconds", "Emulated stage time waited out after the compute of a step "
                 "(observed only with --stage-time-ms)", ["stage"], buckets=STEP_BUCKETS)
BATCHES = Counter("specpipe_stage_batches", "Micro-batches computed", ["stage"])
ROWS = Counter("specpipe_stage_rows", "Rows of the micro-batches: result=computed, or dropped (pruned or "
               "dead before this stage computed them)", ["stage", "result"])
REJECTED = Counter("specpipe_stage_rejected_batches", "Micro-batches failed back to the coordinator, by "
                   "gRPC status (invalid_argument: malformed input; internal: compute failed)", ["stage", "code"])
SENT_BYTES = Counter("specpipe_stage_sent_bytes", "Serialized MicroBatch bytes sent: hop=next_stage (the "
                     "next stage's Forward stream) or results (the coordinator's Results stream)", ["stage", "hop"])
CONTROL = Counter("specpipe_stage_control_messages", "Control messages (commit / prune / release): "
                  "result=applied or rejected", ["stage", "result"])

_live: "weakref.WeakSet[StageServicer]" = weakref.WeakSet()


def watch(servicer: "StageServicer") -> None:
    """Report this servicer's gauges until `forget` (or until it is garbage)."""
    _live.add(servicer)


def forget(servicer: "StageServicer") -> None:
    _live.discard(servicer)


def step(stage: int, trace: StageTrace, emulated: bool) -> None:
    """A micro-batch step finished at `stage`; `trace` is its own trace entry."""
    s = str(stage)
    COMPUTE.labels(s).observe(trace.compute_ms / 1e3)
    if emulated:
        WAIT.labels(s).observe(trace.wait_ms / 1e3)
    BATCHES.labels(s).inc()
    ROWS.labels(s, "computed").inc(trace.rows_computed)
    ROWS.labels(s, "dropped").inc(trace.rows_in - trace.rows_computed)


class _Gauges(Collector):
    """KV memory in use, its limit, and requests holding KV, per live stage (read at scrape time: plain
    ints the runner keeps, so no lock is needed)."""

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily("specpipe_stage_kv_bytes", "K/V cache memory held by all requests",
                                  labels=["stage"]),
                GaugeMetricFamily("specpipe_stage_kv_limit_bytes", "K/V cache memory limit (0: none)",
                                  labels=["stage"]),
                GaugeMetricFamily("specpipe_stage_active_requests", "Requests holding K/V on the stage",
                                  labels=["stage"]))

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        used, limit, active = self._families()
        for servicer in list(_live):
            stage, cache = [str(servicer.config.stage)], servicer.runner.cache
            used.add_metric(stage, cache.nbytes())
            limit.add_metric(stage, cache.limit_bytes)
            active.add_metric(stage, len(cache.requests))
        return iter((used, limit, active))


REGISTRY.register(_Gauges())
