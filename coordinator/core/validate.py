"""Checking a generation request against the model and the server's limits (pure; no gRPC)."""
from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass

from common.sampling import GREEDY, Sampling

from coordinator.core.vocabulary import METHODS, Method

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
class Asked:
    """What a request asks for besides its prompt, as the client sent it (unchecked): the front ends fill it
    from their own shapes (coordinator/frontends/service.py `GenerateInput`)."""
    max_new_tokens: int | None = None     # None: the server's default
    method: str = ""                      # "": the server's default (`default_method` of `check`)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] | list[str] = ()
    ignore_eos: bool = False
    seed: int = 0


@dataclass(frozen=True)
class Params:
    prompt_ids: list[int]
    max_new_tokens: int
    method: str
    stop: tuple[str, ...]
    ignore_eos: bool
    sampling: Sampling = GREEDY


INT32_MAX = (1 << 31) - 1           # prompt ids, max_new_tokens and top_k travel as int32
FLOAT32_MAX = 3.4028234663852886e38  # temperature and top_p travel as float32
MAX_PROMPT_CHARS_PER_TOKEN = 64      # a text prompt longer than this x the context cannot fit: refused unread


def check_prompt_size(prompt: str, token_ids_count: int, limits: Limits) -> None:
    """Sizes first, before any per-token work (tokenising, copying, scanning ids)."""
    if token_ids_count > limits.max_position:
        raise InvalidRequest(f"prompt_token_ids: {token_ids_count} tokens exceed the model's context of "
                             f"{limits.max_position}")
    if len(prompt) > limits.max_position * MAX_PROMPT_CHARS_PER_TOKEN:
        raise InvalidRequest(f"prompt: {len(prompt)} characters cannot fit the model's context of "
                             f"{limits.max_position} tokens")


def check(prompt_ids: list[int], asked: Asked, limits: Limits, default_method: str = Method.SPECPIPE.value,
          methods: tuple[str, ...] | list[str] = METHODS) -> Params:
    """Validate a request against what the wire and the model can carry; every refusal names the field.
    Sampling: temperature 0 is greedy; top_p 0 reads as 1 (unset); top_k at or above the vocabulary size is
    no limit (0); seed 0 means 'pick one' — the seed used is below 2**53 and reported in the stats, so the
    output can be reproduced.

        check([1, 2], Asked(8, "pp", temperature=0.7, top_k=10**12), Limits(100, 64, 16, 32))
        -> InvalidRequest("top_k must be an integer in [0, 2147483647] (0: no limit), got 1000000000000")
        check([1, 2], Asked(), Limits(100, 64, 16, 32)).max_new_tokens -> 16 (the default), method "specpipe"
    """
    max_new_tokens, method, stop = asked.max_new_tokens, asked.method or default_method, list(asked.stop)
    temperature, top_p, top_k, seed = asked.temperature, asked.top_p, asked.top_k, asked.seed
    if not prompt_ids:
        raise InvalidRequest("empty prompt: give prompt text or prompt_token_ids")
    check_prompt_size("", len(prompt_ids), limits)
    n = limits.default_max_new_tokens if max_new_tokens is None else max_new_tokens
    if not _is_int(n):
        raise InvalidRequest(f"max_new_tokens must be an integer, got {n!r}")
    if n < 1:
        raise InvalidRequest(f"max_new_tokens must be at least 1, got {n}")
    if n > limits.max_new_tokens_cap:
        raise InvalidRequest(f"max_new_tokens {n} is above this server's cap of {limits.max_new_tokens_cap}")
    if len(prompt_ids) + n > limits.max_position:
        raise InvalidRequest(f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({n}) exceeds the "
                             f"model's context of {limits.max_position} tokens")
    if len(stop) > 16 or any(not isinstance(s, str) or len(s) > 256 for s in stop):
        raise InvalidRequest("stop: at most 16 strings of at most 256 characters each")
    if method not in methods:
        raise InvalidRequest(f"unknown method {method!r}; available: {', '.join(sorted(methods))}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= FLOAT32_MAX:
            raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    if not _is_int(top_k) or not 0 <= top_k <= INT32_MAX:
        raise InvalidRequest(f"top_k must be an integer in [0, {INT32_MAX}] (0: no limit), got {top_k!r}")
    if not _is_int(seed) or not 0 <= seed < 1 << 64:
        raise InvalidRequest(f"seed must be an integer in [0, 2**64), got {seed!r}")
    bad = next((t for t in prompt_ids if not (_is_int(t) and 0 <= t < limits.vocab_size)), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {bad!r} is outside the vocabulary [0, {limits.vocab_size})")
    # the wire carries float32: round here so that stages, draft and stats all see the same values
    temperature, top_p = _f32(float(temperature)), _f32(float(top_p or 1.0))
    sampling = Sampling(temperature, top_p, 0 if top_k >= limits.vocab_size else top_k, seed)
    try:
        sampling.check()
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise InvalidRequest(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature:g}")
    if not sampling.greedy and not seed:
        sampling = Sampling(temperature, top_p, sampling.top_k, secrets.randbelow((1 << 53) - 1) + 1)
    return Params(list(prompt_ids), n, method, tuple(s for s in stop if s), asked.ignore_eos, sampling)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0] if x == x and abs(x) < 3e38 else x
