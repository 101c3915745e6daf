"""The coordinator process: `specpipe coordinator --stages HOST:PORT,...`."""
from __future__ import annotations

import argparse
import asyncio
import os

from grpc_health.v1 import health_pb2

from protos import generation_pb2, generation_pb2_grpc
from services.config import MiB
from common.grpc_server import Server
from common.memory import tune_allocator
from common.metrics_http import serve_metrics
from common.logs import configure, get_logger
from common.options import service_parser
from common.tls import TLSFiles
from common.process import as_program, before_exit

from coordinator.frontends.grpc_api import ApiTokenInterceptor, GenerationServicer, serving_state
from coordinator.config import CoordinatorConfig
from coordinator.frontends.openai.api import OpenAIServer
from coordinator.frontends.service import Coordinator, ModelParts

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# grpc.health.v1 service that says SERVING while the process runs, whatever the pipeline does (liveness);
# "" and SERVICE_NAME say whether the pipeline serves (readiness)
LIVENESS_SERVICE = "liveness"
HEALTH_POLL_S = 0.25
log = get_logger("specpipe.coordinator")


def api_server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The public port's gRPC options (stage hops use common/grpc_server.server_options): its own message
    limit, a keepalive that finds dead clients, and pings policed (our clients ping every 30 s,
    common/grpc_server.channel_options; more than every 10 s without data is a strike, 2 strikes end the
    connection)."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_metadata_size", 16 * 1024),
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 2)]


class ApiServer(Server):
    """The public gRPC server: health, reflection and drain as every server (common/grpc_server.Server),
    with the public port's limits (`--api-max-message-mb`, `--api-max-concurrent-rpcs`, keepalive and ping
    policing), the bearer-token check before any request is read (coordinator/api.ApiTokenInterceptor),
    and health that tells the truth: "" and specpipe.v1.Generation are SERVING only while the pipeline
    serves (followed every HEALTH_POLL_S), LIVENESS_SERVICE while the process runs."""

    def __init__(self, config: CoordinatorConfig, coordinator: Coordinator) -> None:
        max_message = config.api_max_message_mb * MiB
        auth = [ApiTokenInterceptor(config.api_token)] if config.api_token else []
        super().__init__([SERVICE_NAME], max_message, interceptors=auth, options=api_server_options(max_message),
                         maximum_concurrent_rpcs=config.api_max_concurrent_rpcs,
                         health_options=api_server_options(64 * 1024), health_max_rpcs=64,
                         watch_limits=(config.health_watch_per_client, config.health_watch_max))
        self.coordinator = coordinator
        self.serving: bool | None = None        # what health reports now (None: not started)
        self.generation: GenerationServicer | None = None     # the Generate service (set by `start`)
        self._follower: asyncio.Task | None = None

    async def start(self) -> None:
        await super().start()
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.report()
        self._follower = asyncio.create_task(self._follow())

    async def stop(self, grace_s: float) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        await super().stop(grace_s)

    async def report(self) -> bool:
        """Set the readiness statuses from the coordinator's state now; returns it."""
        ok, why = serving_state(self.coordinator)
        if ok != self.serving:
            if self.serving is not None:
                log.info("health", serving=ok, reason=why)
            status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)
            self.serving = ok
        return ok

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            try:
                await self.report()
            except Exception:           # noqa: BLE001 - keep following; a bug here must not freeze health
                log.exception("health update failed")


async def start(config: CoordinatorConfig, parts: ModelParts | None = None) -> tuple[ApiServer, Coordinator]:
    """Connect a coordinator (with `parts` already loaded, if given) and serve its gRPC API."""
    coordinator = await Coordinator.connect(config, parts)
    server = ApiServer(config, coordinator)
    servicer = GenerationServicer(coordinator, config.api_token, config.api_max_concurrent_rpcs,
                                  config.max_per_client, config.stream_write_timeout_s)
    server.generation = servicer
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server.server)
    server.bind(config.host, config.port, TLSFiles(config.api_tls_cert, config.api_tls_key).server_credentials())
    if config.health_port:
        server.bind_health(config.host, config.health_port)
    await server.start()
    return server, coordinator


async def start_http(config: CoordinatorConfig, coordinator: Coordinator, port: int | None = None,
                     model_name: str = "") -> OpenAIServer:
    """The OpenAI-compatible HTTP API (coordinator/frontends/openai/api.py) on config.host, port `port` (default
    config.http_port; 0 = a free one, for tests; the bound port is `.port`), with the gRPC API's TLS
    certificate, bearer token and message limit (`--api-max-message-mb`; headers and body within
    `--http-timeout-s`). Stop it with `await http.stop()` before closing the coordinator."""
    tls = (config.api_tls_cert, config.api_tls_key) if config.api_tls_cert else None
    http = OpenAIServer(coordinator, model_name=model_name, token=config.api_token, tls=tls, grace_s=config.grace_s,
                        max_body_bytes=config.api_max_message_mb * MiB, timeout_s=config.http_timeout_s,
                        write_timeout_s=config.stream_write_timeout_s,
                        max_in_progress=config.api_max_concurrent_rpcs)
    await http.start(config.host, config.http_port if port is None else port)
    return http


async def serve(config: CoordinatorConfig, port_file: str = "") -> None:
    server, coordinator = await start(config)
    http = await start_http(config, coordinator) if config.http_port else None

    metrics_http = await serve_metrics(config.host, config.metrics_port) if config.metrics_port else None
    if metrics_http is not None:
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
            coordinator.begin_close()
            await asyncio.gather(*([http.stop()] if http is not None else []),
                                 *([coordinator.recovery.close()] if coordinator.recovery is not None else []))
        await server.serve_until_signal(config.grace_s, on_stop=coordinator.close, drain_also=drain_also)
    finally:
        if watcher is not None:
            await asyncio.to_thread(watcher.stop)
        if metrics_http is not None:
            await metrics_http.cleanup()


def start_scaling(config: CoordinatorConfig, coordinator: Coordinator):
    """Follow the stage StatefulSet (in-cluster credentials, else the local kubeconfig)."""
    from kubernetes import client, config as kube_config

    from coordinator.engine.k8s import watch_statefulset
    from coordinator.engine.scaling import Repartitioner

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


EXAMPLES = """examples (over the stages of `specpipe stage --help`; then `specpipe generate`):
  specpipe coordinator --stages 127.0.0.1:50061,127.0.0.1:50062 --port 50051
  specpipe coordinator --stages 127.0.0.1:50061,127.0.0.1:50062 --method pp --max-active 16
  SPECPIPE_API_TOKEN=s3cret specpipe coordinator \\
      --stages 'rel-specpipe-stage-{i}.rel-specpipe-stage:50061' --num-stages 4 \\
      --api-tls-cert tls.crt --api-tls-key tls.key
"""


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser("specpipe coordinator", "Serve the public Generate API over a pipeline of stages.",
                            EXAMPLES, "SPECPIPE_STAGES", "SPECPIPE_API_TOKEN")
    CoordinatorConfig.add_arguments(parser)
    parser.add_argument("--port-file", default="", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure()
    tune_allocator()
    asyncio.run(serve(CoordinatorConfig.from_args(args), args.port_file))
    return 0


if __name__ == "__main__":
    as_program()             # (its heap is frozen once loaded: common/process.py)
    code = main()
    before_exit()            # (not in main(): tests call it in their own process)
    raise SystemExit(code)
