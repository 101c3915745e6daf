"""The Python client (client.py) and `specpipe generate` against a real coordinator over real
stages: exact tokens and text, errors as SpecPipeError, TLS and the bearer token, one-line CLI errors, --help.

The coordinator serves from an event loop in a background thread, so that the blocking Client and
`specpipe generate` subprocesses can call it. Its model is the tiny random Llama with a byte-level tokenizer
added (token id = byte value), so text prompts and streamed text work."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.certs import make_ca, make_leaf, write
from client import AsyncClient, Client, SpecPipeError
from coordinator.engine.local import free_port
from coordinator.config import CoordinatorConfig
from coordinator.frontends.server import start
from helpers.reference import hf_greedy
from helpers.stage_servers import stage_servers
from helpers.wait import wait_until_blocking

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"^\[(\d+) tokens \((length|eos|stop)\), [\d.]+ tokens/step, [\d.]+ ms between tokens, "
                     r"first token after \d+ ms, [\d.]+ s(, cost rule: (width \d+( topk \d+)?|no speculation)"
                     r"( after a [\d.]+ s warm-up)?)?\]$")


def add_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer without merges: token id = byte value (GPT-2's byte-to-character map)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


class Served:
    """Stages and coordinators served from an event loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = contextlib.AsyncExitStack()

    def call(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def coordinator(self, model: str, num_stages: int, stage_time_ms: str = "0", **config) -> str:
        addrs, _ = await self.stack.enter_async_context(stage_servers(model, num_stages, stage_time_ms))
        server, coord = await start(CoordinatorConfig(stages=tuple(addrs), model=model, port=0,
                                                      max_new_tokens_cap=64, default_max_new_tokens=16, **config))
        self.stack.push_async_callback(coord.close)
        self.stack.push_async_callback(server.stop, 0)
        return f"127.0.0.1:{server.port}"

    def close(self) -> None:
        try:
            self.call(self.stack.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bytes") / "llama4-bytes"
    shutil.copytree(tiny_model, folder)            # same weights as tiny_hf
    add_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    """`plain`: 2 stages, plaintext, no token; `secure`: 1 stage, API over TLS with bearer token 's3cret';
    `slow`: 1 stage of at least 40 ms per step."""
    tmp = tmp_path_factory.mktemp("client-pki")
    ca = make_ca("client-test-ca")
    from cryptography.hazmat.primitives import serialization
    (tmp / "ca.crt").write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    cert, key = write(tmp, "api", *make_leaf(ca, "api"))
    s = Served()
    try:
        s.plain = s.call(s.coordinator(str(model), 2))
        s.secure = s.call(s.coordinator(str(model), 1, method="pp", api_tls_cert=cert, api_tls_key=key,
                                        api_token="s3cret"))
        s.slow = s.call(s.coordinator(str(model), 1, stage_time_ms="40", method="pp"))
        s.ca = str(tmp / "ca.crt")
        yield s
    finally:
        s.close()


@pytest.mark.smoke
@pytest.mark.grpc
def test_client_streams_the_exact_tokens_and_text(served, tiny_hf, tokenizer):
    prompt = [10, 20, 30, 40]
    expected = hf_greedy(tiny_hf, prompt, 12)
    with Client(served.plain, timeout=60) as client:
        for method in ("pp", "specpipe"):
            stream = client.generate(prompt_token_ids=prompt, max_new_tokens=12, ignore_eos=True, method=method)
            with pytest.raises(RuntimeError, match="not finished"):
                stream.result
            deltas = list(stream)
            done = stream.result
            assert done.token_ids == expected == stream.token_ids, method
            assert "".join(deltas) == done.text == tokenizer.decode(expected), method
            assert all(deltas), "no empty deltas"
            assert done.finish_reason == "length" and done.request_id
            assert done.stats.completion_tokens == 12 and done.stats.prompt_tokens == 4
            assert done.stats.steps > 0 and done.stats.tokens_per_step > 0 and done.stats.ttft_ms > 0
        text_prompt = client.complete("hello", raw=True, max_new_tokens=6, ignore_eos=True, method="pp")
        assert text_prompt.token_ids == hf_greedy(tiny_hf, list(b"hello"), 6), "text prompts: one token per byte"


@pytest.mark.grpc
async def test_async_client_streams_the_same(served, tiny_hf, tokenizer):
    prompt = [5, 6, 7]
    expected = hf_greedy(tiny_hf, prompt, 10)
    async with AsyncClient(served.plain, timeout=60) as client:
        stream = client.generate(prompt_token_ids=prompt, max_new_tokens=10, ignore_eos=True)
        deltas = [d async for d in stream]
        assert stream.result.token_ids == expected
        assert "".join(deltas) == stream.result.text == tokenizer.decode(expected)
        done = await client.complete("hi", raw=True, max_new_tokens=4, ignore_eos=True, stop=[])
        assert done.token_ids == hf_greedy(tiny_hf, list(b"hi"), 4)
        with pytest.raises(SpecPipeError) as err:
            await client.complete(prompt_token_ids=[5], max_new_tokens=0)
        assert err.value.code == "INVALID_ARGUMENT" and "at least 1" in err.value.message


@pytest.mark.grpc
@pytest.mark.parametrize("options, fragment", [
    (dict(prompt_token_ids=[5], max_new_tokens=0), "at least 1"),
    (dict(prompt_token_ids=[5], max_new_tokens=65), "cap"),
    (dict(prompt_token_ids=[5, 256]), "vocabulary"),
    (dict(prompt_token_ids=[5], method="warp-drive"), "unknown method"),
    (dict(prompt_token_ids=[5], temperature=-1.0), "temperature"),
])
def test_bad_input_raises_specpipe_error_invalid_argument(served, options, fragment):
    with Client(served.plain, timeout=30) as client:
        with pytest.raises(SpecPipeError) as err:
            client.complete(**options)
        assert err.value.code == "INVALID_ARGUMENT" and fragment in err.value.message
        assert not err.value.unreachable and err.value.addr == served.plain


@pytest.mark.grpc
def test_values_a_request_cannot_carry_fail_before_sending(served):
    with Client(served.plain) as client:
        with pytest.raises(TypeError, match="unknown option"):
            client.generate("x", max_tokens=3)
        with pytest.raises(ValueError, match="seed"):
            client.generate("x", seed=-1)
        with pytest.raises(ValueError, match="contradict"):
            client.generate("x", raw=True, chat=True)


@pytest.mark.grpc
def test_tls_and_bearer_token(served, tiny_hf):
    with Client(served.secure, tls_ca=served.ca, token="s3cret", timeout=30) as client:
        done = client.complete(prompt_token_ids=[7, 8], max_new_tokens=4, ignore_eos=True)
        assert done.token_ids == hf_greedy(tiny_hf, [7, 8], 4)
    for token in ("wrong", None):
        with Client(served.secure, tls_ca=served.ca, token=token, timeout=30) as client:
            with pytest.raises(SpecPipeError) as err:
                client.complete(prompt_token_ids=[7, 8], max_new_tokens=4)
            assert err.value.code == "UNAUTHENTICATED" and "bearer token" in err.value.message


@pytest.mark.grpc
async def test_async_client_wrong_token_and_unreachable(served):
    async with AsyncClient(served.secure, tls_ca=served.ca, token="wrong", timeout=30) as client:
        with pytest.raises(SpecPipeError) as err:
            await client.complete(prompt_token_ids=[7], max_new_tokens=2)
        assert err.value.code == "UNAUTHENTICATED"
    async with AsyncClient(f"127.0.0.1:{free_port()}", timeout=10) as client:
        with pytest.raises(SpecPipeError) as err:
            await client.complete("hi")
        assert err.value.code == "UNAVAILABLE" and err.value.refused


@pytest.mark.grpc
def test_unreachable_address_is_unavailable_and_refused():
    with Client(f"127.0.0.1:{free_port()}", timeout=10) as client:
        with pytest.raises(SpecPipeError) as err:
            client.complete("hi")
    assert err.value.code == "UNAVAILABLE" and err.value.unreachable and err.value.refused


def specpipe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("SPECPIPE_API_TOKEN", "SPECPIPE_API_TLS_CA")}
    full.update(PYTHONIOENCODING="utf-8", **(env or {}))
    return subprocess.run([sys.executable, "-m", "coordinator.cli.main", *args], capture_output=True, timeout=120,
                          cwd=ROOT, env=full)


@pytest.mark.grpc
def test_the_summary_line_names_the_rules_choice_and_its_warm_up_apart():
    from coordinator.cli.main import summary_line
    line = summary_line(35, "eos", 0.25, 87.44, 618.0, 3.59, 0.0, 3.42)
    assert SUMMARY.match(line) and line.endswith("cost rule: no speculation after a 3.4 s warm-up]"), line
    line = summary_line(35, "eos", 0.25, 87.44, 618.0, 3.59, 8.0)
    assert SUMMARY.match(line) and line.endswith("cost rule: width 8]"), line
    line = summary_line(35, "eos", 0.25, 87.44, 618.0, 3.59, 32.0, 0.0, 4.0)
    assert SUMMARY.match(line) and line.endswith("cost rule: width 32 topk 4]"), line
    assert "warm-up" not in summary_line(8, "length", 0.25, 80.0, 400.0, 1.0)


def test_specpipe_generate_prints_text_then_one_summary_line(served, tiny_hf, tokenizer):
    expected = hf_greedy(tiny_hf, list(b"hello"), 8)
    proc = specpipe("generate", "hello", "--raw", "--max-new-tokens", "8", "--ignore-eos", "--method", "pp",
                    "--addr", served.plain)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert proc.stdout.decode() == tokenizer.decode(expected) + "\n"
    lines = err.splitlines()
    assert len(lines) == 1 and SUMMARY.match(lines[0]), err
    assert SUMMARY.match(lines[0]).group(1, 2) == ("8", "length")
    proc = specpipe("generate", "hello", "--raw", "--max-new-tokens", "8", "--ignore-eos", "--json",
                    "--addr", served.plain)
    assert proc.returncode == 0, proc.stderr.decode()
    result = json.loads(proc.stdout)
    assert result["token_ids"] == expected and result["finish_reason"] == "length"
    assert result["text"] == tokenizer.decode(expected) and result["steps"] > 0 and proc.stderr == b""


@pytest.mark.grpc
def test_specpipe_generate_over_tls_with_the_token_from_the_environment(served, tiny_hf):
    ok = specpipe("generate", "hi", "--raw", "--max-new-tokens", "3", "--ignore-eos", "--json", "--addr",
                  served.secure, "--tls-ca", served.ca, env={"SPECPIPE_API_TOKEN": "s3cret"})
    assert ok.returncode == 0, ok.stderr.decode()
    assert json.loads(ok.stdout)["token_ids"] == hf_greedy(tiny_hf, list(b"hi"), 3)
    bad = specpipe("generate", "hi", "--addr", served.secure, "--tls-ca", served.ca, "--token", "wrong")
    assert bad.returncode == 1
    assert bad.stderr.decode().splitlines() == [
        "specpipe: error: missing or wrong bearer token (send metadata 'authorization: Bearer <token>') "
        "(UNAUTHENTICATED)"]


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--addr", "127.0.0.1:{port}"],
     "specpipe: error: cannot reach the coordinator at 127.0.0.1:{port} (is `specpipe local` running?)"),
    (["generate"], "specpipe: error: the following arguments are required: prompt"),
    (["generate", "hi", "--max-new-tokens", "many"], "specpipe: error: argument --max-new-tokens: invalid int"),
    (["generate", "hi", "--seed", "-3"], "specpipe: error: option seed=-3"),
    (["warp"], "specpipe: error: argument command: invalid choice: 'warp'"),
    (["generate", "hi", "--tls-ca", "/nonexistent/ca.crt"], "specpipe: error: TLS file /nonexistent/ca.crt"),
])
def test_cli_errors_are_one_line_with_exit_code_1(args, message):
    port = str(free_port())
    proc = specpipe(*[a.replace("{port}", port) for a in args])
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith(message.replace("{port}", port)), err


