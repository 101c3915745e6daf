"""Unit tests for common/codec.py (tensor <-> bytes) and common/wire.py (dataclass <-> proto)."""
from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protos import common_pb2
from common.batch import Control, MicroBatch, Segment, StageTrace
from common.codec import CodecError, decode_tensor, encode_tensor
from common.wire import (batch_from_proto, batch_to_proto, control_from_proto, control_to_proto,
                           tensor_from_proto, tensor_to_proto)

# Hand-written item sizes (independent of the module's own table) and same-width integer views for
# comparing bit patterns (NaN payloads, -0.0).
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
         "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
         "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bit pattern as a same-width integer tensor."""
    return t.contiguous().view(BITS[t.element_size()]) if t.dtype != torch.bool else t.to(torch.uint8)


def roundtrip(t: torch.Tensor) -> torch.Tensor:
    return decode_tensor(*encode_tensor(t))


# -- literal encodings ------------------------------------------------------------------------------
@pytest.mark.parametrize("t, name, shape, data", [
    (torch.tensor([1.0, -2.0], dtype=torch.float32), "float32", [2], struct.pack("<2f", 1.0, -2.0)),
    (torch.tensor([[1.5], [-0.25]], dtype=torch.float16), "float16", [2, 1], struct.pack("<2e", 1.5, -0.25)),
    (torch.tensor([1.0, -2.0], dtype=torch.bfloat16), "bfloat16", [2], b"\x80\x3f\x00\xc0"),
    (torch.tensor([2**40, -1], dtype=torch.int64), "int64", [2], struct.pack("<2q", 2**40, -1)),
    (torch.tensor([7, -3], dtype=torch.int32), "int32", [2], struct.pack("<2i", 7, -3)),
    (torch.tensor([True, False, True]), "bool", [3], b"\x01\x00\x01"),
    (torch.tensor(7, dtype=torch.int32), "int32", [], b"\x07\x00\x00\x00"),
    (torch.zeros((0, 5), dtype=torch.float32), "float32", [0, 5], b""),
])
def test_encode_literal_and_roundtrip(t: torch.Tensor, name: str, shape: list[int], data: bytes) -> None:
    assert encode_tensor(t) == (name, shape, data)
    out = decode_tensor(name, shape, data)
    assert out.dtype == t.dtype and list(out.shape) == shape
    assert torch.equal(out, t)


def test_bfloat16_bit_exact_including_values_fp16_cannot_hold() -> None:
    # 1e30 / 3.39e38 overflow fp16, 1e-30 and the smallest bf16 subnormal underflow it;
    # also -0.0, -inf and a NaN with payload.
    patterns = [0x3F80, 0x7149, 0x7F7F, 0x0DA2, 0x0001, 0x8000, 0xFF80, 0x7FC1, 0x3F81]
    raw = torch.tensor([p - 0x10000 if p >= 0x8000 else p for p in patterns], dtype=torch.int16)
    t = raw.view(torch.bfloat16)
    assert t[1].item() > 65504 and 0 < t[4].item() < 2**-24          # not representable in fp16
    dtype, shape, data = encode_tensor(t)
    assert (dtype, shape) == ("bfloat16", [9])
    assert data == struct.pack("<9H", *patterns)
    assert torch.equal(decode_tensor(dtype, shape, data).view(torch.int16), raw)


def test_float_nan_and_negative_zero_bits_survive() -> None:
    raw = torch.tensor([0x7FC00001, -2147483648, 0x7F800000], dtype=torch.int32)   # NaN payload, -0.0, inf
    assert torch.equal(bits(roundtrip(raw.view(torch.float32))), raw)


def test_non_contiguous_transpose() -> None:
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4).T             # [4, 3], not contiguous
    assert not t.is_contiguous()
    dtype, shape, data = encode_tensor(t)
    assert (dtype, shape) == ("int64", [4, 3])
    assert data == struct.pack("<12q", 0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11)
    assert torch.equal(decode_tensor(dtype, shape, data), t)


def test_non_contiguous_step_slice_and_offset() -> None:
    base = torch.arange(10, dtype=torch.float32)
    assert encode_tensor(base[::3]) == ("float32", [4], struct.pack("<4f", 0, 3, 6, 9))
    assert encode_tensor(base[7:]) == ("float32", [3], struct.pack("<3f", 7, 8, 9))   # storage offset
    assert torch.equal(roundtrip(base[1::4]), torch.tensor([1.0, 5.0, 9.0]))


