"""vLLM's endpoints beside the OpenAI API, and the X-Request-Id header (pure; the HTTP shell in
coordinator/frontends/openai/api.py runs these in a worker thread):

    POST /tokenize    {"model", "prompt", "add_special_tokens"?: true, "return_token_strs"?: false}
                   or {"model", "messages", "add_generation_prompt"?: true, "continue_final_message"?,
                       "chat_template_kwargs"?, "add_special_tokens"?: false, "return_token_strs"?}
                      -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model", "tokens"} -> {"prompt"}

A prompt is tokenized exactly as /v1/completions and /v1/chat/completions tokenize it, so `count` is their
`usage.prompt_tokens`. /detokenize keeps special tokens, so it gives /tokenize's text back:

    >>> from coordinator.frontends.openai.schema import ParseContext
    >>> ctx = ParseContext(("m",), context=64, cap=32, encode=lambda text, special: list(text.encode()))
    >>> tokenize({"model": "m", "prompt": "hi"}, ctx)
    {'count': 2, 'max_model_len': 64, 'tokens': [104, 105], 'token_strs': None}
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from coordinator.frontends.openai.fields import bad, flag, refuse_unsupported
from coordinator.frontends.openai.schema import (ParseContext, chat_options, fits_messages, fits_prompt,
                                                 parse_messages, served_model)

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")      # UUIDs, trace ids, base64


def client_request_id(value: str | None) -> str:
    """The client's X-Request-Id ("" when it sent none); 400 unless 1-128 letters, digits or ._:/+=-.

    >>> client_request_id("7f0c-ab.12"), client_request_id(None)
    ('7f0c-ab.12', '')
    """
    if value is None:
        return ""
    if not REQUEST_ID.fullmatch(value):
        raise bad(f"{REQUEST_ID_HEADER} must be 1 to 128 letters, digits or ._:/+=- characters",
                  REQUEST_ID_HEADER, "invalid_request_id")
    return value


def tokenize(body: dict, ctx: ParseContext, token_strs: Callable[[list[int]], list[str]] | None = None
             ) -> dict[str, Any]:
    """POST /tokenize: a raw prompt or a conversation -> its token ids (`token_strs`: ids -> the tokens'
    strings, for return_token_strs)."""
    served_model(body, ctx.names)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad("give 'prompt' (a string) or 'messages', one of them", "prompt")
    try:
        if has_prompt:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise bad("'prompt' must be a string", "prompt")
            fits_prompt(prompt, ctx)                # sizes first, before tokenizing
            ids = ctx.encode(prompt, flag(body, "add_special_tokens", True))
        else:
            refuse_unsupported(body)                # tools, chat_template, ...
            messages = parse_messages(body)
            fits_messages(messages, ctx)
            ids = ctx.render(messages, chat_options(body))
        strs = token_strs(ids) if flag(body, "return_token_strs") and token_strs is not None else None
    except ValueError as e:
        raise bad(str(e), "prompt" if has_prompt else "messages") from None
    return {"count": len(ids), "max_model_len": ctx.context, "tokens": ids, "token_strs": strs}


def detokenize(body: dict, ctx: ParseContext, vocab_size: int, decode: Callable[[list[int]], str]
               ) -> dict[str, str]:
    """POST /detokenize: token ids (each in the model's vocabulary) -> text."""
    served_model(body, ctx.names)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("'tokens' must be a list of token ids", "tokens")
    outside = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise bad(f"token id {outside} is outside the vocabulary [0, {vocab_size})", "tokens")
    try:
        return {"prompt": decode(tokens)}
    except ValueError as e:
        raise bad(str(e), "tokens") from None
