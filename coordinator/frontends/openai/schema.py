"""OpenAI request bodies -> GenerateInput, generation results -> OpenAI response objects (pure; no I/O).

The HTTP shell (api.py, this folder) parses JSON, calls `parse_completion` / `parse_chat` (in a worker thread:
they tokenize the prompt), runs Coordinator.generate and shapes what comes back with `completion` / `chunk` /
`usage`. Everything wrong with a request raises ApiError, which carries the HTTP status and OpenAI's
error object. Unset fields take the model's generation_config.json defaults (`ParseContext.defaults`), else
OpenAI's (temperature 1, top_p 1); an unset max_tokens is the rest of the context, at most the server's cap:

    >>> ctx = ParseContext(("m",), context=64, cap=32, encode=lambda text, special: list(text.encode()))
    >>> parse_completion({"prompt": [1, 2], "max_tokens": 4, "temperature": 0}, ctx).inp.max_new_tokens
    4
    >>> [parse_completion({"prompt": p}, ctx).inp.max_new_tokens for p in ["hi", "a" * 40]]   # cap, context
    [32, 24]
    >>> try:
    ...     parse_completion({"prompt": "hi", "n": 2}, ctx)
    ... except ApiError as e:
    ...     print(e.status, e.body()["error"]["param"], e.body()["error"]["code"], "-", e)
    400 n unsupported_parameter - 'n' is not supported by this server (only 1: one choice per request)
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.frontends.openai.defaults import GenerationDefaults
from coordinator.frontends.openai.fields import (ApiError, bad, flag, get, integer, number, refuse_unsupported, stops,
                                       string)
from coordinator.frontends.openai.prompt import ChatOptions
from coordinator.core.status import FinishReason, Status
from coordinator.core.validate import MAX_PROMPT_CHARS_PER_TOKEN, InvalidRequest
from coordinator.frontends.service import GenerateInput, GenerationFailed

__all__ = ["ApiError", "ParseContext", "OpenAIRequest", "parse_completion", "parse_chat", "parse_messages",
           "chat_options", "served_model", "from_generation_error", "completion", "chunk", "usage"]

FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop"}
# GenerationFailed.code -> HTTP status, OpenAI error type, error code
GRPC_TO_HTTP: dict[Status, tuple[int, str, str | None]] = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    Status.UNAVAILABLE: (503, "server_error", "service_unavailable"),
}
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}


def from_generation_error(e: Exception) -> ApiError:
    """InvalidRequest and what can never succeed -> 400; GenerationFailed by its gRPC code (429, 503, ...;
    500 otherwise)."""
    if isinstance(e, InvalidRequest):
        return bad(str(e))
    code = e.code if isinstance(e, GenerationFailed) else Status.INTERNAL
    if isinstance(e, GenerationFailed) and not e.retryable:
        return bad(str(e))                    # e.g. it can never fit the KV limit: 429 would invite retries
    status, type_, err_code = GRPC_TO_HTTP.get(code, (500, "server_error", "internal_error"))
    return ApiError(status, str(e), type_, code=err_code)


def _no_chat(messages: list[dict[str, str]], chat: ChatOptions) -> list[int]:
    raise ValueError("this server has no chat template")


@dataclass(frozen=True)
class ParseContext:
    """What parsing needs from the server: the served model names (the first answers a request that names
    none), the context length, the max_tokens cap, the model's sampling defaults, and the tokenizer
    (coordinator/frontends/openai/prompt.py's Prompts.encode / .render; they raise ValueError)."""
    names: tuple[str, ...]
    context: int
    cap: int
    encode: Callable[[str, bool], list[int]]
    render: Callable[[list[dict[str, str]], ChatOptions], list[int]] = _no_chat
    defaults: GenerationDefaults = GenerationDefaults()


@dataclass(frozen=True)
class OpenAIRequest:
    inp: GenerateInput = field(default_factory=GenerateInput)
    model: str = ""                      # the model id the answer names
    prompt_tokens: int = 0
    stream: bool = False
    include_usage: bool = False          # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool = False       # stream_options.continuous_usage_stats: the usage on every chunk
    return_token_ids: bool = False       # extension (as vLLM): choices carry the generated `token_ids`


def served_model(body: dict, names: tuple[str, ...]) -> str:
    """The model the request names (404 when not served), or the first served name."""
    model = string(body, "model")
    if model and model not in names:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves {', '.join(map(repr, names))}",
                       param="model", code="model_not_found")
    return model or names[0]


# what a message costs a chat template beyond its text (its role's tags): counted, so that many empty messages
# cannot pass for a small request
MESSAGE_CHARS = 16
MAX_TEMPLATE_KWARGS_CHARS = 4096      # chat_template_kwargs, as JSON


def _fits(chars: int, ctx: ParseContext, param: str) -> None:
    """Sizes first, before tokenizing: text this long cannot fit the context."""
    if chars > ctx.context * MAX_PROMPT_CHARS_PER_TOKEN:
        raise bad(f"{param}: {chars} characters cannot fit the model's context of {ctx.context} tokens", param)


def fits_prompt(prompt: str, ctx: ParseContext) -> None:
    _fits(len(prompt), ctx, "prompt")


def fits_messages(messages: list[dict[str, str]], ctx: ParseContext) -> None:
    """A conversation's size before its template is rendered: every field, and each message's own cost.

        300,000 empty `tool` messages: 300,000 x (4 + 16) characters > 8192 x 64 -> 400, nothing rendered
    """
    if len(messages) > ctx.context:
        raise bad(f"messages: {len(messages)} messages cannot fit the model's context of {ctx.context} tokens",
                  "messages")
    _fits(sum(len(m["role"]) + len(m["content"]) + MESSAGE_CHARS for m in messages), ctx, "messages")


