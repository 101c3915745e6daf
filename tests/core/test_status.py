"""Closed sets (coordinator/core/status.py): Status mirrors grpc.StatusCode, finish reasons keep their wire
strings, and a Finish built from plain values holds members."""
from __future__ import annotations

import grpc

from coordinator.core.admission import Overloaded
from coordinator.core.schedulers.base import Finish
from coordinator.core.stats import RequestStats
from coordinator.core.status import FinishReason, Status


def test_status_mirrors_grpc_status_codes() -> None:
    assert {s.name: s.value for s in Status} == {c.name: c.value[0] for c in grpc.StatusCode}
    assert Status.of(14) is Status.UNAVAILABLE and Status.of(99) is Status.UNKNOWN


def test_finish_reasons_are_their_wire_strings() -> None:
    assert [str(r) for r in FinishReason] == ["length", "eos", "stop", "cancelled", "error", "failed",
                                              "stage failure"]
    assert f"{FinishReason.EOS}" == "eos" and FinishReason.STOP == "stop"


def test_a_finish_of_plain_values_holds_members() -> None:
    fin = Finish("r", "error", RequestStats(), "boom", 8)
    assert fin.reason is FinishReason.ERROR and fin.error_code is Status.RESOURCE_EXHAUSTED
    assert Finish("r", "eos", RequestStats()).error_code is Status.OK


def test_overloaded_is_no_runtime_error() -> None:
    assert not issubclass(Overloaded, RuntimeError)
