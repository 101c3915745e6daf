"""Checking a generation request against the model and the server's limits (pure; no gRPC)."""
from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass

from services.sampling import GREEDY, Sampling

# Below this, logits / temperature overflows float32 to inf and the warped distribution becomes NaN.
MIN_TEMPERATURE = 1e-5


class InvalidRequest(ValueError):
    """The request cannot be served as asked; the message says what is wrong."""


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_position: int              # the model's context length
    default_max_new_tokens: int
    max_new_tokens_cap: int


@dataclass(frozen=True)
class Params:
    prompt_ids: list[int]
    max_new_tokens: int
    method: str
    stop: tuple[str, ...]
    ignore_eos: bool
    sampling: Sampling = GREEDY


def check(prompt_ids: list[int], max_new_tokens: int | None, method: str, methods: list[str],
          temperature: float, top_p: float, top_k: int, stop: list[str], ignore_eos: bool,
          limits: Limits, seed: int = 0) -> Params:
    """Validate a request. Sampling: temperature 0 is greedy; top_p 0 reads as 1 (unset); seed 0 means
    'pick one' — the seed used is below 2**53 and reported in the stats, so the output can be reproduced."""
    if not prompt_ids:
        raise InvalidRequest("empty prompt: give prompt text or prompt_token_ids")
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})")
    n = limits.default_max_new_tokens if max_new_tokens is None else max_new_tokens
    if n < 1:
        raise InvalidRequest(f"max_new_tokens must be at least 1, got {n}")
    if n > limits.max_new_tokens_cap:
        raise InvalidRequest(f"max_new_tokens {n} is above this server's cap of {limits.max_new_tokens_cap}")
    if len(prompt_ids) + n > limits.max_position:
        raise InvalidRequest(f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({n}) exceeds the "
                             f"model's context of {limits.max_position} tokens")
    if method not in methods:
        raise InvalidRequest(f"unknown method {method!r}; available: {', '.join(sorted(methods))}")
    # the wire carries float32: round here so that stages, draft and stats all see the same values
    temperature, top_p = _f32(temperature), _f32(top_p or 1.0)
    sampling = Sampling(temperature, top_p, top_k, seed)
    try:
        sampling.check()
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise InvalidRequest(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature:g}")
    if not sampling.greedy and not seed:
        sampling = Sampling(temperature, top_p, top_k, secrets.randbelow((1 << 53) - 1) + 1)
    if any(len(s) > 256 for s in stop) or len(stop) > 16:
        raise InvalidRequest("at most 16 stop strings of at most 256 characters each")
    return Params(list(prompt_ids), n, method, tuple(s for s in stop if s), ignore_eos, sampling)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0] if x == x and abs(x) < 3e38 else x
