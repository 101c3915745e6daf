"""OpenAI / vLLM parity where clients notice: served model names with max_model_len, max_tokens defaulting
to the rest of the context (capped), sampling defaults from generation_config.json, a 400 for every
sampling field that is not implemented (neutral values accepted), usage on every streamed chunk, /tokenize
and /detokenize, and X-Request-Id. The official `openai` client against real stage servers, raw aiohttp
for the non-OpenAI endpoints and headers; outputs stay exactly transformers' greedy."""
from __future__ import annotations

import argparse
import doctest
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.frontends.openai.api import served_model_name
from coordinator.frontends.openai.defaults import GenerationDefaults, load_generation_defaults
import coordinator.frontends.openai.defaults as generation_defaults_module
import coordinator.frontends.openai.extras as extras_module
import coordinator.frontends.openai.fields as fields_module
from coordinator.frontends.openai.schema import ApiError, ParseContext, parse_chat, parse_completion
import coordinator.frontends.openai.schema as schema_module
from helpers.openai_server import GREEDY, client, serving
from helpers.reference import byte_tokenizer, hf_greedy

CONTEXT, CAP = 512, 256              # the tiny model's max_position_embeddings; serving()'s max_new_tokens_cap
# a template that reads a chat_template_kwargs value, so that passing one through can be seen
KWARGS_TEMPLATE = ("{% if greeting %}[{{ greeting }}]{% endif %}"
                   "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def sampling_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model whose generation_config.json asks for temperature 1.5, top_p 0.95 and top_k 1: top_k 1
    makes sampling the argmax, so a request that leaves them unset must give greedy's tokens; and a chat
    template that reads a `greeting` chat_template_kwargs value."""
    path = tmp_path_factory.mktemp("sampling") / "tiny-sampling"
    shutil.copytree(tiny_model, path)
    tok = byte_tokenizer()
    tok.chat_template = KWARGS_TEMPLATE
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 1.5, "top_p": 0.95, "top_k": 1}))
    return path


def body_of(err: openai.APIStatusError) -> dict[str, Any]:
    return err.response.json()["error"]


async def post(url: str, path: str, body: dict[str, Any], **kw: Any) -> tuple[int, dict[str, Any], Any]:
    """(status, JSON body, headers) of a POST to the server's root (/tokenize) given its /v1 URL."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url.removesuffix("/v1") + path, json=body, **kw) as r:
            return r.status, await r.json(), r.headers


# -- 1. served model names ------------------------------------------------------------------------------
@pytest.mark.grpc
async def test_served_model_names_are_listed_with_max_model_len_and_all_served(chat_model, tiny_hf):
    async with serving(chat_model, served_model_name=("tiny", "org/tiny-chat")) as (_, url, _):
        c = client(url)
        try:
            models = (await c.models.list()).data
            assert [m.id for m in models] == ["tiny", "org/tiny-chat"]
            assert all(m.max_model_len == CONTEXT and m.owned_by == "specpipe" for m in models)
            assert (await c.models.retrieve("org/tiny-chat")).max_model_len == CONTEXT
            want = hf_greedy(tiny_hf, [3, 4, 5], 6)
            for name in ["tiny", "org/tiny-chat"]:
                r = await c.completions.create(model=name, prompt=[3, 4, 5], max_tokens=6, **GREEDY)
                assert r.model == name and r.choices[0].token_ids == want
            with pytest.raises(openai.NotFoundError) as err:       # the folder's name is not served any more
                await c.completions.create(model="tiny-chat", prompt=[3], max_tokens=1)
            assert body_of(err.value)["code"] == "model_not_found" and "org/tiny-chat" in body_of(err.value)["message"]
            status, body, _ = await post(url, "/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 2})
            assert status == 200 and body["model"] == "tiny", "no model named: the first name"
        finally:
            await c.close()


def test_served_model_name_flags_and_defaults(monkeypatch):
    def parse(*argv: str) -> CoordinatorConfig:
        p = argparse.ArgumentParser()
        CoordinatorConfig.add_arguments(p)
        return CoordinatorConfig.from_args(p.parse_args(["--stages", "h:1", *argv]))
    assert parse().served_model_name == ()
    assert parse("--served-model-name", "a,b", "--served-model-name", "c").served_model_name == ("a", "b", "c")
    assert parse("--served-model-name", "a", "org/b").served_model_name == ("a", "org/b")
    monkeypatch.setenv("SPECPIPE_SERVED_MODEL_NAME", "x, y")
    assert parse().served_model_name == ("x", "y")
    assert parse("--served-model-name", "z").served_model_name == ("z",), "the flag wins over the environment"
    with pytest.raises(ValueError, match="served model names"):
        CoordinatorConfig(stages=("h:1",), served_model_name=("a b ",))
    assert parse("--generation-config", "none").generation_config == "none" and parse().generation_config == "auto"
    assert served_model_name("default") == "default"
    assert served_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served_model_name("/models/tiny-chat/") == "tiny-chat" and served_model_name("./x/m") == "m"


# -- 2. max_tokens unset: the rest of the context, at most the cap ----------------------------------------
@pytest.mark.grpc
async def test_unset_max_tokens_is_the_rest_of_the_context_capped(openai_api, tiny_hf):
    c, _ = openai_api
    r = await c.completions.create(model="tiny-chat", prompt=[10, 20, 30, 40], **GREEDY)
    assert r.usage.completion_tokens == CAP and r.choices[0].finish_reason == "length"
    assert r.choices[0].token_ids == hf_greedy(tiny_hf, [10, 20, 30, 40], CAP)
    long = [(7 * i) % 250 + 3 for i in range(CONTEXT - 100)]
    r = await c.completions.create(model="tiny-chat", prompt=long, **GREEDY)
    assert r.usage.completion_tokens == 100 and r.usage.total_tokens == CONTEXT
    assert r.choices[0].token_ids == hf_greedy(tiny_hf, long, 100)
    messages = [{"role": "user", "content": "x" * (CONTEXT - 30)}]
    r = await c.chat.completions.create(model="tiny-chat", messages=messages, **GREEDY)
    assert r.usage.total_tokens == CONTEXT and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="fills the model's context"):
        await c.completions.create(model="tiny-chat", prompt=[5] * CONTEXT, **GREEDY)


# -- 3. sampling defaults from generation_config.json ------------------------------------------------------
@pytest.mark.grpc
async def test_sampling_defaults_come_from_generation_config(sampling_model, tiny_hf):
    async with serving(sampling_model) as (coord, url, _):
        assert coord.generation_defaults == GenerationDefaults(temperature=1.5, top_p=0.95, top_k=1)
        c = client(url)
        try:
            prompt, n = [9, 8, 7, 6], 24
            want = hf_greedy(tiny_hf, prompt, n)
            extra = {"ignore_eos": True, "return_token_ids": True}
            r = await c.completions.create(model="tiny-sampling", prompt=prompt, max_tokens=n, seed=11, extra_body=extra)
            assert r.choices[0].token_ids == want, "top_k 1 from the model's generation config: the argmax"
            r = await c.completions.create(model="tiny-sampling", prompt=prompt, max_tokens=n, seed=11,
                                           extra_body={**extra, "top_k": 0})
            assert r.choices[0].token_ids != want, "the request's own top_k wins (temperature 1.5 samples)"
            r = await c.completions.create(model="tiny-sampling", prompt=prompt, max_tokens=n, temperature=0,
                                           extra_body={**extra, "top_k": 0})
            assert r.choices[0].token_ids == want, "temperature 0 asked for: greedy"
        finally:
            await c.close()


def test_generation_defaults_fill_only_unset_fields(tmp_path):
    ctx = ParseContext(("m",), CONTEXT, CAP, lambda text, special: list(text.encode()),
                       defaults=GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, max_tokens=50))
    inp = parse_completion({"prompt": [1, 2]}, ctx).inp
    assert (inp.temperature, inp.top_p, inp.top_k, inp.max_new_tokens) == (0.6, 0.9, 20, 50)
    inp = parse_completion({"prompt": [1, 2], "temperature": 0, "top_p": 1, "top_k": -1, "max_tokens": 70}, ctx).inp
    assert (inp.temperature, inp.top_p, inp.top_k, inp.max_new_tokens) == (0.0, 1.0, 0, 70)
    assert parse_completion({"prompt": [1] * (CONTEXT - 10)}, ctx).inp.max_new_tokens == 10
    bare = replace(ctx, defaults=GenerationDefaults())
    inp = parse_completion({"prompt": [1, 2]}, bare).inp
    assert (inp.temperature, inp.top_p, inp.top_k, inp.max_new_tokens) == (1.0, 1.0, 0, CAP), "OpenAI's defaults"
    # reading the file: only the keys present; unusable and unimplemented ones ignored
    (tmp_path / "config.json").write_text("{}")
    assert load_generation_defaults(str(tmp_path)) == GenerationDefaults(), "no generation_config.json"
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 7, "top_k": 40, "max_new_tokens": 99, "repetition_penalty": 1.1}))
    assert load_generation_defaults(str(tmp_path)) == GenerationDefaults(0.7, None, 40, 99)
    assert load_generation_defaults(str(tmp_path), "none") == GenerationDefaults()
    assert load_generation_defaults("ignored", str(tmp_path)).temperature == 0.7, "a folder given"
    with pytest.raises(ValueError, match="generation_config.json"):
        load_generation_defaults("ignored", str(tmp_path / "nowhere"))


