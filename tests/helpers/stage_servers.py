"""In-process stage servers on 127.0.0.1 (same event loop as the test) for fast gRPC tests, and a coordinator
with its gRPC API served over them."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from protos import stage_pb2_grpc
from services.config import MiB, StageConfig
from common.grpc_server import Server
from services.server import SERVICE_NAME, build_runner
from services.servicer import StageServicer

from coordinator.engine.local import LocalStages, free_ports
from coordinator.config import CoordinatorConfig
from coordinator.frontends.server import ApiServer, start
from coordinator.frontends.service import Coordinator


@asynccontextmanager
async def stage_servers(model: str, num_stages: int, stage_time_ms: str = "0", kv_limit_mb: float = 0.0,
                        tls: dict | list[dict] | None = None):
    """Yield (addresses, servicers) of num_stages stages serving `model`, wired into a pipeline. `tls`: StageConfig
    fields of every stage (tls_cert=..., tls_ca=...), or a list of them, one per stage (a certificate each)."""
    per_stage = tls if isinstance(tls, list) else [tls or {}] * num_stages
    assert len(per_stage) == num_stages, f"{len(per_stage)} TLS settings for {num_stages} stages"
    ports = free_ports(num_stages)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    servers, servicers = [], []
    try:
        for i, port in enumerate(ports):
            config = StageConfig(model=model, stage=i, num_stages=num_stages, port=port,
                                 next_hop=addresses[i + 1] if i + 1 < num_stages else "",
                                 stage_time_ms=stage_time_ms, kv_limit_mb=kv_limit_mb, **per_stage[i])
            runner, _ = build_runner(config)
            servicer = StageServicer(runner, config, model_name="test", model_ref=model)
            server = Server([SERVICE_NAME], config.max_message_mb * MiB)
            stage_pb2_grpc.add_StageServicer_to_server(servicer, server.server)
            server.bind(config.host, port, config.tls.server_credentials())
            servicer.start()
            await server.start()
            servers.append(server)
            servicers.append(servicer)
        yield addresses, servicers
    finally:
        for server, servicer in zip(servers, servicers):
            await server.stop(0)
            await servicer.close()


@dataclass
class ServedCoordinator:
    """What `served_coordinator` yields: the stages, the coordinator and its API, a channel to that API."""
    stages: list[str]                   # the stages' addresses
    servicers: list[StageServicer]
    server: ApiServer
    coord: Coordinator
    address: str                        # the API's, 127.0.0.1:port
    channel: grpc.aio.Channel           # insecure, to `address`


@asynccontextmanager
async def served_coordinator(model: str, num_stages: int, stage_time_ms: str = "0", kv_limit_mb: float = 0.0,
                             **config: Any) -> AsyncIterator[ServedCoordinator]:
    """num_stages in-process stages serving `model` (as `stage_servers`), a coordinator over them with its gRPC
    API on a free port (further CoordinatorConfig fields in `config`), and an insecure channel to that API. On
    exit the channel closes, then the API server stops, then the coordinator and the stages close."""
    async with stage_servers(model, num_stages, stage_time_ms=stage_time_ms, kv_limit_mb=kv_limit_mb) \
            as (addresses, servicers):
        server, coord = await start(CoordinatorConfig(stages=tuple(addresses), model=model, port=0, **config))
        address = f"127.0.0.1:{server.port}"
        channel = grpc.aio.insecure_channel(address)
        try:
            yield ServedCoordinator(addresses, servicers, server, coord, address, channel)
        finally:
            await channel.close()
            await server.stop(0)
            await coord.close()


@contextmanager
def local_processes(model: str, num_stages: int):
    """Real stage processes (as `specpipe local` starts them), ready on return, stopped on exit."""
    stages = LocalStages(num_stages, model=model)
    stages.start()
    try:
        asyncio.run(stages.wait_ready(timeout_s=180))
        yield stages
    finally:
        stages.stop()
