"""The OpenAI-compatible HTTP API, driven by the official `openai` client against a real coordinator over
real gRPC stages: exact tokens, streaming = non-streaming, the chat template, errors in OpenAI's shape with
the right status (400, 401, 404, 429), HTTPS, and a client hang-up that cancels the generation."""
from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace

import aiohttp
import openai
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.frontends.openai.schema import ApiError, ParseContext, parse_chat, parse_completion
from helpers.openai_server import GREEDY, client, serving, text_of
from helpers.reference import hf_greedy
from helpers.wait import wait_until, wait_until_empty


@pytest.mark.smoke
@pytest.mark.grpc
async def test_models_and_completion_with_token_ids_is_exact(openai_api, tiny_hf):
    c, _ = openai_api
    models = await c.models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]
    assert (await c.models.retrieve("tiny-chat")).id == "tiny-chat"
    prompt = [10, 20, 30, 40]
    want = hf_greedy(tiny_hf, prompt, 12)
    r = await c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, **GREEDY)
    assert r.object == "text_completion" and r.model == "tiny-chat" and r.id.startswith("cmpl-")
    assert r.choices[0].token_ids == want
    assert r.choices[0].text == text_of(want) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 12, 16)
    r = await c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True, "method": "pp"})
    assert r.choices[0].text == text_of(want), "method pp, no token ids asked for"


@pytest.mark.grpc
async def test_streaming_deltas_concatenate_to_the_non_streaming_text(openai_api, tiny_hf):
    c, _ = openai_api
    prompt = "Hello, world"
    want = hf_greedy(tiny_hf, list(prompt.encode()), 20)
    whole = await c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=20, **GREEDY)
    assert whole.choices[0].token_ids == want, "a text prompt is tokenized raw (no chat template)"
    stream = await c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=20, stream=True,
                                        stream_options={"include_usage": True}, **GREEDY)
    events = [e async for e in stream]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 20
    assert events[-1].usage.prompt_tokens == len(prompt.encode())
    assert all(e.usage is None for e in events[:-1]) and len(events) > 3
    assert "".join(e.choices[0].text for e in events[:-1]) == whole.choices[0].text
    assert [t for e in events[:-1] for t in e.choices[0].token_ids] == want
    assert [e.choices[0].finish_reason for e in events[:-1]][-2:] == [None, "length"]


@pytest.mark.grpc
async def test_stop_strings_end_the_text_with_finish_reason_stop(openai_api, tiny_hf):
    c, _ = openai_api
    full = text_of(hf_greedy(tiny_hf, [10, 20, 30, 40], 30))
    stop = next(full[i:i + 2] for i in range(5, 25) if "\ufffd" not in full[i:i + 2])
    r = await c.completions.create(model="tiny-chat", prompt=[10, 20, 30, 40], max_tokens=30, stop=[stop],
                                   temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


@pytest.mark.grpc
async def test_chat_completion_renders_the_chat_template(openai_api, tiny_hf):
    c, _ = openai_api
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = list(b"<system>Be brief.\n<user>hi\n<assistant>")
    want = hf_greedy(tiny_hf, prompt, 10)
    r = await c.chat.completions.create(model="tiny-chat", messages=messages, max_completion_tokens=10, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].token_ids == want and r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text_of(want)
    stream = await c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, stream=True,
                                             **GREEDY)
    events = [e async for e in stream]
    assert events[0].choices[0].delta.role == "assistant" and events[0].object == "chat.completion.chunk"
    assert "".join(e.choices[0].delta.content or "" for e in events) == text_of(want)
    assert events[-1].choices[0].finish_reason == "length"


@pytest.mark.grpc
async def test_sampling_with_a_seed_is_reproducible(openai_api):
    c, _ = openai_api
    runs = [await c.completions.create(model="tiny-chat", prompt=[5, 6, 7], max_tokens=12, temperature=0.9,
                                       top_p=0.95, seed=1234, extra_body={"return_token_ids": True})
            for _ in range(2)]
    assert runs[0].choices[0].token_ids == runs[1].choices[0].token_ids


