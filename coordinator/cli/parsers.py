"""The `specpipe` parsers: the top-level one, each subcommand's flags and its examples (`build_parser`), and
`specpipe generate`'s alone (`_generate_parser`: no torch, so it starts fast). Building them runs nothing;
coordinator/cli/main.py dispatches on what they parse, and coordinator/cli/reference.py renders them as
docs/cli.md.
"""
from __future__ import annotations

import argparse
from typing import NoReturn

from common.options import add_flag

EXAMPLES = """examples:
  specpipe run "What is the capital of France?" --stages 4
  specpipe run "def fib(n):" --raw --method pp --max-new-tokens 32 --json
  specpipe run "Write a haiku." --stages 8 --draft quant --width 16 --tree-policy best-first --stage-time-ms 120
  specpipe local --stages 4 --port 50051          # then, in another shell:
  specpipe generate "Hello!" --addr 127.0.0.1:50051
"""
BENCH_EXAMPLES = """examples:
  specpipe bench --stages 8 --stage-time-ms 120 --methods pp,specpipe --widths 1,4,16 \\
      --tree-policies layer,best-first --out out/bench
  specpipe bench --simulate --stages 4,8,16,32 --stage-time-ms 120 --out out/sim
  specpipe bench --simulate --stages 8 --stage-time-ms 120+0.25 --draft-time-ms 36+0.075 --out out/sim8
  specpipe bench --simulate --regime gpu --methods pp,tree,pipeinfer,specpipe --out out/gpu
  specpipe bench --concurrency 1,4,8,16 --methods cb-pp,specpipe --stages 4 --out out/load
"""
LOCAL_EXAMPLES = """examples:
  specpipe local --stages 4 --port 50051                      # serve until Ctrl-C
  specpipe local --stages 2 --method pp --max-active 8 --kv-limit-mb 512
  specpipe local --stages 4 --metrics-port 9160    # metrics: coordinator :9160, stages :9161-9164
  specpipe local --model ~/models/Qwen2.5-0.5B-Instruct --stages 4 --device cuda --dtype bfloat16
then, in another shell:
  specpipe generate "Name three rivers." --addr 127.0.0.1:50051
"""
GENERATE_EXAMPLES = """examples:
  specpipe generate "Name three rivers." --addr 127.0.0.1:50051
  specpipe generate "def fib(n):" --raw --max-new-tokens 32 --method sps --json
  specpipe generate "Tell a story." --temperature 0.8 --top-p 0.95 --seed 7 --stop "The end"
  SPECPIPE_API_TOKEN=... specpipe generate "Hi" --addr api.example.com:443 --tls-ca ca.crt

The text streams to stdout; one summary line goes to stderr at the end:
  [32 tokens (length), 1.94 tokens/step, 21.3 ms between tokens, first token after 140 ms, 0.82 s]
"""


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (`specpipe: error: ...`, exit code 1) instead of usage + message, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"specpipe: error: {message} (see `{self.prog} --help`)\n")


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    from coordinator.config import add_spec_arguments as add      # imports torch: only where needed
    add(p)


def _generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--method", default="",
                   help="specpipe, pp, cb-pp, sps, tree or pipeinfer (default: the server's, specpipe)")
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


def _top_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = _Parser(prog="specpipe", description="Pipeline-parallel LLM serving with speculative decoding.",
                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser, parser.add_subparsers(dest="command", required=True)


def build_parser() -> argparse.ArgumentParser:
    parser, sub = _top_parser()
    p = sub.add_parser("run", help="start a local pipeline, generate once, stop", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _generation_args(p)
    _pipeline_args(p)
    p.add_argument("--warmup-tokens", type=int, default=64,
                   help="before the prompt, calibrate specpipe's cost rule with a generation of up to this many "
                        "tokens from a fixed prompt, ended once the rule has decided (0: off; the rule then "
                        "learns inside your request); its time is printed apart")
    p = sub.add_parser("local", help="serve a local pipeline (stages + coordinator) until Ctrl-C",
                       epilog=LOCAL_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _pipeline_args(p)
    p.add_argument("--port", type=int, default=50051, help="coordinator port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--method", default="specpipe", help="default method")
    p.add_argument("--max-active", type=int, default=64, help="requests running at once")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for admission; more are refused with RESOURCE_EXHAUSTED")
    p.add_argument("--kv-limit-mb", type=float, default=0.0,
                   help="K/V memory limit of every stage for all requests together (0 = none)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="port of the OpenAI-compatible HTTP API (/v1/chat/completions, ...; 0 = off)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus metrics: the coordinator on this port, stage i on this port + 1 + i (0 = off)")
    _add_generate(sub)
    p = sub.add_parser("bench", help="methods side by side over a local pipeline; writes DIR/results.json",
                       epilog=BENCH_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    from coordinator.bench.run import main_args
    main_args(p)
    p = sub.add_parser("bench-hop", help="what one stage hop costs over real gRPC on 127.0.0.1 (encode, wire, "
                       "decode)")
    from coordinator.bench.hop import add_arguments as hop_arguments
    hop_arguments(p)
    sub.add_parser("stage", help="serve one pipeline stage (container entrypoint; see `specpipe stage --help`)",
                   add_help=False)
    sub.add_parser("coordinator", help="serve the public API over stages (container entrypoint; see "
                   "`specpipe coordinator --help`)", add_help=False)
    return parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a generation from a running coordinator",
                       epilog=GENERATE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _generation_args(p)
    p.add_argument("--addr", default="127.0.0.1:50051", help="coordinator HOST:PORT")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the call is given up")
    add_flag(p, "--tls-ca", "", "connect over TLS, trusting this CA bundle (PEM)", env="SPECPIPE_API_TLS_CA")
    p.add_argument("--insecure", action="store_true",
                   help="send --token without TLS to another machine (only on a trusted network)")
    add_flag(p, "--token", "", "bearer token of the API (prefer the SPECPIPE_API_TOKEN environment variable)",
             env="SPECPIPE_API_TOKEN")


def _generate_parser() -> argparse.ArgumentParser:
    """`specpipe generate` alone: it needs neither torch nor the pipeline options, so it starts fast."""
    parser, sub = _top_parser()
    _add_generate(sub)
    return parser
