"""What every SpecPipe gRPC server shares: message limits, health, reflection, SIGTERM drain."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.logs import get_logger
from services.malformed import MalformedRequestInterceptor

log = get_logger(__name__)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Client options: explicit message limits and a keepalive that servers below accept."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0)]


class Server:
    """A grpc.aio server with health (grpc.health.v1) and reflection for the given service names."""

    def __init__(self, service_names: list[str], max_message_bytes: int, interceptors=(),
                 options: list[tuple[str, int]] | None = None, maximum_concurrent_rpcs: int | None = None,
                 health_options: list[tuple[str, int]] | None = None,
                 health_max_rpcs: int | None = None) -> None:
        """`options` default to `server_options(max_message_bytes)` (the stage hops'); the public API passes
        its own, with `maximum_concurrent_rpcs`; `health_*` are those of the plaintext health port."""
        # undecodable request bytes: INVALID_ARGUMENT, not grpc.aio's UNKNOWN (after any auth check)
        self.server = grpc.aio.server(options=options or server_options(max_message_bytes),
                                      interceptors=[*interceptors, MalformedRequestInterceptor()],
                                      maximum_concurrent_rpcs=maximum_concurrent_rpcs)
        self._health_options = health_options or server_options(64 * 1024)
        self._health_max_rpcs = health_max_rpcs
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.server)
        self.port = 0
        self.health_port = 0
        self._health_server: grpc.aio.Server | None = None

    def bind_health(self, host: str, port: int) -> int:
        """Also serve grpc.health.v1 alone, in plaintext, on host:port: for probes that cannot speak TLS
        (the kubelet's gRPC probes) when the main port requires (mutual) TLS. It reports what the main
        server reports."""
        self._health_server = grpc.aio.server(options=self._health_options,
                                              maximum_concurrent_rpcs=self._health_max_rpcs)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        self.health_port = self._health_server.add_insecure_port(f"{host}:{port}")
        if self.health_port == 0:
            raise OSError(f"cannot bind the health port {host}:{port}")
        return self.health_port

    def bind(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
        """Listen on host:port, with TLS when credentials are given (services/tls.py)."""
        address = f"{host}:{port}"
        self.port = self.server.add_secure_port(address, credentials) if credentials is not None \
            else self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        return self.port

    async def start(self) -> None:
        await self.server.start()
        if self._health_server is not None:
            await self._health_server.start()
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, keep accepting calls for a short notice period (so health checkers and
        load balancers see it), then stop taking new calls and let running ones finish within grace_s."""
        await self.health.enter_graceful_shutdown()
        notice = min(1.0, grace_s / 4)
        if notice > 0:
            await asyncio.sleep(notice)
        await self.server.stop(max(0.0, grace_s - notice))
        if self._health_server is not None:
            await self._health_server.stop(0)

    async def serve_until_signal(self, grace_s: float,
                                 on_stop: Callable[[], Awaitable[None]] | None = None,
                                 drain_also: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM or SIGINT, then report NOT_SERVING and drain for grace_s (together with
        `drain_also`, e.g. another server of the process), stop, and run `on_stop`."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("draining", grace_s=grace_s)
        await asyncio.gather(self.stop(grace_s), *([drain_also()] if drain_also is not None else []))
        if on_stop is not None:
            await on_stop()
        log.info("stopped")
