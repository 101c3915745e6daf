from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StageTrace(_message.Message):
    __slots__ = ("stage", "rows_in", "rows_computed", "compute_ms", "wait_ms")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ROWS_IN_FIELD_NUMBER: _ClassVar[int]
    ROWS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    rows_in: int
    rows_computed: int
    compute_ms: float
    wait_ms: float
    def __init__(self, stage: _Optional[int] = ..., rows_in: _Optional[int] = ..., rows_computed: _Optional[int] = ..., compute_ms: _Optional[float] = ..., wait_ms: _Optional[float] = ...) -> None: ...