@pytest.mark.grpc
def test_server_refusals_reach_the_cli_as_their_details(served):
    proc = specpipe("generate", "hi", "--max-new-tokens", "0", "--addr", served.plain)
    assert proc.returncode == 1
    line, = proc.stderr.decode().splitlines()
    assert line.startswith("specpipe: error: ") and "at least 1" in line and line.endswith("(INVALID_ARGUMENT)")


@pytest.mark.parametrize("command", ["run", "local", "generate", "bench", "stage", "coordinator"])
def test_help_of_every_subcommand_shows_examples(command, capsys):
    from coordinator.cli.main import main
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "examples" in out and f"specpipe {command} " in out.split("examples", 1)[1]


@pytest.mark.grpc
def test_ctrl_c_during_a_stream_exits_130_without_a_traceback(served):
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli.main", "generate", "hello", "--raw", "--ignore-eos",
                             "--max-new-tokens", "60", "--addr", served.slow], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    try:
        assert proc.stdout.read(1), "text streams before the interrupt"     # 60 steps take >= 2.4 s
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and b"Traceback" not in err, err.decode()


def test_interrupt_is_130_and_errors_are_one_line(monkeypatch, capsys):
    import coordinator.cli.main as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_dispatch", interrupted)
    assert cli.main(["generate", "hi"]) == 130

    def broken(argv):
        raise KeyError("stages")

    monkeypatch.setattr(cli, "_dispatch", broken)
    assert cli.main(["run", "hi"]) == 1
    assert capsys.readouterr().err == "specpipe: error: KeyError: 'stages'\n"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_conversion_progress_ticks_on_a_terminal_and_is_plain_otherwise():
    from coordinator.cli.progress import ConversionProgress

    plain = io.StringIO()
    with ConversionProgress(plain, interval_s=0.01) as log:
        log("specpipe: converting X into /c")
        time.sleep(0.05)                      # five intervals pass, no tick (the test, not a wait)
        log("specpipe: ready in 1.0 s")
    assert plain.getvalue() == "specpipe: converting X into /c\nspecpipe: ready in 1.0 s\n"
    term = FakeTerminal()
    with ConversionProgress(term, interval_s=0.01) as log:
        log("specpipe: converting X into /c")
        wait_until_blocking(lambda: "\r  ... " in term.getvalue(), timeout=20, interval=0.01, what="a tick")
        log("specpipe: ready in 1.0 s")
    out = term.getvalue()
    assert out.startswith("specpipe: converting X into /c\n\r  ... ") and " s" in out
    assert out.endswith("\r\x1b[Kspecpipe: ready in 1.0 s\n"), "the tick line is cleared before the next message"


