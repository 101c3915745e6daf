"""The coordinator process: `specpipe coordinator --stages HOST:PORT,...`."""
from __future__ import annotations

import argparse
import asyncio
import os

from protos import generation_pb2, generation_pb2_grpc
from services.config import MiB
from services.grpc_server import Server
from services.logs import configure, get_logger
from services.tls import BearerTokenInterceptor, TLSFiles

from coordinator.api import GenerationServicer
from coordinator.config import CoordinatorConfig
from coordinator.openai_api import OpenAIServer
from coordinator.service import Coordinator

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def start(config: CoordinatorConfig) -> tuple[Server, Coordinator]:
    coordinator = await Coordinator.connect(config)
    interceptors = [BearerTokenInterceptor(config.api_token)] if config.api_token else []
    server = Server([SERVICE_NAME], config.max_message_mb * MiB, interceptors)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(coordinator), server.server)
    server.bind(config.host, config.port, TLSFiles(config.api_tls_cert, config.api_tls_key).server_credentials())
    if config.health_port:
        server.bind_health(config.host, config.health_port)
    await server.start()
    return server, coordinator


async def start_http(config: CoordinatorConfig, coordinator: Coordinator, port: int | None = None,
                     model_name: str = "") -> OpenAIServer:
    """The OpenAI-compatible HTTP API (coordinator/openai_api.py) on config.host, port `port` (default
    config.http_port; 0 = a free one, for tests; the bound port is `.port`), with the gRPC API's TLS
    certificate and bearer token. Stop it with `await http.stop()` before closing the coordinator."""
    tls = (config.api_tls_cert, config.api_tls_key) if config.api_tls_cert else None
    http = OpenAIServer(coordinator, model_name=model_name, token=config.api_token, tls=tls, grace_s=config.grace_s)
    await http.start(config.host, config.http_port if port is None else port)
    return http


async def serve(config: CoordinatorConfig, port_file: str = "") -> None:
    log = get_logger("specpipe.coordinator")
    server, coordinator = await start(config)
    http = await start_http(config, coordinator) if config.http_port else None

    if config.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(config.metrics_port, addr=config.host)
        log.info("metrics serving", port=config.metrics_port)
    watcher = start_scaling(config, coordinator) if config.k8s_statefulset else None
    log.info("coordinator serving", port=server.port, stages=",".join(config.stages), method=config.method,
             http_port=http.port if http is not None else 0)
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(server.port))
        os.replace(port_file + ".tmp", port_file)
    try:
        async def drain_also() -> None:         # beside the gRPC drain: HTTP, and a recovery (if one runs)
            coordinator.closing = True
            await asyncio.gather(*([http.stop()] if http is not None else []),
                                 *([coordinator.recovery.close()] if coordinator.recovery is not None else []))
        await server.serve_until_signal(config.grace_s, on_stop=coordinator.close, drain_also=drain_also)
    finally:
        if watcher is not None:
            await asyncio.to_thread(watcher.stop)


def start_scaling(config: CoordinatorConfig, coordinator: Coordinator):
    """Follow the stage StatefulSet (in-cluster credentials, else the local kubeconfig)."""
    from kubernetes import client, config as kube_config

    from coordinator.k8s import watch_statefulset
    from coordinator.scaling import Repartitioner

    try:
        kube_config.load_incluster_config()
    except kube_config.ConfigException:
        kube_config.load_kube_config()
    namespace = config.k8s_namespace or _pod_namespace()
    repartitioner = Repartitioner(coordinator, lambda i: config.stage_template.replace("{i}", str(i)))
    get_logger("specpipe.coordinator").info("following the stage StatefulSet", name=config.k8s_statefulset,
                                            namespace=namespace)
    return watch_statefulset(client.AppsV1Api(), namespace, config.k8s_statefulset, repartitioner,
                             asyncio.get_running_loop())


def _pod_namespace() -> str:
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "default"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specpipe coordinator", description="Serve the public Generate API over a pipeline of stages.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples (over the stages of `specpipe stage --help`; then `specpipe generate`):\n"
               "  specpipe coordinator --stages 127.0.0.1:50061,127.0.0.1:50062 --port 50051\n"
               "  specpipe coordinator --stages 127.0.0.1:50061,127.0.0.1:50062 --method pp --max-active 16\n"
               "  SPECPIPE_API_TOKEN=s3cret specpipe coordinator \\\n"
               "      --stages 'rel-specpipe-stage-{i}.rel-specpipe-stage:50061' --num-stages 4 \\\n"
               "      --api-tls-cert tls.crt --api-tls-key tls.key\n"
               "Most options also read SPECPIPE_<OPTION> from the environment (SPECPIPE_STAGES, "
               "SPECPIPE_API_TOKEN, ...).")
    CoordinatorConfig.add_arguments(parser)
    parser.add_argument("--port-file", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    configure()
    asyncio.run(serve(CoordinatorConfig.from_args(args), args.port_file))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