def test_scalar_decodes_zero_dim() -> None:
    out = decode_tensor("float64", [], struct.pack("<d", -2.5))
    assert out.dim() == 0 and out.dtype == torch.float64 and out.item() == -2.5


def test_empty_decodes_with_shape_and_dtype() -> None:
    out = decode_tensor("int64", [0, 5], b"")
    assert out.shape == (0, 5) and out.dtype == torch.int64


# -- errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["complex64", "float8", "", "Float32"])
def test_unknown_dtype(dtype: str) -> None:
    with pytest.raises(CodecError, match="unknown tensor dtype"):
        decode_tensor(dtype, [1], b"\x00" * 4)


def test_encode_unsupported_dtype() -> None:
    with pytest.raises(CodecError):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize("shape", [[-1], [2, -2], [-1, -4], [1] * 9])
def test_invalid_shape(shape: list[int]) -> None:
    with pytest.raises(CodecError, match="invalid tensor shape"):
        decode_tensor("uint8", shape, b"\x00" * 8)


@pytest.mark.parametrize("dtype, shape, n", [
    ("float32", [2, 3], 23), ("float32", [2, 3], 25), ("float32", [2, 3], 0),
    ("int64", [], 7), ("int64", [], 9), ("bfloat16", [3], 5), ("bool", [0, 5], 1), ("bool", [4], 3),
])
def test_byte_count_mismatch(dtype: str, shape: list[int], n: int) -> None:
    with pytest.raises(CodecError, match="needs"):
        decode_tensor(dtype, shape, b"\x01" * n)


def test_codec_error_is_value_error() -> None:
    assert issubclass(CodecError, ValueError)


# -- properties -------------------------------------------------------------------------------------
shapes = st.lists(st.integers(0, 4), max_size=4)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(ITEMSIZE)), shape=shapes, data=st.data())
def test_property_roundtrip_exact(name: str, shape: list[int], data: st.DataObject) -> None:
    n = math.prod(shape)
    raw = data.draw(st.binary(min_size=n * ITEMSIZE[name], max_size=n * ITEMSIZE[name]))
    u8 = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = (u8 & 1).bool() if name == "bool" else u8.view(TORCH[name])
    t = t.reshape(shape)
    dtype, eshape, edata = encode_tensor(t)
    assert (dtype, eshape) == (name, shape)
    assert edata == (bytes(b & 1 for b in raw) if name == "bool" else raw)
    out = decode_tensor(dtype, eshape, edata)
    assert out.dtype == TORCH[name] and list(out.shape) == shape
    assert torch.equal(bits(out), bits(t))
    if t.dim() >= 2:                                      # non-contiguous variant
        tt = t.transpose(0, -1)
        assert torch.equal(bits(roundtrip(tt)), bits(tt))


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(ITEMSIZE) + ["complex64", "int4"]),
       shape=st.lists(st.integers(-2, 5), max_size=10), exact=st.booleans(), data=st.data())
def test_property_random_bytes_decode_or_codec_error(name: str, shape: list[int], exact: bool,
                                                     data: st.DataObject) -> None:
    n = math.prod(shape) * ITEMSIZE.get(name, 1)
    if exact and 0 <= n <= 4096:
        raw = data.draw(st.binary(min_size=n, max_size=n))
    else:
        raw = data.draw(st.binary(max_size=64))
    try:
        out = decode_tensor(name, shape, raw)
    except CodecError:
        valid = name in ITEMSIZE and len(shape) <= 8 and all(d >= 0 for d in shape) and n == len(raw)
        assert not valid, "a well-formed tensor was rejected"
        return
    assert list(out.shape) == shape and out.dtype == TORCH[name]


# -- wire -------------------------------------------------------------------------------------------
def test_tensor_proto_roundtrip() -> None:
    t = torch.tensor([[1.0, 1e30], [-3.0, 2.0**-130]], dtype=torch.bfloat16)
    msg = tensor_to_proto(t)
    assert msg.dtype == "bfloat16" and list(msg.shape) == [2, 2] and len(msg.data) == 8
    back = tensor_from_proto(common_pb2.Tensor.FromString(msg.SerializeToString()))
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_tensor_from_proto_bad_bytes() -> None:
    with pytest.raises(CodecError):
        tensor_from_proto(common_pb2.Tensor(dtype="float32", shape=[2], data=b"\x00" * 7))


