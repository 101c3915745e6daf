"""How a request ends, as closed sets: its finish reason and, for a failure, its gRPC status.

The core does not import grpc: `Status` mirrors `grpc.StatusCode` (same names, numbers `value[0]`; a test
holds them equal); the front ends map it back (coordinator/frontends/grpc_api.py `grpc_code`).

    Status.of(14) is Status.UNAVAILABLE     Status.of(99) is Status.UNKNOWN     FinishReason("eos") == "eos"
"""
from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """A gRPC status code by its number (stages send numbers: common/batch.Segment.error_code)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, number: int) -> Status:
        """The status with this number; UNKNOWN for a number gRPC does not define."""
        try:
            return cls(number)
        except ValueError:
            return cls.UNKNOWN


class FinishReason(enum.StrEnum):
    """Why a request ended. The values are the wire's and the logs' strings (`finish_reason`); clients see
    LENGTH, EOS and STOP (the OpenAI API says "stop" for both of the last two); ERROR ends a request with
    a `Status`; the others are reasons a request is cancelled with inside the coordinator."""

    LENGTH = "length"                   # max_new_tokens generated
    EOS = "eos"                         # an end-of-sequence token
    STOP = "stop"                       # a stop string
    CANCELLED = "cancelled"             # the client left
    ERROR = "error"                     # failed: see the Finish's error and error_code
    FAILED = "failed"                   # ended as failed by the engine; its scheduler state is dropped
    STAGE_FAILURE = "stage failure"     # retired with a failed pipeline; it runs again on the next one
