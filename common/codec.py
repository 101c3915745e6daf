"""Tensor <-> bytes codec for the wire (pure torch, no gRPC).

A tensor travels as (dtype name, shape, raw bytes of the C-contiguous array). Every dtype is moved as
its raw byte pattern (viewed as uint8), so bfloat16 — which numpy cannot represent — survives exactly.

    >>> t = torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16)
    >>> decode_tensor(*encode_tensor(t)).equal(t)
    True
"""
from __future__ import annotations

import math
import warnings

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_DIMS = 8


class CodecError(ValueError):
    """Raised for bytes that do not describe a valid tensor."""


def encode_tensor(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """Return (dtype, shape, data) for any CPU or device tensor, contiguous or not."""
    name = NAMES.get(t.dtype)
    if name is None:
        raise CodecError(f"dtype {t.dtype} cannot be sent")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return name, list(t.shape), flat.view(torch.uint8).numpy().tobytes()


def decode_tensor(dtype: str, shape: list[int] | tuple[int, ...], data: bytes,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse of encode_tensor; checks dtype, shape and byte count and raises CodecError on mismatch."""
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise CodecError(f"unknown tensor dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    shape = [int(d) for d in shape]
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise CodecError(f"invalid tensor shape {shape}")
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    expected = math.prod(shape) * itemsize
    if expected != len(data):
        raise CodecError(f"tensor of dtype {dtype} and shape {shape} needs {expected} bytes, got {len(data)}")
    if expected == 0:
        return torch.empty(shape, dtype=torch_dtype, device=device)
    if torch.device(device).type != "cpu":     # one copy, straight from the message's bytes to the device
        with warnings.catch_warnings():        # read-only source: the copy to the device is what is kept
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8)
        return raw.view(torch_dtype).reshape(shape).to(device)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)     # a writable copy the tensor owns
    return raw.view(torch_dtype).reshape(shape)
