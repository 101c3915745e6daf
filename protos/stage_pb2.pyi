from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Segment(_message.Message):
    __slots__ = ("request_id", "node_ids", "parent_ids", "positions", "token_ids", "want_output", "error", "error_code", "error_stage", "temperature", "top_p", "top_k", "seed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WANT_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_STAGE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    node_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_ids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    want_output: _containers.RepeatedScalarFieldContainer[bool]
    error: str
    error_code: int
    error_stage: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, request_id: _Optional[str] = ..., node_ids: _Optional[_Iterable[int]] = ..., parent_ids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., want_output: _Optional[_Iterable[bool]] = ..., error: _Optional[str] = ..., error_code: _Optional[int] = ..., error_stage: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("batch_id", "segments", "hidden", "argmax", "logprobs", "return_logprobs", "trace")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    hidden: _common_pb2.Tensor
    argmax: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _common_pb2.Tensor
    return_logprobs: bool
    trace: _containers.RepeatedCompositeFieldContainer[_common_pb2.StageTrace]
    def __init__(self, batch_id: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., hidden: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., argmax: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., return_logprobs: _Optional[bool] = ..., trace: _Optional[_Iterable[_Union[_common_pb2.StageTrace, _Mapping]]] = ...) -> None: ...

class ForwardSummary(_message.Message):
    __slots__ = ("batches",)
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: int
    def __init__(self, batches: _Optional[int] = ...) -> None: ...

class ResultsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("request_id", "commit", "prune", "release")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    PRUNE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    commit: _containers.RepeatedScalarFieldContainer[int]
    prune: _containers.RepeatedScalarFieldContainer[int]
    release: bool
    def __init__(self, request_id: _Optional[str] = ..., commit: _Optional[_Iterable[int]] = ..., prune: _Optional[_Iterable[int]] = ..., release: _Optional[bool] = ...) -> None: ...

class ControlSummary(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: int
    def __init__(self, messages: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "committed", "live", "node_ids", "tombstones", "kv_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    committed: int
    live: int
    node_ids: _containers.RepeatedScalarFieldContainer[int]
    tombstones: int
    kv_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., committed: _Optional[int] = ..., live: _Optional[int] = ..., node_ids: _Optional[_Iterable[int]] = ..., tombstones: _Optional[int] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("stage", "num_stages", "first_layer", "last_layer", "num_layers_total", "model", "dtype", "device", "vocab_size", "hidden_size", "max_position", "active_requests", "kv_bytes", "next_hop", "requests", "batches", "rows_computed", "rows_dropped", "kv_limit_bytes", "kv_bytes_per_slot")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOP_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ROWS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    ROWS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    KV_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    stage: int
    num_stages: int
    first_layer: int
    last_layer: int
    num_layers_total: int
    model: str
    dtype: str
    device: str
    vocab_size: int
    hidden_size: int
    max_position: int
    active_requests: int
    kv_bytes: int
    next_hop: str
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    batches: int
    rows_computed: int
    rows_dropped: int
    kv_limit_bytes: int
    kv_bytes_per_slot: int
    def __init__(self, stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ..., num_layers_total: _Optional[int] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., max_position: _Optional[int] = ..., active_requests: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., next_hop: _Optional[str] = ..., requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ..., batches: _Optional[int] = ..., rows_computed: _Optional[int] = ..., rows_dropped: _Optional[int] = ..., kv_limit_bytes: _Optional[int] = ..., kv_bytes_per_slot: _Optional[int] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("stage", "num_stages", "first_layer", "last_layer", "next_hop")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOP_FIELD_NUMBER: _ClassVar[int]
    stage: int
    num_stages: int
    first_layer: int
    last_layer: int
    next_hop: str
    def __init__(self, stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., first_layer: _Optional[int] = ..., last_layer: _Optional[int] = ..., next_hop: _Optional[str] = ...) -> None: ...
