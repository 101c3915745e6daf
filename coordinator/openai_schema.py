"""OpenAI request bodies -> GenerateInput, generation results -> OpenAI response objects (pure; no I/O).

The HTTP shell (coordinator/openai_api.py) parses JSON, calls `parse_completion` / `parse_chat`, runs
Coordinator.generate and shapes what comes back with `completion` / `chunk` / `usage`. Everything that is
wrong with a request raises ApiError, which carries the HTTP status and OpenAI's error object:

    >>> parse_completion({"prompt": [1, 2], "max_tokens": 4, "temperature": 0}, "m").inp.max_new_tokens
    4
    >>> try:
    ...     parse_completion({"prompt": "hi", "n": 2}, "m")
    ... except ApiError as e:
    ...     print(e.status, e.body()["error"]["param"], e.body()["error"]["code"], "-", e)
    400 n unsupported_parameter - n > 1 is not supported (one choice per request)
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.requests import InvalidRequest
from coordinator.service import GenerateInput, GenerationFailed

FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop"}
# GenerationFailed.code (a gRPC status number) -> HTTP status, OpenAI error type, error code
GRPC_TO_HTTP: dict[int, tuple[int, str, str | None]] = {
    3: (400, "invalid_request_error", None),                    # INVALID_ARGUMENT
    8: (429, "rate_limit_error", "rate_limit_exceeded"),        # RESOURCE_EXHAUSTED
    14: (503, "server_error", "service_unavailable"),           # UNAVAILABLE
}
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}


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


def from_generation_error(e: Exception) -> ApiError:
    """InvalidRequest and what can never succeed -> 400; GenerationFailed by its gRPC code (429, 503, ...;
    500 otherwise)."""
    if isinstance(e, InvalidRequest):
        return bad(str(e))
    code = e.code if isinstance(e, GenerationFailed) else 13
    if isinstance(e, GenerationFailed) and not e.retryable:
        return bad(str(e))                    # e.g. it can never fit the KV limit: 429 would invite retries
    status, type_, err_code = GRPC_TO_HTTP.get(code, (500, "server_error", "internal_error"))
    return ApiError(status, str(e), type_, code=err_code)


@dataclass(frozen=True)
class OpenAIRequest:
    inp: GenerateInput = field(default_factory=GenerateInput)
    stream: bool = False
    include_usage: bool = False          # stream_options.include_usage: a last chunk with the usage
    return_token_ids: bool = False       # extension (as vLLM): choices carry the generated `token_ids`


# -- typed fields -----------------------------------------------------------------------------------
def _get(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise bad(f"'{name}' must be {what}", name)
    return v


def _int(body: dict, name: str) -> int | None:
    return _get(body, name, (int,), "an integer")


def _float(body: dict, name: str, default: float) -> float:
    v = _get(body, name, (int, float), "a number")
    if v is not None and not math.isfinite(v):
        raise bad(f"'{name}' must be a finite number", name)
    return default if v is None else float(v)


def _bool(body: dict, name: str) -> bool:
    return bool(_get(body, name, (bool,), "true or false"))


def _str(body: dict, name: str) -> str:
    return _get(body, name, (str,), "a string") or ""


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return list(v)
    raise bad("'stop' must be a string or a list of strings", "stop")


def _unsupported(body: dict, checks: dict[str, Callable[[Any], bool]]) -> None:
    """Refuse, clearly, the features that would change the answer's meaning if silently ignored."""
    for name, fine in checks.items():
        if body.get(name) is not None and not fine(body[name]):
            raise bad(f"'{name}' is not supported by this server", name, "unsupported_parameter")


_COMMON = {"logit_bias": lambda v: not v, "frequency_penalty": lambda v: v == 0,
           "presence_penalty": lambda v: v == 0}


def _model(body: dict, served: str) -> None:
    model = _str(body, "model")
    if model and model != served:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")