def test_run_loads_the_draft_beside_the_stages_and_a_failure_stops_them(tiny_model, monkeypatch, capsys):
    """`specpipe run` loads the coordinator's model parts while its stage processes start: a draft that cannot
    load fails the command with one line (exit 1) before any stage is ready, and every stage process it
    started has exited."""
    import torch

    import coordinator.cli.main as cli
    from coordinator.engine.local import LocalStages

    started: list[subprocess.Popen] = []
    launch = LocalStages._launch

    def recording(self, i, mode):
        proc = launch(self, i, mode)
        started.append(proc)
        return proc

    monkeypatch.setattr(LocalStages, "_launch", recording)
    # (in this process: no logging set up on the captured stderr, which later tests would log to once closed)
    monkeypatch.setattr(cli, "configure", lambda **kw: None)
    monkeypatch.setattr(cli, "tune_allocator", lambda: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)     # (nor this process's torch threads)
    monkeypatch.delenv("SPECPIPE_DEBUG", raising=False)
    missing = tiny_model.parent / "no-such-draft"
    code = cli.main(["run", "hi", "--model", str(tiny_model), "--stages", "2", "--draft", "model",
                     "--draft-model", str(missing)])
    err = capsys.readouterr().err
    assert code == 1 and str(missing) in err and "Traceback" not in err, err
    assert "ready (" not in err, "the wrong draft waited for the stages"     # (seconds apart: a stage imports torch)
    assert len(started) == 2 and all(p.poll() is not None for p in started)


