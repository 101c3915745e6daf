"""OpenAI request fields: ApiError (OpenAI's error object), typed getters that name the field they refuse,
and the sampling fields this server does not implement, refused with 400 unless at their neutral value
(so a result never silently differs from what was asked; vLLM's extensions included):

    >>> refuse_unsupported({"presence_penalty": 0, "n": 1, "repetition_penalty": 1.0})     # neutral: fine
    >>> try:
    ...     refuse_unsupported({"min_p": 0.1})
    ... except ApiError as e:
    ...     print(e.status, e.param, e.code, "-", e)
    400 min_p unsupported_parameter - 'min_p' is not supported by this server (only 0)

Fields that do not change the tokens (user, metadata, store, service_tier, parallel_tool_calls,
reasoning_effort, prediction, web_search_options, request_id, priority, cache_salt, ...) and unknown
fields are ignored.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


class ApiError(Exception):
    """A request the API answers with an error: HTTP status plus OpenAI's {"error": {...}} object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# -- typed fields -----------------------------------------------------------------------------------
def get(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise bad(f"'{name}' must be {what}", name)
    return v


def integer(body: dict, name: str) -> int | None:
    return get(body, name, (int,), "an integer")


def number(body: dict, name: str, default: float) -> float:
    v = get(body, name, (int, float), "a number")
    if v is not None and not math.isfinite(v):
        raise bad(f"'{name}' must be a finite number", name)
    return default if v is None else float(v)


def flag(body: dict, name: str, default: bool = False) -> bool:
    v = get(body, name, (bool,), "true or false")
    return default if v is None else bool(v)


def string(body: dict, name: str) -> str:
    return get(body, name, (str,), "a string") or ""


def stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    raise bad("'stop' must be a string or a list of strings", "stop")


# -- what is not implemented ------------------------------------------------------------------------
def _equals(x: float) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == x


def _is(x: bool | str) -> Callable[[Any], bool]:
    return lambda v: v is x if isinstance(x, bool) else v == x


def _empty(v: Any) -> bool:
    return isinstance(v, (dict, list, str)) and not v


def _never(v: Any) -> bool:
    return False


_NO_CONSTRAINTS = (_never, "no constrained decoding")
_NO_LOGPROBS = "no log probabilities are returned"
# field -> (is the value neutral, i.e. the same as leaving it out; what is accepted). null is always fine.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_equals(1), "only 1: one choice per request"),
    "best_of": (_equals(1), "only 1"),
    "use_beam_search": (_is(False), "only false"),
    "length_penalty": (_equals(1), "only 1"),
    "frequency_penalty": (_equals(0), "only 0"),
    "presence_penalty": (_equals(0), "only 0"),
    "repetition_penalty": (_equals(1), "only 1"),
    "min_p": (_equals(0), "only 0"),
    "min_tokens": (_equals(0), "only 0"),
    "logit_bias": (_empty, "only {}"),
    "stop_token_ids": (_empty, "only []; stop strings are supported"),
    "bad_words": (_empty, "only []"),
    "allowed_token_ids": (_never, "only null"),
    "logits_processors": (_empty, "only []"),
    "include_stop_str_in_output": (_is(False), "only false"),
    "skip_special_tokens": (_is(True), "only true"),
    "spaces_between_special_tokens": (_is(True), "only true"),
    "logprobs": (_is(False), _NO_LOGPROBS),
    "top_logprobs": (_equals(0), _NO_LOGPROBS),
    "prompt_logprobs": (_never, _NO_LOGPROBS),
    "echo": (_is(False), "only false"),
    "suffix": (_is(""), "only an empty string"),
    "response_format": (lambda v: isinstance(v, dict) and v.get("type") == "text", 'only {"type": "text"}'),
    "guided_json": _NO_CONSTRAINTS, "guided_regex": _NO_CONSTRAINTS, "guided_choice": _NO_CONSTRAINTS,
    "guided_grammar": _NO_CONSTRAINTS, "structural_tag": _NO_CONSTRAINTS, "structured_outputs": _NO_CONSTRAINTS,
    "tools": (_empty, "no tool calling"),
    "tool_choice": (lambda v: v in ("none", "auto"), "no tool calling"),
    "functions": (_empty, "no function calling"),
    "function_call": (lambda v: v in ("none", "auto"), "no function calling"),
    "chat_template": (_never, "the model's own chat template is used"),
    "documents": (_empty, "only []"),
    "audio": (_never, "text output only"),
    "modalities": (lambda v: v == ["text"], "text output only"),
    "prompt_embeds": (_never, "send text or token ids"),
}


def refuse_unsupported(body: dict) -> None:
    """400 naming the first field that asks for something not implemented."""
    for name, (neutral, accepted) in UNSUPPORTED.items():
        if body.get(name) is not None and not neutral(body[name]):
            raise bad(f"'{name}' is not supported by this server ({accepted})", name, "unsupported_parameter")
