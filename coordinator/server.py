"""The coordinator process: `specpipe coordinator --stages HOST:PORT,...`."""
from __future__ import annotations

import argparse
import asyncio
import os

from protos import generation_pb2, generation_pb2_grpc
from services.config import MiB
from services.grpc_server import Server
from services.logs import configure, get_logger

from coordinator.api import GenerationServicer
from coordinator.config import CoordinatorConfig
from coordinator.service import Coordinator

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def start(config: CoordinatorConfig) -> tuple[Server, Coordinator]:
    coordinator = await Coordinator.connect(config)
    server = Server([SERVICE_NAME], config.max_message_mb * MiB)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(coordinator), server.server)
    server.bind(config.host, config.port)
    await server.start()
    return server, coordinator


async def serve(config: CoordinatorConfig, port_file: str = "") -> None:
    log = get_logger("specpipe.coordinator")
    server, coordinator = await start(config)
    if config.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(config.metrics_port)
        log.info("metrics serving", port=config.metrics_port)
    log.info("coordinator serving", port=server.port, stages=",".join(config.stages), method=config.method)
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(server.port))
        os.replace(port_file + ".tmp", port_file)
    await server.serve_until_signal(config.grace_s, on_stop=coordinator.close)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specpipe coordinator",
                                     description="Serve the public Generate API over a pipeline of stages.")
    CoordinatorConfig.add_arguments(parser)
    parser.add_argument("--port-file", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    configure()
    asyncio.run(serve(CoordinatorConfig.from_args(args), args.port_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