def test_run_ends_on_a_failed_stage_without_waiting_for_the_draft(tiny_model, monkeypatch, capsys):
    """The other way round: a stage that fails to start ends `specpipe run` while the draft is still loading
    (here: held until the command has returned; `asyncio.to_thread` would keep the process until it is done)."""
    import coordinator.cli.main as cli
    from coordinator.engine.local import LocalStages
    from coordinator.frontends.service import ModelParts

    gate = threading.Event()

    def loading(config):
        gate.wait(120)
        raise RuntimeError("the test's loader, released after the command returned")

    async def stage_fails(self, timeout_s=300.0, on_ready=None):
        raise RuntimeError("stage 1 exited with code 1")

    monkeypatch.setattr(ModelParts, "load", staticmethod(loading))
    monkeypatch.setattr(LocalStages, "wait_ready", stage_fails)
    monkeypatch.setattr(cli, "configure", lambda **kw: None)
    monkeypatch.setattr(cli, "tune_allocator", lambda: None)
    monkeypatch.delenv("SPECPIPE_DEBUG", raising=False)
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(cli.main(["run", "hi", "--model", str(tiny_model),
                                                                    "--stages", "1"])))
    try:
        runner.start()
        runner.join(60)
        assert not runner.is_alive(), "specpipe run waited for the draft's load"
        assert not gate.is_set() and codes == [1]
        assert "stage 1 exited with code 1" in capsys.readouterr().err
    finally:
        gate.set()
        runner.join(60)