@pytest.mark.grpc
@pytest.mark.parametrize("kwargs, fragment", [
    (dict(n=2), "not supported"), (dict(logprobs=2), "not supported"), (dict(echo=True), "not supported"),
    (dict(best_of=3), "not supported"), (dict(suffix="x"), "not supported"),
    (dict(max_tokens=0), "at least 1"), (dict(max_tokens=300), "cap"), (dict(temperature=-1), "temperature"),
    (dict(prompt=[5, 300]), "vocabulary"), (dict(prompt=["a", "b"]), "batch"),
    (dict(extra_body={"method": "warp-drive"}), "unknown method"), (dict(stop=7), "stop"),
])
async def test_bad_parameters_are_400_in_openais_shape(openai_api, kwargs, fragment):
    c, _ = openai_api
    with pytest.raises(openai.BadRequestError) as err:
        await c.completions.create(**{"model": "tiny-chat", "prompt": [5, 6], **kwargs})
    assert err.value.status_code == 400 and fragment in err.value.message
    body = err.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    r = await c.completions.create(model="tiny-chat", prompt=[5, 6], max_tokens=2, temperature=0)
    assert r.usage.completion_tokens <= 2, "the server keeps serving"


@pytest.mark.grpc
async def test_unknown_model_route_and_bad_json_are_404_and_400(openai_api):
    c, _ = openai_api
    with pytest.raises(openai.NotFoundError) as err:
        await c.completions.create(model="gpt-4", prompt="hi")
    assert err.value.response.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await c.models.retrieve("gpt-4")
    with pytest.raises(openai.BadRequestError, match="role"):
        await c.chat.completions.create(model="tiny-chat", messages=[{"role": "wizard", "content": "x"}])
    base = str(c.base_url).rstrip("/")
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base}/nope", json={}) as r:
            assert r.status == 404 and (await r.json())["error"]["message"].startswith("Invalid URL")
        async with s.post(f"{base}/completions", data=b"{not json") as r:
            assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
        async with s.get(f"{base}/completions") as r:
            assert r.status == 405 and "error" in await r.json()


@pytest.mark.grpc
async def test_wrong_or_missing_key_is_401_over_https(chat_model, tiny_hf, tmp_path):
    import ssl

    from cryptography.hazmat.primitives import serialization

    from helpers.certs import make_ca, make_leaf, write
    ca = make_ca("test-ca")
    cert, key = write(tmp_path, "api", *make_leaf(ca, "api"))
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    async with serving(chat_model, api_token="s3cret", api_tls_cert=cert, api_tls_key=key) as (_, url, _):
        assert url.startswith("https://")
        tls = ssl.create_default_context(cafile=str(ca_file))
        async with openai.DefaultAsyncHttpxClient(verify=tls) as h:
            for k in ["wrong", "S3CRET"]:
                with pytest.raises(openai.AuthenticationError) as err:
                    await client(url, k, http_client=h).models.list()
                assert err.value.status_code == 401
                assert err.value.response.json()["error"]["code"] == "invalid_api_key"
            r = await client(url, "s3cret", http_client=h).completions.create(
                model="tiny-chat", prompt=[7, 8], max_tokens=4, **GREEDY)
            assert r.choices[0].token_ids == hf_greedy(tiny_hf, [7, 8], 4)
        async with aiohttp.ClientSession() as s:
            async with s.get(url.removesuffix("/v1") + "/health", ssl=tls) as r:
                assert r.status == 200, "health checks need no token"
            async with s.post(url + "/completions", json={"prompt": [1]}, ssl=tls) as r:
                assert r.status == 401, "no Authorization header"


@pytest.mark.grpc
async def test_a_full_admission_queue_is_429(chat_model, tiny_hf):
    async with serving(chat_model, stage_time_ms="20", method="cb-pp", max_active=1, max_queue=1) as (coord, url, _):
        c = client(url)
        try:
            def ask(prompt: list[int], n: int):
                return c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=n, **GREEDY)
            first = asyncio.create_task(ask([4, 5, 6], 40))
            await wait_until(lambda: coord.engine.admission.active, what="the first request running")
            second = asyncio.create_task(ask([7, 8], 6))
            await wait_until(lambda: coord.engine.admission.queue, what="the second request queued")
            with pytest.raises(openai.RateLimitError) as err:
                await ask([9], 4)
            assert err.value.status_code == 429 and "busy" in err.value.message
            assert (await first).choices[0].token_ids == hf_greedy(tiny_hf, [4, 5, 6], 40)
            assert (await second).choices[0].token_ids == hf_greedy(tiny_hf, [7, 8], 6)
        finally:
            await c.close()