def _common(body: dict, max_new_tokens: int | None) -> tuple[dict, bool, bool, bool]:
    n = _int(body, "n")
    if n is not None and n != 1:
        raise bad("n > 1 is not supported (one choice per request)", "n", "unsupported_parameter")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise bad(f"max_tokens must be at least 1, got {max_new_tokens}", "max_tokens")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    top_k = _int(body, "top_k")
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=_float(body, "temperature", 1.0),
                  top_p=_float(body, "top_p", 1.0), seed=_int(body, "seed") or 0, stop=_stop(body),
                  method=_str(body, "method"), top_k=0 if top_k is None else top_k,
                  ignore_eos=_bool(body, "ignore_eos"))
    include_usage = bool(opts and _bool(opts, "include_usage"))
    return kwargs, _bool(body, "stream"), include_usage, _bool(body, "return_token_ids")


# -- the two endpoints' bodies ----------------------------------------------------------------------
def parse_completion(body: dict, served: str) -> OpenAIRequest:
    """POST /v1/completions: the prompt is raw (no chat template): a string or a list of token ids."""
    _model(body, served)
    _unsupported(body, {**_COMMON, "echo": lambda v: v is False, "logprobs": lambda v: False,
                        "best_of": lambda v: v == 1, "suffix": lambda v: v == ""})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                       # a batch of one
    text, ids = "", []
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("a batch of several prompts is not supported; send one request per prompt", "prompt",
                  "unsupported_parameter")
    else:
        raise bad("'prompt' must be a string or a list of token ids", "prompt")
    if not text and not ids:
        raise bad("empty prompt", "prompt")
    kwargs, stream, usage, ret = _common(body, _int(body, "max_tokens"))
    return OpenAIRequest(GenerateInput(prompt=text, prompt_token_ids=ids, raw=True, **kwargs), stream, usage, ret)


def parse_chat(body: dict, served: str, render: Callable[[list[dict[str, str]]], list[int]]) -> OpenAIRequest:
    """POST /v1/chat/completions: `render` turns the messages into prompt token ids (the chat template)."""
    _model(body, served)
    _unsupported(body, {**_COMMON, "logprobs": lambda v: v is False, "top_logprobs": lambda v: False,
                        "tools": lambda v: not v, "functions": lambda v: not v,
                        "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    max_new = _int(body, "max_completion_tokens")
    kwargs, stream, usage, ret = _common(body, _int(body, "max_tokens") if max_new is None else max_new)
    try:
        ids = render(rendered)
    except ValueError as e:
        raise bad(str(e), "messages") from None
    return OpenAIRequest(GenerateInput(prompt_token_ids=ids, **kwargs), stream, usage, ret)


def _message(m: Any, i: int) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
        raise bad(f"{param} must be an object with a role ({', '.join(sorted(CHAT_ROLES))}) and content", param)
    content = m.get("content")
    if isinstance(content, list):            # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"{param}: only text content parts are supported", param, "unsupported_parameter")
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise bad(f"{param}.content must be a string or a list of text parts", param)
    role = "system" if m["role"] == "developer" else m["role"]
    return {"role": role, "content": content}


# -- responses --------------------------------------------------------------------------------------
def finish_reason(reason: str) -> str:
    return FINISH_REASONS.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(chat: bool, rid: str, created: int, model: str, text: str, reason: str,
               use: dict[str, int], token_ids: list[int] | None) -> dict[str, Any]:
    """The non-streaming answer: one object with one choice and the usage."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason(reason)}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": use}


def chunk(chat: bool, rid: str, created: int, model: str, delta: dict[str, str] | None, text: str,
          reason: str | None, include_usage: bool, token_ids: list[int] | None) -> dict[str, Any]:
    """One streamed event. Chat chunks carry `delta` ({"role"} first, then {"content"}), completions `text`;
    with include_usage every chunk has "usage": null and a last one (choices: []) the usage."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None,
                              "finish_reason": finish_reason(reason) if reason else None}
    if chat:
        choice["delta"] = delta if delta is not None else ({"content": text} if text else {})
    else:
        choice["text"] = text
    if token_ids is not None:
        choice["token_ids"] = token_ids
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = None
    return out