def make_batch() -> MicroBatch:
    segs = [
        Segment("r1", [0, 1], [-1, 0], [0, 1], [5, 9], [False, True]),
        Segment("r2", [2**40, 2**40 + 1], [7, 7], [3, 3], [11, 12], [True, True]),
        Segment.failed("r3", "node 4 has unknown parent 9", 3, 2),
    ]
    hidden = torch.tensor([[0.5, -1.0], [2.0, 3.0], [1e30, -0.0], [4.0, 1.0]], dtype=torch.bfloat16)
    logprobs = torch.tensor([[-0.1, -2.3, -5.0]] * 3, dtype=torch.float32)
    trace = [StageTrace(0, 4, 4, 1.25, 0.0), StageTrace(1, 4, 3, 0.125, 7.5)]
    return MicroBatch(2**40 + 3, segs, hidden, [9, 1, 2], logprobs, True, trace)


def test_batch_roundtrip_full() -> None:
    b = make_batch()
    msg = type(batch_to_proto(b)).FromString(batch_to_proto(b).SerializeToString())
    back = batch_from_proto(msg)
    assert back.batch_id == 2**40 + 3
    assert back.segments == b.segments
    assert back.segments[2].error == "node 4 has unknown parent 9"
    assert (back.segments[2].error_code, back.segments[2].error_stage, back.segments[2].rows) == (3, 2, 0)
    assert back.hidden is not None and back.hidden.dtype == torch.bfloat16
    assert torch.equal(back.hidden.view(torch.int16), b.hidden.view(torch.int16))
    assert back.argmax == [9, 1, 2]
    assert back.logprobs is not None and torch.equal(back.logprobs, b.logprobs)
    assert back.return_logprobs is True
    assert back.trace == b.trace
    assert back.rows == 4


def test_batch_roundtrip_without_tensors() -> None:
    b = MicroBatch(0, [Segment("r", [0], [-1], [0], [1], [True])])
    back = batch_from_proto(batch_to_proto(b))
    assert back.hidden is None and back.logprobs is None
    assert back.argmax == [] and back.trace == [] and back.return_logprobs is False
    assert back.segments == b.segments


def test_batch_from_proto_corrupt_hidden() -> None:
    msg = batch_to_proto(make_batch())
    msg.hidden.data = msg.hidden.data[:-1]
    with pytest.raises(CodecError):
        batch_from_proto(msg)


@pytest.mark.parametrize("c", [
    Control("r1", [0, 1, 2**40], [5], False),
    Control("r2", [], [], True),
    Control("r3"),
])
def test_control_roundtrip(c: Control) -> None:
    msg = control_to_proto(c)
    back = control_from_proto(type(msg).FromString(msg.SerializeToString()))
    assert back == c


# -- copies -----------------------------------------------------------------------------------------
def test_a_decoded_cpu_tensor_owns_writable_memory() -> None:
    data = struct.pack("<2f", 1.0, -2.0)
    out = decode_tensor("float32", [2], data)
    out.add_(1.0)                                  # would be undefined behaviour on the message's bytes
    assert out.tolist() == [2.0, -1.0] and data == struct.pack("<2f", 1.0, -2.0)


def test_decoding_to_another_device_reads_the_bytes_without_a_warning() -> None:
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = decode_tensor("bfloat16", [3, 2], bytes(12), device="meta")   # no CPU copy, no read-only warning
    assert out.device.type == "meta" and out.dtype == torch.bfloat16 and list(out.shape) == [3, 2]


def test_tensor_to_proto_fills_a_field_in_place() -> None:
    from protos import stage_pb2
    msg = stage_pb2.MicroBatch(batch_id=1)
    filled = tensor_to_proto(torch.tensor([[1.0, -2.0]]), into=msg.hidden)
    assert msg.HasField("hidden") and list(msg.hidden.shape) == [1, 2] and msg.hidden.dtype == "float32"
    assert msg.hidden.data == struct.pack("<2f", 1.0, -2.0) and filled.data == msg.hidden.data
