"""TLS for every hop, from certificate files (PEM), and a bearer token for the public API.

Internal hops (coordinator -> stages, stage -> next stage) use mutual TLS: each service presents its
certificate (`cert`, `key`) and trusts peers signed by `ca`; a server with a `ca` refuses clients without a
valid certificate from it. Without files every hop is plaintext (local development).

    tls = TLSFiles("/tls/tls.crt", "/tls/tls.key", "/tls/ca.crt")
    server.bind("0.0.0.0", 50061, tls.server_credentials())
    channel = open_channel("stage-1:50061", tls, options)
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSFiles:
    cert: str = ""          # PEM certificate chain of this service
    key: str = ""           # its private key
    ca: str = ""            # CA bundle that peers' certificates must chain to

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLS needs both a certificate and its key (or neither)")
        for name in (self.cert, self.key, self.ca):
            if name and not Path(name).is_file():
                raise ValueError(f"TLS file {name} does not exist")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def _read(self, name: str) -> bytes | None:
        return Path(name).read_bytes() if name else None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None without a certificate (plaintext). With a CA, clients must present a certificate it signed."""
        if not self.enabled:
            return None
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))],
                                           root_certificates=self._read(self.ca),
                                           require_client_auth=bool(self.ca))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: trust `ca` (system roots without it) and present our certificate if we have one."""
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca),
                                            private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))


def open_channel(address: str, tls: TLSFiles | None, options: list | None = None) -> grpc.aio.Channel:
    """A channel to a service: TLS when we have a CA or a certificate, plaintext otherwise."""
    if tls is not None and (tls.enabled or tls.ca):
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call except health checks (kubelet probes send
    no token); others get UNAUTHENTICATED."""

    EXEMPT = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty bearer token would admit anyone")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.EXEMPT):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        got = got.encode() if isinstance(got, str) else got
        if hmac.compare_digest(got, self._expected):
            return handler
        return _deny(handler)


async def _abort(context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token "
                        "(send metadata 'authorization: Bearer <token>')")


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request, context):
        await _abort(context)

    async def stream(request_or_iterator, context):
        await _abort(context)
        yield  # pragma: no cover - never reached, makes this an async generator

    kind = (handler.request_streaming, handler.response_streaming)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    fn = stream if handler.response_streaming else unary
    return make[kind](fn, request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)
