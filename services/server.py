"""The stage process: `specpipe stage ...` (or `python -m services.server ...`)."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

import torch

from protos import stage_pb2, stage_pb2_grpc
from services.config import MiB, StageConfig
from common.grpc_server import Server
from common.logs import configure, get_logger
from common.memory import tune_allocator
from common.metrics_http import serve_metrics
from services.model.loader import resolve_model, stderr_log
from services.model.shard import even_split, load_shard
from common.options import service_parser
from common.process import after_load, as_program, before_exit
from services.runner import StageRunner
from services.servicer import StageServicer

SERVICE_NAME = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name


def build_runner(config: StageConfig) -> tuple[StageRunner, str]:
    torch.set_num_threads(config.threads)
    model_ref = resolve_model(config.model, log=stderr_log)
    first, last = config.first_layer, config.last_layer
    if first < 0:
        from transformers import AutoConfig
        num_layers = AutoConfig.from_pretrained(model_ref).num_hidden_layers
        first, last = even_split(num_layers, config.num_stages)[config.stage]
    shard = load_shard(model_ref, first, last, config.torch_dtype, config.device)
    return StageRunner(shard, config.stage, kv_limit_bytes=int(config.kv_limit_mb * MiB)), model_ref


async def serve(config: StageConfig) -> None:
    log = get_logger("specpipe.stage")
    runner, model_ref = build_runner(config)
    frozen = after_load()                   # in a program: loading's heap left out of every collection
    servicer = StageServicer(runner, config, model_name=Path(model_ref).name, model_ref=model_ref)
    server = Server([SERVICE_NAME], config.max_message_mb * MiB)
    stage_pb2_grpc.add_StageServicer_to_server(servicer, server.server)
    port = server.bind(config.host, config.port, config.tls.mutual_server_credentials())
    if config.health_port:
        server.bind_health(config.host, config.health_port)
    servicer.start()
    await server.start()
    metrics_http = await serve_metrics(config.host, config.metrics_port) if config.metrics_port else None
    if metrics_http is not None:
        log.info("metrics serving", port=config.metrics_port)
    log.info("stage serving", stage=config.stage, layers=f"{runner.shard.first}:{runner.shard.last}",
             port=port, next_hop=config.next_hop or "coordinator", dtype=config.dtype, device=config.device,
             stage_time_ms=config.stage_time_ms, tls="mutual" if config.tls.enabled else "off",
             frozen_objects=frozen,
             **({"coordinator_identity": config.tls_coordinator_name,
                 "forward_identities": ",".join(sorted(config.peer_names.allowed("Forward"))),
                 "peer_template": config.tls_peer_template or "(off)"} if config.tls.enabled else {}))
    if config.port_file:
        tmp = f"{config.port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, config.port_file)
    watcher = asyncio.create_task(exit_with_parent(config.parent_pid)) if config.parent_pid else None
    try:
        await server.serve_until_signal(config.grace_s, on_stop=servicer.close)
    finally:
        if watcher is not None:
            watcher.cancel()
        if metrics_http is not None:
            await metrics_http.cleanup()


async def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """SIGTERM this process (the drain of `serve_until_signal`) once `parent_pid` is no longer its parent:
    the process that started it died, however (even by SIGKILL), and it was re-parented."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(poll_s)
    get_logger("specpipe.stage").warning("the process that started this stage is gone: stopping",
                                         parent_pid=parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


EXAMPLES = """examples (a 2-stage pipeline on one machine; then `specpipe coordinator`):
  specpipe stage --stage 0 --num-stages 2 --port 50061 --next-hop 127.0.0.1:50062
  specpipe stage --stage 1 --num-stages 2 --port 50062
  specpipe stage --model ~/models/llama --stage 0 --num-stages 4 --layers 0:8 --device cuda:0 \\
      --dtype bfloat16 --next-hop stage-1:50061
  specpipe stage --stage auto --num-stages 4 \\
      --next-hop 'rel-specpipe-stage-{next}.rel-specpipe-stage:50061'     # in a StatefulSet pod
  specpipe stage --tls-cert stage.crt --tls-key stage.key --tls-ca ca.crt \\
      --tls-coordinator-name specpipe-coordinator --tls-peer-names specpipe-stage   # mutual TLS
  specpipe stage --stage auto --tls-cert pod.crt --tls-key pod.key --tls-ca ca.crt \\
      --tls-peer-template 'rel-specpipe-stage-{index}'   # a certificate per stage: Forward from i-1
"""


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser("specpipe stage", "Serve one pipeline stage.", EXAMPLES, "SPECPIPE_STAGE",
                            "SPECPIPE_TLS_CERT")
    StageConfig.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = StageConfig.from_args(args)
    except ValueError as e:                 # e.g. a TLS certificate without its CA: refused before loading
        parser.error(str(e))
    configure()
    tune_allocator()
    asyncio.run(serve(config))
    return 0


def forked_main(argv: list[str]) -> int:
    """A stage forked from a launcher's preloaded fork server (`common/forkserver.py`, as `LocalStages` starts
    them): `python -m services.server argv`, watching the fork server as its parent (`--parent-pid`: the fork
    server exits with the launcher, however the launcher ends)."""
    as_program()
    return main([*argv, "--parent-pid", str(os.getppid())])   # (then os._exit: no teardown to speed up)


if __name__ == "__main__":
    as_program()             # (its heap is frozen once loaded: common/process.py)
    code = main()
    before_exit()            # (not in main(): tests call it in their own process)
    raise SystemExit(code)
