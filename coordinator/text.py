"""Text in and out: prompts to token ids (chat template or raw), committed ids to streamed text, stop strings.

TextStream turns committed token ids into text deltas as they commit, never emitting a partial UTF-8
character and holding back any tail that could still become a stop string:

    >>> s = TextStream(decode=lambda ids: "".join(map(chr, ids)), stops=["END"])
    >>> s.feed([ord(c) for c in "hi E"])     # "E" could start "END": held back
    ('hi ', False)
    >>> s.feed([ord(c) for c in "ND more"])
    ('', True)
"""
from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0            # characters of the decoded text already emitted
        self.stopped = False

    def feed(self, token_ids: list[int]) -> tuple[str, bool]:
        """Add committed ids; return (text to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        self.ids.extend(token_ids)
        text = self.decode(self.ids)
        hits = [i for stop in self.stops if (i := text.find(stop, max(0, self.sent - len(stop) + 1))) != -1]
        if hits:                                              # the earliest stop string wins
            i = min(hits)
            self.stopped = True
            out = text[self.sent:i] if i > self.sent else ""
            self.sent = max(self.sent, i)
            return out, True
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":    # incomplete multi-byte character
            end -= 1
        hold = max((k for stop in self.stops for k in range(1, len(stop))
                    if text[:end].endswith(stop[:k])), default=0)
        end = max(self.sent, end - hold)
        out, self.sent = text[self.sent:end], end
        return out, False

    def flush(self) -> str:
        """At the end of a request: whatever was held back."""
        if self.stopped:
            return ""
        text = self.decode(self.ids)
        out, self.sent = text[self.sent:], len(text)
        return out


class PromptEncoder:
    """Prompt text -> token ids with the model's tokenizer (and chat template when asked)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str, chat: bool) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send prompt_token_ids instead of prompt text")
        if chat and self.has_chat_template:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation ({"role", "content"} dicts) rendered with the model's chat template, ending with
        the prompt of the assistant's turn. ValueError when there is no template or it refuses the messages
        (say, roles that do not alternate)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send prompt_token_ids instead of prompt text")
        if not self.has_chat_template:
            raise ValueError("this model has no chat template: send a raw prompt instead")
        from jinja2 import TemplateError
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return list(out)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)
