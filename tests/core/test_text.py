"""Unit tests for coordinator/core/text.py: TextStream (UTF-8 hold-back, stop strings, kept ids, incremental
decoding) and PromptEncoder. Tokenizers: a byte-level fake here, the real default model's in
tests/core/test_text_real.py."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.text import PromptEncoder, TextStream


def decode(ids: list[int]) -> str:
    """Byte-level fake tokenizer: token id = byte value."""
    return bytes(ids).decode("utf-8", errors="replace")


def ids(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def run(stream: TextStream, chunks: list[str]) -> list[tuple[str, bool]]:
    return [stream.feed(ids(c))[:2] for c in chunks]


# -- UTF-8 --------------------------------------------------------------------------------------------
def test_incomplete_utf8_held_back_until_complete() -> None:
    s = TextStream(decode)
    assert s.feed([0x61, 0xE2])[:2] == ("a", False)          # "€" = e2 82 ac
    assert s.feed([0x82])[:2] == ("", False)
    assert s.feed([0xAC, 0x62])[:2] == ("€b", False)
    assert s.feed([0xF0, 0x9F, 0x98])[:2] == ("", False)      # "😀" = f0 9f 98 80
    assert s.feed([0x80])[:2] == ("😀", False)
    assert s.flush() == ""


def test_flush_returns_incomplete_tail() -> None:
    s = TextStream(decode)
    assert s.feed([0x61, 0xE2, 0x82])[:2] == ("a", False)
    assert s.flush() == "\ufffd"


def test_invalid_byte_followed_by_text_is_emitted() -> None:
    s = TextStream(decode)
    assert s.feed([0xFF])[:2] == ("", False)                  # could look incomplete: held
    assert s.feed([0x41])[:2] == ("\ufffdA", False)


# -- stop strings -------------------------------------------------------------------------------------
def test_docstring_example() -> None:
    s = TextStream(decode=lambda t: "".join(map(chr, t)), stops=["END"])
    assert s.feed([ord(c) for c in "hi E"])[:2] == ("hi ", False)
    assert s.feed([ord(c) for c in "ND more"])[:2] == ("", True)


def test_stop_spanning_several_feeds() -> None:
    s = TextStream(decode, stops=["STOP"])
    assert run(s, ["ab S", "TO", "P tail"]) == [("ab ", False), ("", False), ("", True)]
    assert s.feed(ids("more"))[:2] == ("", True)
    assert s.flush() == ""


def test_text_before_stop_emitted_once_and_nothing_after() -> None:
    s = TextStream(decode, stops=["<end>"])
    out = run(s, ["hello <", "en", "d> more", "x"])
    assert out == [("hello ", False), ("", False), ("", True), ("", True)]
    assert "".join(o for o, _ in out) + s.flush() == "hello "


def test_text_and_stop_in_same_feed() -> None:
    s = TextStream(decode, stops=["<end>"])
    assert s.feed(ids("abc<end>def"))[:2] == ("abc", True)
    assert s.flush() == ""


def test_held_prefix_released_when_not_a_stop() -> None:
    s = TextStream(decode, stops=["STOP"])
    assert s.feed(ids("xST"))[:2] == ("x", False)
    assert s.feed(ids("y"))[:2] == ("STy", False)
    assert s.feed(ids("S"))[:2] == ("", False)
    assert s.flush() == "S"


@pytest.mark.parametrize("chunks", [["STOPabc"], ["S", "TOP"], ["ST", "OP", "zz"]])
def test_stop_at_very_start(chunks: list[str]) -> None:
    s = TextStream(decode, stops=["STOP"])
    out = run(s, chunks)
    assert out[-1] == ("", True) and all(o == "" for o, _ in out)
    assert s.flush() == ""


def test_stop_after_multibyte_character() -> None:
    s = TextStream(decode, stops=["!"])
    assert s.feed([0xE2, 0x82])[:2] == ("", False)
    assert s.feed([0xAC] + ids("!x"))[:2] == ("€", True)


def test_overlapping_stop_prefix() -> None:
    s = TextStream(decode, stops=["aab"])
    out = run(s, ["a", "a", "a", "b"])
    assert out == [("", False), ("", False), ("a", False), ("", True)]


def test_empty_stop_strings_ignored() -> None:
    s = TextStream(decode, stops=["", "Z"])
    assert s.feed(ids("abc"))[:2] == ("abc", False)
    assert s.feed(ids("Zq"))[:2] == ("", True)


def test_several_stops_across_feeds_earliest_wins() -> None:
    s = TextStream(decode, stops=["zz", "y"])
    assert s.feed(ids("1z"))[:2] == ("1", False)
    assert s.feed(ids("y"))[:2] == ("z", True)


def test_several_stops_same_feed_listed_in_position_order() -> None:
    s = TextStream(decode, stops=["a", "b"])
    assert s.feed(ids("xab"))[:2] == ("x", True)


@pytest.mark.parametrize("stops, text, expected", [
    (["b", "a"], "xab", "x"),
    (["world", "lo"], "hello world", "hel"),
])
def test_several_stops_same_feed_earliest_wins(stops: list[str], text: str, expected: str) -> None:
    s = TextStream(decode, stops=stops)
    assert s.feed(ids(text))[:2] == (expected, True)


def test_flush_returns_held_back_tail_without_stop() -> None:
    s = TextStream(decode, stops=["END"])
    assert s.feed(ids("abcE"))[:2] == ("abc", False)
    assert s.feed(ids("N"))[:2] == ("", False)
    assert s.flush() == "EN"
    assert s.flush() == ""


def test_concatenation_equals_full_text_literal() -> None:
    s = TextStream(decode, stops=["STOP"])
    chunks = [[0x68, 0xC3], [0xA9, 0x20, 0x53], [0x54], [0x4F, 0xE2, 0x82], [0xAC]]   # "hé STO€"
    out = "".join(s.feed(c)[0] for c in chunks) + s.flush()
    assert out == "hé STO€"


# -- properties ---------------------------------------------------------------------------------------
byte_chunks = st.lists(st.lists(st.integers(0, 255), max_size=6), max_size=10)


@settings(max_examples=300, deadline=None)
@given(chunks=byte_chunks)
def test_property_concat_plus_flush_is_full_text(chunks: list[list[int]]) -> None:
    s = TextStream(decode)
    emitted = ""
    for c in chunks:
        out, stopped, kept = s.feed(c)
        assert kept == len(c)
        assert not stopped
        emitted += out
    full = decode([b for c in chunks for b in c])
    assert emitted + s.flush() == full


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.text(alphabet="abc", max_size=5), max_size=8),
       stop=st.text(alphabet="abc", min_size=1, max_size=3))
def test_property_single_stop_truncates_at_first_occurrence(chunks: list[str], stop: str) -> None:
    s = TextStream(decode, stops=[stop])
    emitted, hit = "", False
    for c in chunks:
        out, hit, _ = s.feed(ids(c))
        emitted += out
    full = "".join(chunks)
    i = full.find(stop)
    if i == -1:
        assert not hit
        assert emitted + s.flush() == full
    else:
        assert hit
        assert emitted == full[:i] and s.flush() == ""


# -- kept ids: the output ends with the token that completes the stop string -------------------------
def test_kept_counts_ids_up_to_the_one_completing_the_stop() -> None:
    s = TextStream(decode, stops=["END"])
    assert s.feed(ids("xxENDyy")) == ("xx", True, 5)
    assert s.feed(ids("zz")) == ("", True, 0)


def test_kept_across_feeds() -> None:
    s = TextStream(decode, stops=["STOP"])
    assert [s.feed(ids(c)) for c in ["ab S", "TO", "P tail"]] == [("ab ", False, 4), ("", False, 2),
                                                                   ("", True, 1)]


def test_kept_when_the_stop_ends_inside_a_multibyte_character() -> None:
    s = TextStream(decode, stops=["é"])                 # "é" = c3 a9: the 2nd byte completes it
    assert s.feed([0x61, 0xC3]) == ("a", False, 2)
    assert s.feed([0xA9, 0x62, 0x63]) == ("", True, 1)


def test_kept_is_all_without_a_stop_even_when_text_is_held() -> None:
    s = TextStream(decode, stops=["STOP"])
    assert s.feed(ids("xST")) == ("x", False, 3)
    assert s.feed([0xE2, 0x82]) == ("", False, 2)       # incomplete "€" after "ST": held, ids kept
    assert s.feed([0xAC]) == ("ST€", False, 1)


def test_stop_checked_token_by_token_not_per_chunk() -> None:
    """"bc" is complete one token before "abcd": it wins however the ids are grouped."""
    for chunks in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        s = TextStream(decode, stops=["abcd", "bc"])
        out = [s.feed(ids(c)) for c in chunks]
        assert "".join(o.text for o in out) == "a" and sum(o.kept for o in out) == 3, chunks


def first_stop(all_ids: list[int], stops: list[str]) -> tuple[int, str] | None:
    """Reference: (ids kept, text) for one-id-at-a-time generation with a stop check after each id."""
    for k in range(1, len(all_ids) + 1):
        text = decode(all_ids[:k])
        hits = [i for stop in stops if (i := text.find(stop)) != -1]
        if hits:
            return k, text[:min(hits)]
    return None


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.text(alphabet="abé€", max_size=5), max_size=8),
       stops=st.lists(st.text(alphabet="abé", min_size=1, max_size=3), min_size=1, max_size=3))
def test_property_kept_and_text_match_token_at_a_time(chunks: list[str], stops: list[str]) -> None:
    s = TextStream(decode, stops=stops)
    fed = [s.feed(ids(c)) for c in chunks]
    tail = s.flush()
    all_ids = ids("".join(chunks))
    ref = first_stop(all_ids, stops)
    text, kept = "".join(f.text for f in fed), sum(f.kept for f in fed)
    if ref is None:
        assert not s.stopped and kept == len(all_ids) and text + tail == decode(all_ids)
    else:
        assert s.stopped and (kept, text) == ref and tail == ""
        assert decode(all_ids).startswith(text)


# -- incremental decoding -----------------------------------------------------------------------------
class CountingDecode:
    def __init__(self) -> None:
        self.ids_decoded = 0

    def __call__(self, token_ids: list[int]) -> str:
        self.ids_decoded += len(token_ids)
        return decode(token_ids)


@pytest.mark.parametrize("stops", [[], ["<never>"]])
def test_decoding_is_incremental(stops: list[str]) -> None:
    """Feeding n ids one at a time decodes O(n) ids in all, not O(n^2)."""
    counting = CountingDecode()
    s = TextStream(counting, stops=stops)
    text = "ab €😀 日本 " * 200
    out = "".join(s.feed([b]).text for b in ids(text)) + s.flush()
    assert out == text
    assert counting.ids_decoded <= 12 * len(ids(text))


# -- PromptEncoder ------------------------------------------------------------------------------------
def test_prompt_encoder_without_tokenizer() -> None:
    p = PromptEncoder(None)
    assert p.has_chat_template is False
    for chat in (False, True):
        with pytest.raises(ValueError, match="no tokenizer"):
            p.encode("hello", chat=chat)
    assert p.decode([1, 2, 3]) == ""


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert add_special_tokens is False
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool):
        assert add_generation_prompt and tokenize
        return {"input_ids": [1] + [ord(c) for c in messages[0]["content"]] + [2]}

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i < 3))


def test_prompt_encoder_with_fake_tokenizer() -> None:
    p = PromptEncoder(FakeTokenizer())
    assert p.has_chat_template is True
    assert p.encode("hi", chat=False) == [104, 105]
    assert p.encode("hi", chat=True) == [1, 104, 105, 2]
    assert p.decode([1, 104, 105, 2]) == "hi"


# -- a text that keeps ending in U+FFFD stays linear ---------------------------------------------------------
def test_invalid_bytes_without_end_are_decoded_a_bounded_number_of_times() -> None:
    """5,000 ids of 0xFF one at a time (a model emitting invalid bytes): every U+FFFD is emitted once, in
    order, and the ids decoded over the whole stream stay within a constant per id (a window that grew with
    the run would decode ~12.5 million)."""
    decoded = []

    def counting(ids: list[int]) -> str:
        decoded.append(len(ids))
        return decode(ids)
    s = TextStream(counting)
    out = "".join(s.feed([0xFF]).text for _ in range(5000)) + s.flush()
    assert out == "\ufffd" * 5000
    assert sum(decoded) < 60 * 5000


def test_a_split_window_keeps_characters_that_span_it() -> None:
    """Invalid bytes, then a 4-byte character arriving one byte at a time, then more invalid bytes and a
    character: the same text as decoding all at once, with the character never split."""
    stream = [0xFF] * 20 + [0xF0, 0x9F, 0x98, 0x80] + [0xC3] * 3 + [0xFF] * 30 + list("é!".encode())
    s = TextStream(decode)
    out = "".join(s.feed([b]).text for b in stream) + s.flush()
    assert out == decode(stream)


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.lists(st.sampled_from([0xFF, 0x80, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x41]),
                                max_size=12), max_size=12))
def test_property_long_runs_of_broken_utf8_give_the_full_text(chunks: list[list[int]]) -> None:
    s = TextStream(decode)
    emitted = "".join(s.feed(c).text for c in chunks)
    assert emitted + s.flush() == decode([b for c in chunks for b in c])
