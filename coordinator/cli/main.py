"""The `specpipe` command line: run, local, generate, bench, stage, coordinator (their parsers: parsers.py).

Errors reach the user as one line, `specpipe: error: ...`, exit code 1 (Ctrl-C: 130); SPECPIPE_DEBUG=1 shows
the traceback instead.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from common.logs import configure
from common.memory import tune_allocator
from common.process import as_program, before_exit

from coordinator.cli.parsers import _generate_parser, build_parser    # (tests import them from here too)

if TYPE_CHECKING:                       # imported lazily at run time: `specpipe generate` needs no torch
    from coordinator.config import CoordinatorConfig
    from coordinator.engine.local import LocalStages
    from coordinator.frontends.service import GenerateInput, ModelParts

T = TypeVar("T")


def spec_kwargs(args: argparse.Namespace) -> dict:
    from coordinator.config import spec_kwargs as kwargs
    return kwargs(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        return 130
    except Exception as e:   # one clear line, not a traceback
        if os.environ.get("SPECPIPE_DEBUG"):
            raise
        print(f"specpipe: error: {error_message(e)}", file=sys.stderr, flush=True)
        return 1


def entry() -> int:
    """The `specpipe` console script: `main`, then the quick way out (`before_exit`; not in `main`, which
    tests call in their own process). A program: its heap is frozen once the model has loaded
    (common/process.py)."""
    as_program()
    code = main()
    before_exit()
    return code


def _dispatch(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "generate":
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")    # no gRPC core INFO lines (TLS handshakes) on stderr
    if command == "stage":
        from services.server import main as stage_main
        return stage_main(argv[1:])
    if command == "coordinator":
        from coordinator.frontends.server import main as coordinator_main
        return coordinator_main(argv[1:])
    args = (_generate_parser() if command == "generate" else build_parser()).parse_args(argv)
    # one-shot commands keep the terminal for the text; `local` shows its service logs
    configure(level=None if args.command == "local" or os.environ.get("SPECPIPE_LOG_LEVEL") else "warning")
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "bench-hop":
        from coordinator.bench.hop import main as hop_main
        return hop_main(args)
    tune_allocator()          # run, local, bench host a coordinator; local's stages tune their own
    commands = {"run": cmd_run, "local": cmd_local, "bench": cmd_bench}
    return asyncio.run(commands[args.command](args))


def error_message(e: BaseException) -> str:
    """What the user reads after `specpipe: error: `: the server's details for a failed call, the message
    otherwise (a multi-line message, say a stage's log tail, keeps its further lines below)."""
    import grpc

    from client import SpecPipeError

    if isinstance(e, SpecPipeError):
        if e.refused:
            return f"cannot reach the coordinator at {e.addr} (is `specpipe local` running?)"
        if e.unreachable:
            hint = (" (a TLS server? then give --tls-ca)" if "Socket closed" in e.message else
                    " (a plaintext server? then drop --tls-ca)" if "WRONG_VERSION_NUMBER" in e.message else
                    " (check --tls-ca and the server's certificate)" if "andshake" in e.message else "")
            return f"cannot reach the coordinator at {e.addr}: {e.message}{hint}"
        if e.code == "DEADLINE_EXCEEDED":
            return f"{e.addr} did not finish within the timeout (--timeout)"
        return f"{e.message} ({e.code})"
    if isinstance(e, grpc.RpcError) and hasattr(e, "details"):
        return f"{e.details()} ({e.code().name})"
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return text if isinstance(e, (ValueError, RuntimeError, OSError)) else f"{type(e).__name__}: {text}"


def _input(args: argparse.Namespace) -> GenerateInput:
    from coordinator.frontends.service import GenerateInput
    return GenerateInput(prompt=args.prompt, raw=args.raw, max_new_tokens=args.max_new_tokens,
                         method=args.method, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                         seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


async def _start_local(args: argparse.Namespace, make_config: Callable[[str, list[str]], CoordinatorConfig]
                       ) -> tuple[CoordinatorConfig, LocalStages, ModelParts]:
    """Start the stage processes and, beside them, load what the coordinator reads from model folders alone
    (tokenizer, draft: `ModelParts`), so the coordinator connects as soon as the stages are ready. The first
    failure of either (or Ctrl-C) stops the stages and is raised at once: a bad --draft-model does not wait for
    the stages, a stage that exits does not wait for the draft (its load runs on in a daemon thread that the
    process does not join)."""
    from coordinator.engine.local import LocalStages
    from coordinator.cli.progress import resolve_with_progress
    from coordinator.frontends.service import ModelParts

    model = await asyncio.to_thread(resolve_with_progress, args.model)
    stages = LocalStages(args.stages, model=model, dtype=args.dtype, device=args.device,
                         threads=args.threads, stage_time_ms=args.stage_time_ms,
                         kv_limit_mb=getattr(args, "kv_limit_mb", 0.0),
                         metrics_port=getattr(args, "metrics_port", 0))
    began, ready = time.monotonic(), []

    def on_ready(i: int) -> None:
        ready.append(i)
        print(f"specpipe: stage {i} ready ({len(ready)}/{args.stages}, {time.monotonic() - began:.1f} s)",
              file=sys.stderr, flush=True)
    waiting, loading = None, None
    try:
        config = make_config(model, stages.plan())
        loading = _in_daemon_thread(ModelParts.load, config)
        print(f"specpipe: starting {args.stages} stage process(es) (logs in {stages.log_dir})", file=sys.stderr,
              flush=True)
        stages.start()                        # (the draft loads meanwhile: the first launch waits for imports)
        waiting = asyncio.ensure_future(stages.wait_ready(on_ready=on_ready))
        await asyncio.wait({waiting, loading}, return_when=asyncio.FIRST_EXCEPTION)
        if loading.done():
            loading.result()                  # (raises its error, if it failed, without waiting for the stages)
        await waiting
        return config, stages, await loading
    except BaseException:
        for task in (waiting, loading):
            if task is None:
                continue
            if task.done() and not task.cancelled():
                task.exception()              # retrieved: the one raised below is the error shown
            task.cancel()
        stages.stop()
        raise


def _in_daemon_thread(fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
    """fn(*args) on a daemon thread, as a future of the running loop (`asyncio.wrap_future`). Unlike
    `asyncio.to_thread`, whose executor `asyncio.run` joins on the way out, a process that gives up on it exits
    without waiting for it."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():     # given up on before it started
            return
        try:
            done.set_result(fn(*args))
        except BaseException as e:            # noqa: BLE001 — handed to the awaiting task
            done.set_exception(e)

    threading.Thread(target=run, name=f"specpipe-{getattr(fn, '__qualname__', 'load')}", daemon=True).start()
    return asyncio.wrap_future(done)


async def cmd_run(args: argparse.Namespace) -> int:
    from coordinator.config import CoordinatorConfig
    from coordinator.frontends.service import Coordinator
    from coordinator.core.stats import RequestStats

    def make_config(model: str, addresses: list[str]) -> CoordinatorConfig:
        return CoordinatorConfig(stages=tuple(addresses), model=model, method=args.method or "specpipe",
                                 max_new_tokens_cap=1 << 20, **spec_kwargs(args))
    config, stages, parts = await _start_local(args, make_config)
    coordinator = None
    try:
        coordinator = await Coordinator.connect(config, parts)
        warmup_s = await coordinator.warm_up(args.warmup_tokens)
        started = time.perf_counter()
        text, ids, last = [], [], None
        async for chunk in coordinator.generate(_input(args)):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            if not args.json and chunk.text:
                print(chunk.text, end="", flush=True)
            last = chunk
        wall = time.perf_counter() - started
        stats = last.stats or RequestStats()
        shown = ("steps", "tokens_per_step", "tbt_ms", "ttft_ms", "prompt_tokens", "wall_ms")
        result = {"text": "".join(text), "token_ids": ids, "method": config.method, "stages": args.stages,
                  "finish_reason": last.finish_reason, "steps": stats.steps,
                  "tokens_per_step": stats.tokens_per_step, "tbt_ms": stats.tbt_ms, "ttft_ms": stats.ttft_ms,
                  "prompt_tokens": stats.prompt_tokens, "wall_s": wall, "warmup_s": warmup_s,
                  "counters": {k: v for k, v in stats.as_dict().items() if k not in shown}}
        if args.json:
            print(json.dumps(result))
        else:
            print()
            print(summary_line(len(ids), last.finish_reason, stats.tokens_per_step, stats.tbt_ms, stats.ttft_ms,
                               stats.wall_ms / 1e3, stats.sized_width, warmup_s, sized_topk=stats.sized_topk),
                  file=sys.stderr, flush=True)
        return 0
    finally:
        if coordinator is not None:
            await coordinator.close()
        stages.stop()


def summary_line(tokens: int, finish_reason: str, tokens_per_step: float, tbt_ms: float, ttft_ms: float,
                 wall_s: float, sized_width: float | None = None, warmup_s: float = 0.0,
                 sized_topk: float | None = None) -> str:
    """The one line `specpipe run` and `specpipe generate` print to stderr after the text (from the final
    stats: mean time between tokens, time to first token, the server's wall time; for specpipe sized by its
    cost rule, the width (and topk) it ended at or "no speculation", and the rule's warm-up before the request)."""
    topk = f" topk {int(sized_topk)}" if sized_topk else ""
    rule = "" if sized_width is None else \
        f", cost rule: {f'width {int(sized_width)}{topk}' if sized_width else 'no speculation'}"
    rule += f" after a {warmup_s:.1f} s warm-up" if warmup_s > 0 else ""
    return (f"[{tokens} tokens ({finish_reason or 'unfinished'}), {tokens_per_step:.2f} tokens/step, "
            f"{tbt_ms:.1f} ms between tokens, first token after {ttft_ms:.0f} ms, {wall_s:.2f} s{rule}]")


async def cmd_local(args: argparse.Namespace) -> int:
    from coordinator.config import CoordinatorConfig
    from coordinator.frontends.openai.api import served_model_name
    from coordinator.frontends.server import start, start_http

    def make_config(model: str, addresses: list[str]) -> CoordinatorConfig:
        return CoordinatorConfig(stages=tuple(addresses), model=model, host=args.host, port=args.port,
                                 method=args.method, max_active=args.max_active, max_queue=args.max_queue,
                                 served_model_name=(served_model_name(args.model),), **spec_kwargs(args))
    config, stages, parts = await _start_local(args, make_config)
    supervisor = asyncio.create_task(stages.supervise())      # a stage process that dies is restarted
    server = coordinator = http = metrics_http = None
    try:
        server, coordinator = await start(config, parts)
        if args.metrics_port:
            from common.metrics_http import serve_metrics
            metrics_http = await serve_metrics(args.host, args.metrics_port)
            print(f"specpipe: metrics at http://{args.host}:{args.metrics_port}/metrics (stage i: port "
                  f"{args.metrics_port} + 1 + i)", file=sys.stderr)
        if args.http_port:
            http = await start_http(config, coordinator, args.http_port)
        where = f"{args.host}:{server.port} (specpipe.v1.Generation)"
        if http is not None:
            where += f" and http://{args.host}:{http.port}/v1 (OpenAI API, model {http.model!r})"
        print(f"specpipe: serving {args.stages} stage(s) at {where}; Ctrl-C stops", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("specpipe: stopping", file=sys.stderr)
        return 0
    finally:
        if metrics_http is not None:
            await metrics_http.cleanup()
        if http is not None:
            await http.stop()
        if server is not None:
            await server.stop(2.0)
        if coordinator is not None:
            await coordinator.close()
        supervisor.cancel()
        stages.stop()


async def cmd_bench(args: argparse.Namespace) -> int:
    from coordinator.bench.repeats import combine
    from coordinator.bench.run import config_from_args, log_stderr, measure_bench, table, write_results
    from coordinator.cli.progress import resolve_with_progress

    if args.draft_time_ms is not None and not args.simulate:
        raise ValueError("--draft-time-ms models the draft's time on the simulated clock: add --simulate, or drop "
                         "it (real runs time the draft as it runs)")
    if not args.simulate and (args.hop_ms is not None or args.control_time != "measured" or args.regime == "gpu"):
        raise ValueError("--hop-ms, --control-time and --regime gpu model time on the simulated clock: add "
                         "--simulate, or drop them (real runs take the time they take)")
    cfg = config_from_args(args)
    cfg.model = await asyncio.to_thread(resolve_with_progress, cfg.model)
    if args.simulate and (cfg.temperature or cfg.verifies):
        raise ValueError("--simulate runs greedy requests; drop --temperature and --verifies, or --simulate")
    from coordinator.bench.sim import run_simulated
    runs = []
    for i in range(cfg.repeats):        # (bench/repeats.py: the median run, every run's figures beside it)
        if cfg.repeats > 1:
            log_stderr(f"run {i + 1}/{cfg.repeats}")
        runs.append(await asyncio.to_thread(run_simulated, cfg, log=log_stderr) if args.simulate
                    else await measure_bench(cfg, log=log_stderr))
    result = write_results(combine(runs), cfg.out)
    print(table(result))
    print(f"results: {cfg.out}/results.json; plots: {', '.join(result.get('plots', []))}", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream the text to stdout, then one summary line to stderr (or, with --json, one JSON object)."""
    from client import Client

    options = dict(raw=args.raw, method=args.method, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                   stop=args.stop, ignore_eos=args.ignore_eos)
    with Client(args.addr, tls_ca=args.tls_ca or None, token=args.token or None, timeout=args.timeout,
                insecure=args.insecure) as client:
        stream = client.generate(args.prompt, **options)
        printed = False
        try:
            for delta in stream:
                if not args.json:
                    print(delta, end="", flush=True)
                    printed = True
        except BaseException:
            if printed:
                print(flush=True)          # the error (or Ctrl-C) starts a line of its own
            raise
        done = stream.result
    s = done.stats
    if args.json:
        print(json.dumps({"text": done.text, "token_ids": done.token_ids, "finish_reason": done.finish_reason,
                          "steps": s.steps, "tokens_per_step": s.tokens_per_step, "tbt_ms": s.tbt_ms,
                          "ttft_ms": s.ttft_ms, "prompt_tokens": s.prompt_tokens, "wall_s": done.wall_s,
                          "request_id": done.request_id, "counters": s.counters}))
    else:
        print(flush=True)
        print(summary_line(len(done.token_ids), done.finish_reason, s.tokens_per_step, s.tbt_ms, s.ttft_ms,
                           s.wall_ms / 1e3, s.counters.get("sized_width"), sized_topk=s.counters.get("sized_topk")),
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry())