# -- 4. what is not implemented is refused; neutral values are not --------------------------------------
REFUSED = [("min_p", 0.1), ("repetition_penalty", 1.2), ("presence_penalty", 0.5), ("frequency_penalty", -1),
           ("logit_bias", {"5": 10}), ("min_tokens", 3), ("stop_token_ids", [2]), ("n", 2), ("best_of", 2),
           ("use_beam_search", True), ("length_penalty", 0.5), ("logprobs", 1), ("top_logprobs", 2),
           ("prompt_logprobs", 1), ("echo", True), ("suffix", "x"), ("skip_special_tokens", False),
           ("spaces_between_special_tokens", False), ("include_stop_str_in_output", True),
           ("bad_words", ["x"]), ("allowed_token_ids", [1]), ("logits_processors", ["f"]),
           ("response_format", {"type": "json_object"}), ("guided_json", {}), ("guided_regex", "a+"),
           ("guided_choice", ["a"]), ("guided_grammar", "g"), ("structured_outputs", {"regex": "a"}),
           ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
           ("functions", [{"name": "f"}]), ("chat_template", "{{ 1 }}"), ("documents", [{"text": "d"}]),
           ("modalities", ["text", "audio"]), ("audio", {"voice": "x"}), ("prompt_embeds", "AAAA")]
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "best_of": 1, "repetition_penalty": 1.0,
           "min_p": 0, "min_tokens": 0, "logit_bias": {}, "stop_token_ids": [], "use_beam_search": False,
           "length_penalty": 1, "echo": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
           "include_stop_str_in_output": False, "response_format": {"type": "text"}, "tool_choice": "none",
           "tools": [], "modalities": ["text"], "top_logprobs": 0, "user": "u", "metadata": {"k": "v"},
           "store": False, "service_tier": "auto", "reasoning_effort": "low", "priority": 0}


