"""Text in and out: prompts to token ids (chat template or raw), committed ids to streamed text, stop strings.

TextStream turns committed token ids into text deltas as they commit, never emitting a partial UTF-8
character and holding back any tail that could still become a stop string:

    >>> s = TextStream(decode=lambda ids: "".join(map(chr, ids)), stops=["END"])
    >>> s.feed([ord(c) for c in "hi E"])     # "E" could start "END": held back
    Fed(text='hi ', stopped=False, kept=4)
    >>> s.feed([ord(c) for c in "ND more"])  # "D" (the 2nd id) completes the stop: 2 ids kept
    Fed(text='', stopped=True, kept=2)

Decoding is incremental (the prefix-offset window of vLLM's detokenizer, `tokenizers`' DecodeStream): only
the ids since the last point where the text was complete (no trailing U+FFFD), plus one chunk before it for
context, are decoded again, so a request costs O(tokens), not O(tokens^2) — also when the text keeps ending
in U+FFFD (invalid bytes): past STUCK such ids the window restarts where the text splits cleanly. The text
is the one decoding all ids at once gives, for decoders whose output after a complete character does not
depend on the ids before it (byte-level BPE as in Llama 3 / SmolLM2, SentencePiece with byte fallback).

Stop strings and token ids: a stop string is checked after every token, as if tokens came one at a time —
the earliest-starting stop string in the text up to the first token whose text completes one wins — and
the output ids end with that token: `kept` counts the fed ids up to and including it, and the ids after it
(speculation may commit several in one step) are not part of the output. The text ends just before the
stop string. With stops "END" and one id per character, feeding "xxENDyy" in one chunk keeps 5 ids.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

REPLACEMENT = "\ufffd"      # what decoding puts for an incomplete (or invalid) UTF-8 sequence
STUCK = 16       # ids with the text ending in U+FFFD after which the window is split (TextStream._settle)
TAIL = 8         # ids kept in the window when it is split: more than any one character spans


class Fed(NamedTuple):
    text: str        # text to emit now
    stopped: bool    # a stop string was hit (by this feed or an earlier one)
    kept: int        # how many of the fed ids belong to the output (all, unless a stop string was hit)


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._window: list[int] = []   # ids from the window's start: the previous complete-text point
        self._read = 0                 # window ids before this were read when the window moved
        self._prefix = ""              # decode(window[:read]): subtracted from the window's text
        self._partial = 0              # characters after the prefix already taken (text still incomplete)
        self._pending = ""             # decoded, not emitted yet (held back, or not released yet)

    def feed(self, token_ids: list[int]) -> Fed:
        """Add committed ids; return the text to emit now, whether a stop string was hit, and how many of
        these ids are kept (see the module docstring)."""
        if self.stopped:
            return Fed("", True, 0)
        if not self.stops:
            self._read_ids(token_ids)
            return Fed(self._release(), False, len(token_ids))
        before = self._state()
        self._read_ids(token_ids)
        if self._find_stop() == -1:
            return Fed(self._release(), False, len(token_ids))
        after = self._state()
        self._restore(before)        # a stop string: replay one id at a time to find the one completing it
        for n, token in enumerate(token_ids, 1):
            self._read_ids([token])
            if (i := self._find_stop()) != -1:
                return self._stop(i, n)
        self._restore(after)         # a decoder whose text depends on how ids are grouped: stop here anyway
        return self._stop(self._find_stop(), len(token_ids))

    def flush(self) -> str:
        """At the end of a request: whatever was held back (an incomplete character included)."""
        if self.stopped:
            return ""
        text = self.decode(self._window)
        out = self._pending + text[len(self._prefix) + self._partial:]
        self._pending = ""
        self._window, self._read, self._prefix, self._partial = [], 0, "", 0
        return out

    # -- incremental decoding ------------------------------------------------------------------------
    def _read_ids(self, token_ids: list[int]) -> None:
        """Decode the window with the new ids; move the complete new text into `_pending`."""
        if not token_ids:
            return
        self._window.extend(token_ids)
        text = self.decode(self._window)
        fresh = text[len(self._prefix):]
        complete = not text.endswith(REPLACEMENT)
        usable = fresh if complete else fresh.rstrip(REPLACEMENT)
        if len(usable) > self._partial:
            self._pending += usable[self._partial:]
            self._partial = len(usable)
        if complete:                 # a clean point: the window restarts at the previous one
            self._window = self._window[self._read:]
            self._read = len(self._window)
            self._prefix = self.decode(self._window)
            self._partial = 0
        elif (stuck := len(self._window) - self._read) >= STUCK and stuck % STUCK == 0:
            self._settle(text)       # every STUCK ids at most: a split that fails costs no decode per id

    def _settle(self, text: str) -> None:
        """The text has ended in U+FFFD for STUCK ids or a multiple (invalid bytes, not a character still
        arriving): restart the window TAIL ids from its end, where the text splits — decoding the head and
        the tail apart gives the same text — so each id is decoded a bounded number of times, not once per
        later id. Text of the head not yet taken (its final U+FFFDs) moves to `_pending`.

            window: 16 ids of 0xFF (text: 16 U+FFFD, none taken yet: each might still start a character)
            -> pending gains 8 U+FFFD; the window keeps the last 8 ids
        """
        j = len(self._window) - TAIL
        head = self.decode(self._window[:j])
        tail = self.decode(self._window[j:])
        if head + tail != text:
            return                   # no clean split there (a character spans it): try STUCK ids later
        taken = len(self._prefix) + self._partial      # characters of `text` already in `_pending`
        if taken < len(head):
            self._pending += head[taken:]
        self._window, self._read, self._prefix = self._window[j:], 0, ""
        self._partial = max(0, taken - len(head))

    def _state(self) -> tuple[list[int], int, str, int, str]:
        return list(self._window), self._read, self._prefix, self._partial, self._pending

    def _restore(self, state: tuple[list[int], int, str, int, str]) -> None:
        window, self._read, self._prefix, self._partial, self._pending = state
        self._window = list(window)

    # -- stop strings --------------------------------------------------------------------------------
    def _find_stop(self) -> int:
        """Start of the earliest stop string in the pending text, -1 if none. No stop string can start in
        text already emitted: a tail that could begin one is always held back."""
        return min((i for stop in self.stops if (i := self._pending.find(stop)) != -1), default=-1)

    def _stop(self, at: int, kept: int) -> Fed:
        out = self._pending[:at]
        self.stopped, self._pending = True, ""
        self._window, self._read, self._prefix, self._partial = [], 0, "", 0
        return Fed(out, True, kept)

    def _release(self) -> str:
        """Emit the pending text but for a tail that could still become a stop string."""
        p = self._pending
        hold = max((k for stop in self.stops for k in range(1, len(stop)) if p.endswith(stop[:k])), default=0)
        out, self._pending = p[:len(p) - hold], p[len(p) - hold:]
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
