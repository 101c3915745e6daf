"""What every SpecPipe gRPC server shares: message limits, health, reflection, SIGTERM drain."""
from __future__ import annotations

import asyncio
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from urllib.parse import unquote

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.logs import get_logger
from common.malformed import MalformedRequestInterceptor

log = get_logger(__name__)


def peer_host(peer: str) -> str:
    """The host of a gRPC peer (`context.peer()`), as aiohttp's `request.remote` gives it for HTTP.

    >>> peer_host("ipv4:10.0.0.7:50422"), peer_host("ipv6:[::1]:50422"), peer_host("ipv6:%5B::1%5D:50422")
    ('10.0.0.7', '::1', '::1')
    >>> peer_host("unix:/tmp/api.sock")
    'unix:/tmp/api.sock'
    """
    peer = unquote(peer)
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in address:
        return address.rpartition(":")[0].strip("[]")
    return peer


WATCH_PER_PEER = 8      # health Watch streams one client address may hold open on a server (the API's:
WATCH_TOTAL = 128       # and all clients together                  --health-watch-per-client, --health-watch-max)
UNARY_ROOM = 64         # calls in progress a server admits beyond its streams (Check, Info, ...)


class BoundedHealth(health.aio.HealthServicer):
    """grpc.health.v1 whose `Watch` streams are bounded, so that nobody can hold a server's capacity with them.

    `Check` is unary and always answers. A `Watch` stream stays open for as long as its client likes and needs
    no token (health is public), so each one is counted: at most `per_peer` from one client address and `total`
    in all; one more is refused at once with RESOURCE_EXHAUSTED (the client may poll `Check` instead). `Server`
    keeps the streams apart from the API's limit on calls in progress (it adds `total` and room for unary
    calls to it), so held `Watch` streams never refuse a `Generate`.

        health = BoundedHealth(per_peer=2, total=3)
        # client A opens 2 Watch streams: both stream SERVING; a 3rd from A: RESOURCE_EXHAUSTED
        # client B opens 1: streams; a 2nd from B: RESOURCE_EXHAUSTED (3 in all); Check from anyone: SERVING
    """
    def __init__(self, per_peer: int = WATCH_PER_PEER, total: int = WATCH_TOTAL) -> None:
        super().__init__()
        if per_peer < 1 or total < per_peer:
            raise ValueError(f"Watch limits must be 1 <= per_peer ({per_peer}) <= total ({total})")
        self.per_peer, self.total = per_peer, total
        self._watching: Counter[str] = Counter()

    @property
    def watching(self) -> int:
        """Watch streams open now."""
        return sum(self._watching.values())

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        peer = peer_host(context.peer())
        if self._watching[peer] >= self.per_peer:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.per_peer} health Watch streams from {peer} are open already; close one or "
                                "poll Check")
        if self.watching >= self.total:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.total} health Watch streams are open already; retry later or poll Check")
        self._watching[peer] += 1
        try:
            await super().Watch(request, context)
        finally:
            self._watching[peer] -= 1
            if not self._watching[peer]:
                del self._watching[peer]


# Reconnect backoff of a channel to a peer that is not up yet (a stage starting or restarting): first retry after
# 0.1 s, then growing 1.6x to at most 1 s. gRPC's defaults (1 s, growing to 120 s) leave a channel idle for seconds
# after its peer came up: `specpipe run` waited ~2-4 s per start for stages that were already serving, and a
# recovery after a stage restart waited as long. Cheap here: a handful of channels, each to a known peer.
RECONNECT_OPTIONS: list[tuple[str, int]] = [("grpc.initial_reconnect_backoff_ms", 100),
                                             ("grpc.max_reconnect_backoff_ms", 1000)]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Client options: explicit message limits, a keepalive that servers below accept, a short reconnect
    backoff (RECONNECT_OPTIONS)."""
    return [*RECONNECT_OPTIONS,
            ("grpc.max_send_message_length", max_message_bytes),
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
                 health_max_rpcs: int | None = None,
                 watch_limits: tuple[int, int] = (WATCH_PER_PEER, WATCH_TOTAL)) -> None:
        """`options` default to `server_options(max_message_bytes)` (the stage hops'); the public API passes
        its own, with `maximum_concurrent_rpcs`; `health_*` are those of the plaintext health port;
        `watch_limits` the health Watch streams per client address and in all (BoundedHealth)."""
        # undecodable request bytes: INVALID_ARGUMENT, not grpc.aio's UNKNOWN (after any auth check)
        self.health = BoundedHealth(*watch_limits)
        if maximum_concurrent_rpcs is not None:     # health Watch streams and unary calls come on top
            maximum_concurrent_rpcs += self.health.total + UNARY_ROOM
        self.server = grpc.aio.server(options=options or server_options(max_message_bytes),
                                      interceptors=[*interceptors, MalformedRequestInterceptor()],
                                      maximum_concurrent_rpcs=maximum_concurrent_rpcs)
        self._health_options = health_options or server_options(64 * 1024)
        self._health_max_rpcs = health_max_rpcs
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
        limit = self._health_max_rpcs
        self._health_server = grpc.aio.server(   # Watch streams (bounded by the servicer) come on top
            options=self._health_options,
            maximum_concurrent_rpcs=None if limit is None else limit + self.health.total)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        self.health_port = self._health_server.add_insecure_port(f"{host}:{port}")
        if self.health_port == 0:
            raise OSError(f"cannot bind the health port {host}:{port}")
        return self.health_port

    def bind(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
        """Listen on host:port, with TLS when credentials are given (common/tls.py)."""
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
