"""The `specpipe` command line: run, local, generate, stage, coordinator."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

from coordinator.config import add_spec_arguments, spec_kwargs
from services.logs import configure

EXAMPLES = """examples:
  specpipe run "What is the capital of France?" --stages 4
  specpipe run "def fib(n):" --raw --method pp --max-new-tokens 32 --json
  specpipe run "Write a haiku." --stages 8 --draft quant --width 16 --tree-policy best-first --stage-time-ms 120
  specpipe local --stages 4 --port 50051          # then, in another shell:
  specpipe generate "Hello!" --addr 127.0.0.1:50051
"""


def _generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--method", default="", help="specpipe, pp, cb-pp, sps, tree or pipeinfer (default: the server's, specpipe)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="raw", action="store_false", default=False,
                      help="apply the model's chat template (default)")
    mode.add_argument("--raw", dest="raw", action="store_true", help="send the prompt as is")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of text")


def _pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, default=4, help="number of stage processes")
    p.add_argument("--model", default="default", help="HF folder; 'default' = embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    p.add_argument("--stage-time-ms", default="0", help="emulated stage time A or A+B ms (per step + per row)")
    add_spec_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpipe", description="Pipeline-parallel LLM serving with "
                                     "speculative decoding.", epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="start a local pipeline, generate once, stop", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _generation_args(p)
    _pipeline_args(p)
    p = sub.add_parser("local", help="serve a local pipeline (stages + coordinator) until Ctrl-C")
    _pipeline_args(p)
    p.add_argument("--port", type=int, default=50051, help="coordinator port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--method", default="specpipe", help="default method")
    p.add_argument("--max-active", type=int, default=64, help="requests running at once")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for admission; more are refused with RESOURCE_EXHAUSTED")
    p.add_argument("--kv-limit-mb", type=float, default=0.0,
                   help="K/V memory limit of every stage for all requests together (0 = none)")
    p = sub.add_parser("generate", help="stream a generation from a running coordinator")
    _generation_args(p)
    p.add_argument("--addr", default="127.0.0.1:50051", help="coordinator HOST:PORT")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--tls-ca", default=os.environ.get("SPECPIPE_API_TLS_CA", ""),
                   help="connect over TLS, trusting this CA bundle (PEM)")
    p.add_argument("--token", default=os.environ.get("SPECPIPE_API_TOKEN", ""),
                   help="bearer token of the API (prefer the SPECPIPE_API_TOKEN environment variable)")
    p = sub.add_parser("bench", help="methods side by side over a local pipeline; writes DIR/results.json",
                       epilog="example:\n  specpipe bench --stages 8 --stage-time-ms 120 --methods pp,specpipe "
                              "--widths 1,4,16 --tree-policies layer,best-first --out out/bench",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    from coordinator.bench import main_args
    main_args(p)
    sub.add_parser("stage", help="serve one pipeline stage (container entrypoint)", add_help=False)
    sub.add_parser("coordinator", help="serve the public API over stages (container entrypoint)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "stage":
        from services.server import main as stage_main
        return stage_main(argv[1:])
    if argv and argv[0] == "coordinator":
        from coordinator.server import main as coordinator_main
        return coordinator_main(argv[1:])
    args = build_parser().parse_args(argv)
    # one-shot commands keep the terminal for the text; `local` shows its service logs
    configure(level=None if args.command == "local" or os.environ.get("SPECPIPE_LOG_LEVEL") else "warning")
    try:
        if args.command == "run":
            return asyncio.run(cmd_run(args))
        if args.command == "local":
            return asyncio.run(cmd_local(args))
        if args.command == "generate":
            return asyncio.run(cmd_generate(args))
        if args.command == "bench":
            return asyncio.run(cmd_bench(args))
    except KeyboardInterrupt:
        return 130
    except Exception as e:   # one clear line, not a traceback
        print(f"specpipe: error: {e}", file=sys.stderr)
        return 1
    return 2


def _input(args):
    from coordinator.service import GenerateInput
    return GenerateInput(prompt=args.prompt, raw=args.raw, max_new_tokens=args.max_new_tokens,
                         method=args.method, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                         seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


async def _start_local(args):
    from coordinator.local import LocalStages
    from services.model.loader import resolve_model, stderr_log

    model = await asyncio.to_thread(resolve_model, args.model, stderr_log)
    stages = LocalStages(args.stages, model=model, dtype=args.dtype, device=args.device,
                         threads=args.threads, stage_time_ms=args.stage_time_ms,
                         kv_limit_mb=getattr(args, "kv_limit_mb", 0.0))
    stages.start()
    print(f"specpipe: starting {args.stages} stage process(es) (logs in {stages.log_dir})", file=sys.stderr)
    try:
        await stages.wait_ready()
    except BaseException:
        stages.stop()
        raise
    return model, stages


async def cmd_run(args) -> int:
    from coordinator.config import CoordinatorConfig
    from coordinator.service import Coordinator

    model, stages = await _start_local(args)
    coordinator = None
    try:
        config = CoordinatorConfig(stages=tuple(stages.addresses), model=model, method=args.method or "specpipe",
                                   max_new_tokens_cap=1 << 20, **spec_kwargs(args))
        coordinator = await Coordinator.connect(config)
        started = time.perf_counter()
        text, ids, last = [], [], None
        async for chunk in coordinator.generate(_input(args)):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            if not args.json and chunk.text:
                print(chunk.text, end="", flush=True)
            last = chunk
        wall = time.perf_counter() - started
        stats = last.stats or {}
        result = {"text": "".join(text), "token_ids": ids, "method": config.method, "stages": args.stages, "finish_reason": last.finish_reason,
                  "steps": int(stats.get("steps", 0)), "tokens_per_step": stats.get("tokens_per_step", 0.0),
                  "tbt_ms": stats.get("tbt_ms", 0.0), "ttft_ms": stats.get("ttft_ms", 0.0),
                  "prompt_tokens": int(stats.get("prompt_tokens", 0)), "wall_s": wall,
                  "counters": {k: v for k, v in stats.items() if k not in ("steps", "tokens_per_step",
                               "tbt_ms", "ttft_ms", "prompt_tokens", "wall_ms")}}
        if args.json:
            print(json.dumps(result))
        else:
            print()
            _summary(len(ids), stats, wall)
        return 0
    finally:
        if coordinator is not None:
            await coordinator.close()
        stages.stop()


def _summary(tokens: int, stats: dict, wall_s: float) -> None:
    print(f"[{tokens} tokens, {stats.get('tokens_per_step', 0):.2f} tokens/step, time between tokens "
          f"{stats.get('tbt_ms', 0):.1f} ms, first token {stats.get('ttft_ms', 0):.0f} ms, "
          f"{wall_s:.2f} s]", file=sys.stderr)


async def cmd_local(args) -> int:
    from coordinator.config import CoordinatorConfig
    from coordinator.server import start

    model, stages = await _start_local(args)
    server = coordinator = None
    try:
        config = CoordinatorConfig(stages=tuple(stages.addresses), model=model, host=args.host,
                                   port=args.port, method=args.method, max_active=args.max_active,
                                   max_queue=args.max_queue, **spec_kwargs(args))
        server, coordinator = await start(config)
        print(f"specpipe: serving {args.stages} stage(s) at {args.host}:{server.port} "
              f"(specpipe.v1.Generation); Ctrl-C stops", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("specpipe: stopping", file=sys.stderr)
        return 0
    finally:
        if server is not None:
            await server.stop(2.0)
        if coordinator is not None:
            await coordinator.close()
        stages.stop()


async def cmd_bench(args) -> int:
    from coordinator.bench import config_from_args, log_stderr, run_bench, table
    from services.model.loader import resolve_model, stderr_log

    cfg = config_from_args(args)
    cfg.model = await asyncio.to_thread(resolve_model, cfg.model, stderr_log)
    if args.simulate and (cfg.load or cfg.temperature or cfg.verifies):
        raise ValueError("--simulate runs one greedy request at a time; drop --concurrency, --temperature "
                         "and --verifies, or --simulate")
    if args.simulate:
        from coordinator.bench import write_results
        from coordinator.bench_sim import run_simulated
        result = write_results(await asyncio.to_thread(run_simulated, cfg, log=log_stderr), cfg.out)
    else:
        result = await run_bench(cfg, log=log_stderr)
    print(table(result))
    print(f"results: {cfg.out}/results.json; plots: {', '.join(result.get('plots', []))}", file=sys.stderr)
    return 0


async def cmd_generate(args) -> int:
    import grpc

    from protos import generation_pb2, generation_pb2_grpc
    from services.tls import TLSFiles, open_channel

    req = generation_pb2.GenerateRequest(prompt=args.prompt, raw=args.raw, method=args.method,
                                         temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                         seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.max_new_tokens is not None:
        req.max_new_tokens = args.max_new_tokens
    started = time.perf_counter()
    ids, text, last = [], [], None
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    async with open_channel(args.addr, TLSFiles(ca=args.tls_ca) if args.tls_ca else None) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            async for msg in stub.Generate(req, timeout=args.timeout, metadata=metadata):
                ids.extend(msg.token_ids)
                text.append(msg.text)
                if not args.json and msg.text:
                    print(msg.text, end="", flush=True)
                last = msg
        except grpc.aio.AioRpcError as e:
            raise RuntimeError(f"{e.code().name}: {e.details()}") from None
    wall = time.perf_counter() - started
    s = last.stats
    stats = {"steps": s.steps, "tokens_per_step": s.tokens_per_step, "tbt_ms": s.tbt_ms, "ttft_ms": s.ttft_ms}
    if args.json:
        print(json.dumps({"text": "".join(text), "token_ids": ids, "finish_reason": last.finish_reason,
                          **stats, "wall_s": wall, "counters": dict(s.counters)}))
    else:
        print()
        _summary(len(ids), stats, wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