@pytest.mark.grpc
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_unimplemented_sampling_fields_are_400_naming_the_field(openai_api, tiny_hf, endpoint):
    c, _ = openai_api
    base = ({"prompt": [5, 6, 7]} if endpoint == "completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    url = str(c.base_url).rstrip("/")
    for name, value in REFUSED:
        status, body, _ = await post(url, path, {**base, "model": "tiny-chat", "max_tokens": 2, name: value})
        assert status == 400, (name, body)
        assert body["error"]["param"] == name and body["error"]["code"] == "unsupported_parameter", (name, body)
        assert f"'{name}' is not supported" in body["error"]["message"]
    status, body, _ = await post(url, path, {**base, "model": "tiny-chat", "max_tokens": 6, "temperature": 0,
                                             "ignore_eos": True, "return_token_ids": True, **NEUTRAL})
    assert status == 200, body
    prompt = [5, 6, 7] if endpoint == "completions" else list(b"<user>hi\n<assistant>")
    assert body["choices"][0]["token_ids"] == hf_greedy(tiny_hf, prompt, 6), "neutral values change nothing"
    with pytest.raises(openai.BadRequestError, match="'presence_penalty' is not supported"):   # the client too
        await c.chat.completions.create(model="tiny-chat", messages=base.get("messages", [{"role": "user",
                                        "content": "x"}]), presence_penalty=0.3)


@pytest.mark.grpc
async def test_continuous_usage_stats_puts_the_usage_on_every_chunk(openai_api, tiny_hf):
    c, _ = openai_api
    want = hf_greedy(tiny_hf, [4, 3, 2], 12)
    stream = await c.completions.create(model="tiny-chat", prompt=[4, 3, 2], max_tokens=12, stream=True,
                                        stream_options={"include_usage": True, "continuous_usage_stats": True},
                                        **GREEDY)
    events = [e async for e in stream]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 12
    so_far = 0
    for e in events[:-1]:
        so_far += len(e.choices[0].token_ids)
        assert (e.usage.prompt_tokens, e.usage.completion_tokens, e.usage.total_tokens) == (3, so_far, 3 + so_far)
    assert so_far == 12 and [t for e in events[:-1] for t in e.choices[0].token_ids] == want
    stream = await c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=5, stream=True, **GREEDY,
                                             stream_options={"include_usage": True, "continuous_usage_stats": True})
    events = [e async for e in stream]
    assert events[0].usage.completion_tokens == 0 and events[-1].usage.completion_tokens == 5
    assert all(e.usage is not None for e in events)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        await c.completions.create(model="tiny-chat", prompt=[4], max_tokens=2, stream_options={"include_usage": True})