@pytest.mark.grpc
async def test_a_client_hanging_up_cancels_the_generation(chat_model):
    """Mid-stream, and while a non-streaming request is still generating (nothing written yet: the handler
    itself must be cancelled)."""
    async with serving(chat_model, stage_time_ms="20", method="pp") as (coord, url, addrs):
        cancelled: list[str] = []
        engine_cancel = coord.engine.cancel

        def spy(request_id: str, reason: str = "cancelled") -> None:
            cancelled.append(reason)
            engine_cancel(request_id, reason)
        coord.engine.cancel = spy

        async def cancelled_not_finished() -> None:
            await wait_until(lambda: not coord.engine.active or cancelled, interval=0.05, what="the request ended")
            assert cancelled == ["cancelled"], "the generation must be cancelled, not run to its end"
            await wait_until_empty(addrs, coord)
            cancelled.clear()

        c = client(url)
        try:
            stream = await c.completions.create(model="tiny-chat", prompt=[4, 5], max_tokens=250, stream=True,
                                                **GREEDY)
            got = 0
            async for event in stream:
                got += len(event.choices[0].token_ids)
                if got >= 3:
                    break
            await stream.close()                      # hang up with ~250 tokens still to come
            await cancelled_not_finished()
            with pytest.raises(openai.APITimeoutError):
                await c.completions.create(model="tiny-chat", prompt=[4, 5], max_tokens=250, timeout=1.0, **GREEDY)
            await cancelled_not_finished()
        finally:
            await c.close()


# -- pure parsing and configuration ---------------------------------------------------------------------
def test_parsing_maps_openai_fields_onto_generate_input():
    ctx = ParseContext(("m",), context=64, cap=32, encode=lambda text, special: list(text.encode()))
    req = parse_completion({"model": "m", "prompt": [[1, 2]], "max_tokens": 5, "stop": "x", "seed": 3,
                            "stream": True, "stream_options": {"include_usage": True}, "top_k": 4}, ctx)
    assert (req.inp.prompt_token_ids, req.inp.max_new_tokens, req.inp.stop) == ([1, 2], 5, ["x"])
    assert (req.inp.seed, req.inp.top_k, req.inp.temperature, req.stream, req.include_usage) == (3, 4, 1.0, True, True)
    assert (req.model, req.prompt_tokens, req.continuous_usage) == ("m", 2, False)
    seen = []
    chat = replace(ctx, render=lambda ms, opts: seen.extend(ms) or [1])
    req = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}],
                      "max_tokens": 9, "max_completion_tokens": 7}, chat)
    assert seen == [{"role": "system", "content": "ab"}] and req.inp.max_new_tokens == 7
    for body in [{"messages": []}, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                 {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
                 {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
                 {"messages": [{"role": "user", "content": "x"}], "max_tokens": True}]:
        with pytest.raises(ApiError) as err:
            parse_chat(body, chat)
        assert err.value.status == 400


def test_http_port_from_flags_and_environment(monkeypatch):
    def parse(*argv: str) -> CoordinatorConfig:
        p = argparse.ArgumentParser()
        CoordinatorConfig.add_arguments(p)
        return CoordinatorConfig.from_args(p.parse_args(["--stages", "h:1", *argv]))
    assert parse().http_port == 0 and parse("--http-port", "8080").http_port == 8080
    monkeypatch.setenv("SPECPIPE_HTTP_PORT", "9000")
    assert parse().http_port == 9000
    with pytest.raises(ValueError, match="http_port"):
        CoordinatorConfig(stages=("h:1",), http_port=70000)


def test_a_conversation_is_sized_by_every_message_before_its_template_runs():
    """Before, only `content` was counted: 260K empty `tool` messages passed as a tiny request."""
    from coordinator.frontends.openai.extras import tokenize
    rendered = []
    ctx = ParseContext(("m",), context=64, cap=32, encode=lambda text, special: list(text.encode()),
                       render=lambda ms, opts: rendered.append(len(ms)) or [1])
    many_empty = {"messages": [{"role": "tool", "content": ""}] * 1000, "max_tokens": 1}
    for call in (lambda b: parse_chat(b, ctx), lambda b: tokenize(b, ctx)):
        with pytest.raises(ApiError) as err:
            call(many_empty)
        assert err.value.status == 400 and "cannot fit" in str(err.value)
    fitting = {"messages": [{"role": "tool", "content": ""}] * 20, "max_tokens": 1}   # 20 x 20 < 64 x 64
    parse_chat(fitting, ctx)
    assert rendered == [20], "only the conversation that fits was rendered"
    with pytest.raises(ApiError, match="cannot fit"):
        tokenize({"prompt": "x" * (64 * 64 + 1)}, ctx)                # /tokenize sizes a prompt before encoding
    with pytest.raises(ApiError, match="chat_template_kwargs"):
        parse_chat({**fitting, "chat_template_kwargs": {"k": "v" * 5000}}, ctx)