def _tokenized(tokenize: Callable[[], list[int]], param: str) -> list[int]:
    try:
        return tokenize()
    except ValueError as e:
        raise bad(str(e), param) from None


def _request(body: dict, ctx: ParseContext, model: str, max_new: int | None, param: str,
             tokenize: Callable[[], list[int]]) -> OpenAIRequest:
    """The fields both endpoints share; `tokenize` (the costly part) runs once they are checked."""
    if max_new is not None and max_new < 1:
        raise bad(f"max_tokens must be at least 1, got {max_new}", "max_tokens")
    stream = flag(body, "stream")
    opts = get(body, "stream_options", (dict,), "an object")
    if opts and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = bool(opts) and flag(opts, "include_usage")
    continuous = include_usage and flag(opts, "continuous_usage_stats")
    d = ctx.defaults
    temperature = number(body, "temperature", 1.0 if d.temperature is None else d.temperature)
    top_p = number(body, "top_p", 1.0 if d.top_p is None else d.top_p)
    top_k = integer(body, "top_k")
    top_k = (d.top_k or 0) if top_k is None else 0 if top_k == -1 else top_k      # -1: no limit, as vLLM
    truncate = integer(body, "truncate_prompt_tokens")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise bad("truncate_prompt_tokens must be at least 1 (or -1: the context length)", "truncate_prompt_tokens")
    kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=integer(body, "seed") or 0,
                  stop=stops(body), method=string(body, "method"), ignore_eos=flag(body, "ignore_eos"))
    ret = flag(body, "return_token_ids")
    ids = _tokenized(tokenize, param)
    if truncate is not None:
        ids = ids[-(ctx.context if truncate == -1 else truncate):]
    if not ids:
        raise bad("empty prompt", param)
    if max_new is None:
        rest = ctx.context - len(ids)
        if rest < 1:
            raise bad(f"the prompt ({len(ids)} tokens) fills the model's context of {ctx.context} tokens: no "
                      "room for output", param)
        max_new = min(rest, ctx.cap, d.max_tokens or rest)
    inp = GenerateInput(prompt_token_ids=ids, raw=True, max_new_tokens=max_new, **kwargs)
    return OpenAIRequest(inp, model, len(ids), stream, include_usage, continuous, ret)


# -- the two endpoints' bodies ----------------------------------------------------------------------
def parse_completion(body: dict, ctx: ParseContext) -> OpenAIRequest:
    """POST /v1/completions: the prompt is raw (no chat template): a string, tokenized with the tokenizer's
    special tokens unless add_special_tokens is false, or a list of token ids, taken as they are."""
    model = served_model(body, ctx.names)
    refuse_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                       # a batch of one
    if isinstance(prompt, str) and prompt:
        _fits(len(prompt), ctx, "prompt")
        special = flag(body, "add_special_tokens", True)
        return _request(body, ctx, model, integer(body, "max_tokens"), "prompt",
                        lambda: ctx.encode(prompt, special))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        return _request(body, ctx, model, integer(body, "max_tokens"), "prompt", lambda: ids)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("a batch of several prompts is not supported; send one request per prompt", "prompt",
                  "unsupported_parameter")
    if prompt == "" or prompt == []:
        raise bad("empty prompt", "prompt")
    raise bad("'prompt' must be a string or a list of token ids", "prompt")


def parse_chat(body: dict, ctx: ParseContext) -> OpenAIRequest:
    """POST /v1/chat/completions: the messages rendered with the model's chat template (ctx.render)."""
    model = served_model(body, ctx.names)
    refuse_unsupported(body)
    messages = parse_messages(body)
    fits_messages(messages, ctx)
    chat = chat_options(body)
    max_new = integer(body, "max_completion_tokens")
    return _request(body, ctx, model, integer(body, "max_tokens") if max_new is None else max_new, "messages",
                    lambda: ctx.render(messages, chat))


def chat_options(body: dict) -> ChatOptions:
    """add_generation_prompt (default true; false by default when continue_final_message is true),
    continue_final_message, add_special_tokens (default false) and chat_template_kwargs."""
    kwargs = get(body, "chat_template_kwargs", (dict,), "an object") or {}
    if len(json.dumps(kwargs, default=str)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise bad(f"chat_template_kwargs: more than {MAX_TEMPLATE_KWARGS_CHARS} characters", "chat_template_kwargs")
    cont = flag(body, "continue_final_message")
    return ChatOptions(flag(body, "add_generation_prompt", not cont), cont, flag(body, "add_special_tokens"),
                       dict(kwargs))


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


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


def completion(chat: bool, request_id: str, created: int, model: str, text: str, reason: str,
               use: dict[str, int], token_ids: list[int] | None) -> dict[str, Any]:
    """The non-streaming answer: one object with one choice and the usage."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason(reason)}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": use}


def chunk(chat: bool, request_id: str, created: int, model: str, delta: dict[str, str] | None, text: str,
          reason: str | None, include_usage: bool, token_ids: list[int] | None,
          use: dict[str, int] | None = None) -> dict[str, Any]:
    """One streamed event. Chat chunks carry `delta` ({"role"} first, then {"content"}), completions `text`;
    with include_usage every chunk has a "usage": `use` (null, or the usage so far with
    continuous_usage_stats), and a last one (choices: []) the whole usage."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None,
                              "finish_reason": finish_reason(reason) if reason else None}
    if chat:
        choice["delta"] = delta if delta is not None else ({"content": text} if text else {})
    else:
        choice["text"] = text
    if token_ids is not None:
        choice["token_ids"] = token_ids
    out: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = use
    return out