def test_prompt_options_reach_the_tokenizer():
    """add_special_tokens (completions: true by default, as vLLM; chat: false), truncate_prompt_tokens, and the
    chat options for the template."""
    seen: list[Any] = []
    ctx = ParseContext(("m",), CONTEXT, CAP, lambda text, special: seen.append(special) or list(text.encode()),
                       render=lambda ms, opts: seen.append(opts) or [1, 2, 3])
    parse_completion({"prompt": "ab"}, ctx)
    parse_completion({"prompt": "ab", "add_special_tokens": False}, ctx)
    assert seen == [True, False]
    assert parse_completion({"prompt": "abcdef", "truncate_prompt_tokens": 2}, ctx).inp.prompt_token_ids == list(b"ef")
    with pytest.raises(ApiError, match="truncate_prompt_tokens"):
        parse_completion({"prompt": "ab", "truncate_prompt_tokens": 0}, ctx)
    seen.clear()
    msgs = [{"role": "user", "content": "x"}]
    parse_chat({"messages": msgs, "continue_final_message": True, "chat_template_kwargs": {"a": 1}}, ctx)
    parse_chat({"messages": msgs, "add_special_tokens": True}, ctx)
    assert [(o.add_generation_prompt, o.continue_final_message, o.add_special_tokens, o.template_kwargs)
            for o in seen] == [(False, True, False, {"a": 1}), (True, False, True, {})]


