"""Prompts as the OpenAI API (and vLLM) tokenizes them: a raw text prompt with the tokenizer's special
tokens (BOS) unless `add_special_tokens` is false; a conversation rendered with the model's chat template
(with add_generation_prompt, continue_final_message and chat_template_kwargs), tokenized without adding
special tokens (the template has them) unless asked. Used by /v1/completions, /v1/chat/completions and
/tokenize; every method raises ValueError with a message for the client (-> 400)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# apply_chat_template's own arguments: not for chat_template_kwargs to set
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class ChatOptions:
    add_generation_prompt: bool = True          # end with the header of the assistant's turn
    continue_final_message: bool = False        # leave the last (assistant) message open to continue it
    add_special_tokens: bool = False            # the template already has them
    template_kwargs: dict[str, Any] = field(default_factory=dict)   # chat_template_kwargs


class Prompts:
    """The model's tokenizer (None: the model has none) as the OpenAI API uses it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _tok(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as a list of token ids")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok().encode(text, add_special_tokens=add_special_tokens))

    def render(self, messages: list[dict[str, str]], chat: ChatOptions) -> list[int]:
        """The conversation's prompt token ids."""
        tok = self._tok()
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template: send a raw prompt to /v1/completions instead")
        if chat.add_generation_prompt and chat.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        if chat.continue_final_message and messages[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(chat.template_kwargs))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        from jinja2 import TemplateError
        try:
            text = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=chat.add_generation_prompt,
                                           continue_final_message=chat.continue_final_message,
                                           **chat.template_kwargs)
        except (TemplateError, TypeError) as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None
        return self.encode(text, chat.add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """As vLLM's /detokenize: special tokens included, so that /tokenize's ids give the text back."""
        try:
            return str(self._tok().decode(ids, skip_special_tokens=False))
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"cannot decode these token ids: {e}") from None

    def token_strs(self, ids: list[int]) -> list[str]:
        return [str(t) for t in self._tok().convert_ids_to_tokens(ids)]
