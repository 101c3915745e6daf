"""Unit tests for coordinator/core/validate.py: request validation against model and server limits."""
from __future__ import annotations

from typing import Any

import pytest

from coordinator.core.validate import Asked, InvalidRequest, Limits, Params, check, check_prompt_size

LIMITS = Limits(vocab_size=100, max_position=50, default_max_new_tokens=10, max_new_tokens_cap=32)
METHODS = ["greedy", "spec"]


def call(**overrides: Any) -> Params:
    args: dict[str, Any] = dict(prompt_ids=[1, 2, 3], max_new_tokens=5, method="greedy", methods=METHODS,
                                temperature=0.0, top_p=1.0, top_k=0, stop=[], ignore_eos=False,
                                limits=LIMITS)
    args.update(overrides)
    asked = Asked(args["max_new_tokens"], args["method"], args["temperature"], args["top_p"], args["top_k"],
                  args["stop"], args["ignore_eos"], args.get("seed", 0))
    return check(args["prompt_ids"], asked, args["limits"], "greedy", args["methods"])


@pytest.mark.parametrize("overrides, match", [
    (dict(prompt_ids=[]), "empty prompt"),
    (dict(prompt_ids=[5, 100]), r"token id 100 is outside the vocabulary \[0, 100\)"),
    (dict(prompt_ids=[99, 1000]), "token id 1000 is outside"),
    (dict(prompt_ids=[-1, 3]), "token id -1 is outside"),
    (dict(max_new_tokens=0), "max_new_tokens must be at least 1, got 0"),
    (dict(max_new_tokens=-4), "at least 1, got -4"),
    (dict(max_new_tokens=33), "max_new_tokens 33 is above this server's cap of 32"),
    (dict(prompt_ids=[1] * 40, max_new_tokens=11),
     r"prompt \(40 tokens\) plus max_new_tokens \(11\) exceeds the model's context of 50"),
    (dict(prompt_ids=[1] * 41, max_new_tokens=None), r"prompt \(41 tokens\) plus max_new_tokens \(10\)"),
    (dict(method="beam"), "unknown method 'beam'; available: greedy, spec"),
    (dict(methods=[]), "unknown method 'greedy'"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
    (dict(top_p=-0.1), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k must be an integer in \[0, 2147483647\]"),
    (dict(top_k=2 ** 32), r"top_k must be an integer in \[0, 2147483647\] \(0: no limit\), got 4294967296"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(stop=["s"] * 17), "stop: at most 16 strings"),
    (dict(stop=["ok", "x" * 257]), "at most 256 characters"),
    (dict(stop=[7]), "stop: at most 16 strings"),
    (dict(max_new_tokens=2.0), "max_new_tokens must be an integer, got 2.0"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    (dict(max_new_tokens=2 ** 40), "above this server's cap"),
    (dict(temperature=1e39), "temperature must be a finite number, got 1e[+]39"),
    (dict(temperature="0.7"), "temperature must be a finite number"),
    (dict(top_p=float("nan")), "top_p must be a finite number"),
    (dict(seed=2 ** 64), r"seed must be an integer in \[0, 2\*\*64\)"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(prompt_ids=[1, 2.5]), "token id 2.5 is outside"),
    (dict(prompt_ids=[1, True]), "token id True is outside"),
    # sizes before per-token work: 51 ids are refused for their number, not scanned for the bad id
    (dict(prompt_ids=[10 ** 12] * 51), "prompt_token_ids: 51 tokens exceed the model's context of 50"),
])
def test_rejections(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        call(**overrides)


def test_invalid_request_is_value_error() -> None:
    assert issubclass(InvalidRequest, ValueError)


def test_valid_request_defaults_applied() -> None:
    p = call(max_new_tokens=None, method="spec", stop=["x", "", "yz"], ignore_eos=True)
    assert p == Params(prompt_ids=[1, 2, 3], max_new_tokens=10, method="spec", stop=("x", "yz"),
                       ignore_eos=True)


def test_valid_request_explicit_max_new_tokens() -> None:
    p = call(max_new_tokens=7)
    assert p.max_new_tokens == 7 and p.stop == () and p.ignore_eos is False and p.method == "greedy"


@pytest.mark.parametrize("overrides", [
    dict(prompt_ids=[0, 99]),                                # vocab edges
    dict(max_new_tokens=1),
    dict(max_new_tokens=32, prompt_ids=[1] * 18),           # cap and context both exactly reached
    dict(prompt_ids=[1] * 40, max_new_tokens=None),         # 40 + default 10 == 50
    dict(top_p=0.0, top_k=0), dict(top_p=1.0, top_k=50),
    dict(stop=["s"] * 16), dict(stop=["x" * 256]),
])
def test_boundaries_accepted(overrides: dict[str, Any]) -> None:
    assert isinstance(call(**overrides), Params)


def test_sampling_parameters_and_seed() -> None:
    p = call(temperature=0.7, top_p=0.9, top_k=20, seed=42)
    assert (p.sampling.top_k, p.sampling.seed) == (20, 42)
    assert p.sampling.temperature == pytest.approx(0.7) and p.sampling.top_p == pytest.approx(0.9)
    picked = {call(temperature=0.7).sampling.seed for _ in range(5)}
    assert 0 not in picked and len(picked) == 5 and max(picked) < 2 ** 53, "seed 0: the server picks one"
    assert call(temperature=0.0, seed=0).sampling.greedy and call(top_p=0.0).sampling.top_p == 1.0


def test_prompt_ids_copied() -> None:
    prompt = [4, 5]
    p = call(prompt_ids=prompt)
    prompt.append(6)
    assert p.prompt_ids == [4, 5]


def test_top_k_at_or_above_the_vocabulary_is_no_limit() -> None:
    assert call(temperature=0.7, top_k=100, seed=3).sampling.top_k == 0
    assert call(temperature=0.7, top_k=2 ** 31 - 1, seed=3).sampling.top_k == 0
    assert call(temperature=0.7, top_k=99, seed=3).sampling.top_k == 99


def test_text_prompt_size_is_checked_before_tokenising() -> None:
    check_prompt_size("x" * 50 * 64, 0, LIMITS)                       # may fit: tokenise it
    with pytest.raises(InvalidRequest, match="prompt: 3201 characters cannot fit the model's context of 50"):
        check_prompt_size("x" * (50 * 64 + 1), 0, LIMITS)