# -- 5. /tokenize and /detokenize ----------------------------------------------------------------------
@pytest.mark.grpc
async def test_tokenize_and_detokenize(sampling_model):
    async with serving(sampling_model) as (coord, url, _):
        c = client(url)
        try:
            status, body, _ = await post(url, "/tokenize", {"model": "tiny-sampling", "prompt": "Hello"})
            assert status == 200 and body == {"count": 5, "max_model_len": CONTEXT, "tokens": list(b"Hello"),
                                              "token_strs": None}
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
            status, body, _ = await post(url, "/tokenize", {"model": "tiny-sampling", "messages": messages,
                                                            "return_token_strs": True})
            assert body["tokens"] == list(b"<system>Be brief.\n<user>hi\n<assistant>") and len(body["token_strs"]) == body["count"]
            r = await c.chat.completions.create(model="tiny-sampling", messages=messages, max_tokens=1, temperature=0)
            assert r.usage.prompt_tokens == body["count"], "/tokenize counts what chat completions send"
            cases = [({"add_generation_prompt": False}, b"<user>hi\n"),
                     ({"chat_template_kwargs": {"greeting": "yo"}}, b"[yo]<user>hi\n<assistant>"),
                     ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}],
                       "continue_final_message": True}, b"<user>hi\n<assistant>He")]
            for extra, want in cases:
                status, body, _ = await post(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                                                **extra})
                assert status == 200 and bytes(body["tokens"]) == want, (extra, body)
            status, body, _ = await post(url, "/detokenize", {"model": "tiny-sampling", "tokens": list(b"Hi there")})
            assert status == 200 and body == {"prompt": "Hi there"}
            for path, bad_body, code, param in [
                    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
                    ("/tokenize", {"prompt": "x", "messages": messages}, 400, "prompt"),
                    ("/tokenize", {}, 400, "prompt"), ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
                    ("/tokenize", {"messages": messages, "chat_template_kwargs": {"tokenize": False}}, 400, "messages"),
                    ("/tokenize", {"messages": messages, "tools": [{"type": "function"}]}, 400, "tools"),
                    ("/detokenize", {"tokens": [1, 999]}, 400, "tokens"), ("/detokenize", {"tokens": "ab"}, 400, "tokens"),
                    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model")]:
                status, body, _ = await post(url, path, bad_body)
                assert status == code and set(body["error"]) == {"message", "type", "param", "code"}, (path, body)
                assert body["error"]["param"] == param, (path, bad_body, body)
        finally:
            await c.close()


@pytest.mark.grpc
async def test_tokenize_needs_the_token_when_one_is_set(chat_model):
    async with serving(chat_model, api_token="s3cret") as (_, url, _):
        status, body, _ = await post(url, "/tokenize", {"prompt": "x"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, body, _ = await post(url, "/detokenize", {"tokens": [104]},
                                     headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and body == {"prompt": "h"}


# -- 6. X-Request-Id -------------------------------------------------------------------------------------
@pytest.mark.grpc
async def test_x_request_id_is_echoed_or_generated(openai_api):
    c, _ = openai_api
    url = str(c.base_url).rstrip("/")
    raw = await c.completions.with_raw_response.create(model="tiny-chat", prompt=[1, 2], max_tokens=2,
                                                       temperature=0, extra_headers={"X-Request-Id": "trace-42.a"})
    assert raw.headers["x-request-id"] == "trace-42.a" and raw.parse().usage.completion_tokens <= 2
    status, body, headers = await post(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 200 and body["id"] == f"cmpl-{headers['X-Request-Id']}", "no header: the request's own id"
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/chat/completions", headers={"X-Request-Id": "abc-123"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "abc-123"
            assert (await r.text()).rstrip().endswith("data: [DONE]")
        async with s.get(url + "/models/nope", headers={"X-Request-Id": "e-1"}) as r:
            assert r.status == 404 and r.headers["X-Request-Id"] == "e-1", "errors carry it too"
        for bad_id in ["x" * 129, "a b", "<script>"]:
            async with s.post(url + "/completions", headers={"X-Request-Id": bad_id},
                              json={"prompt": [1], "max_tokens": 1}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["code"] == "invalid_request_id"
                assert r.headers["X-Request-Id"] != bad_id and len(r.headers["X-Request-Id"]) == 16


def test_docstring_examples():
    for module in (schema_module, fields_module, extras_module, generation_defaults_module):
        assert doctest.testmod(module).failed == 0, module.__name__
