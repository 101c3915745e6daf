"""TextStream (coordinator/core/text.py) with the real default model's tokenizer (SmolLM2, byte-level BPE): the
incremental text equals decoding all ids at once — characters split over tokens (emoji, CJK) included —
however the ids are chunked, and stop strings spanning chunks cut the text and the kept ids exactly."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.core.text import PromptEncoder, TextStream
from services.model.loader import ensure_default_model

TEXT = "Hello 😀 world, 日本語の文章 — naïve café ☃🎉👩‍👩‍👧 END of it, ¿sí?"


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    from transformers import AutoTokenizer
    return PromptEncoder(AutoTokenizer.from_pretrained(ensure_default_model()))


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    """Split ids at the given cut points (any ints: taken modulo len + 1, sorted)."""
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(points, points[1:])]


def stream_all(encoder: PromptEncoder, chunks: list[list[int]],
               stops: list[str] | tuple[str, ...] = ()) -> tuple[str, int, str, bool]:
    s = TextStream(encoder.decode, stops)
    fed = [s.feed(c) for c in chunks]
    return "".join(f.text for f in fed), sum(f.kept for f in fed), s.flush(), s.stopped


def test_characters_split_over_tokens_come_out_whole(encoder: PromptEncoder) -> None:
    ids = encoder.tokenizer.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in encoder.decode([i]) for i in ids), "the text has characters split over tokens"
    s = TextStream(encoder.decode)
    pieces = [s.feed([i]).text for i in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + s.flush() == encoder.decode(ids) == TEXT


def test_special_tokens_are_skipped_as_in_full_decoding(encoder: PromptEncoder) -> None:
    tok = encoder.tokenizer
    ids = tok.encode("Hi 😀", add_special_tokens=False) + [tok.eos_token_id] + tok.encode(" 日本", add_special_tokens=False)
    text, kept, tail, _ = stream_all(encoder, [[i] for i in ids])
    assert text + tail == encoder.decode(ids) == "Hi 😀 日本" and kept == len(ids)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=30), noise=st.lists(st.integers(0, 49151), max_size=12),
       cuts=st.lists(st.integers(0, 1000), max_size=8))
def test_property_chunked_incremental_equals_full_decoding(encoder: PromptEncoder, text: str,
                                                           noise: list[int], cuts: list[int]) -> None:
    """Ids of arbitrary text (multi-byte characters split over tokens) with random ids mixed in (lone
    bytes that never complete a character, special tokens), cut into random chunks."""
    ids = encoder.tokenizer.encode(text, add_special_tokens=False)
    for j, n in enumerate(noise):
        ids.insert((j * 7919) % (len(ids) + 1), n)
    out, kept, tail, stopped = stream_all(encoder, chunked(ids, cuts))
    assert out + tail == encoder.decode(ids) and kept == len(ids) and not stopped


def reference(encoder: PromptEncoder, ids: list[int], stops: list[str]) -> tuple[int, str]:
    """Ids kept and text for one-id-at-a-time generation with a stop check after each id."""
    for k in range(1, len(ids) + 1):
        text = encoder.decode(ids[:k])
        hits = [i for stop in stops if (i := text.find(stop)) != -1]
        if hits:
            return k, text[:min(hits)]
    raise AssertionError("no stop string in the text")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 1000), max_size=10),
       stops=st.sampled_from([["END"], ["😀 w"], ["語の"], ["ï"], ["👧 E", "café"], ["of it", "N"]]))
def test_property_stop_strings_spanning_chunks(encoder: PromptEncoder, cuts: list[int], stops: list[str]) -> None:
    ids = encoder.tokenizer.encode(TEXT, add_special_tokens=False)
    out, kept, tail, stopped = stream_all(encoder, chunked(ids, cuts), stops)
    assert stopped and tail == ""
    assert (kept, out) == reference(encoder, ids, stops)
    assert TEXT.startswith(out)
