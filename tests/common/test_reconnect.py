"""A channel to a peer that is not serving yet retries often enough to find it soon after it comes up.

gRPC's default reconnect backoff starts at 1 s and grows 1.6x per failure (to 120 s): a channel polling a stage
that takes 20 s to start is idle for several seconds after the stage began serving. Our channels (the data
plane's and `LocalStages.wait_ready`'s) cap it (`RECONNECT_OPTIONS`). Counted here as connection attempts to a
listener that accepts and closes at once, so no gRPC handshake succeeds; the default options are the control.
"""
from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest

from common.grpc_server import RECONNECT_OPTIONS, channel_options
from protos import stage_pb2, stage_pb2_grpc


def _counting_listener() -> tuple[socket.socket, list[int]]:
    """A socket that accepts connections and closes them at once, counting them."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    accepted = [0]

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            accepted[0] += 1
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
    return sock, accepted


async def _attempts(options: list | None, window_s: float) -> int:
    sock, accepted = _counting_listener()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sock.getsockname()[1]}", options=options) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stage_pb2_grpc.StageStub(channel).Info(stage_pb2.InfoRequest(), timeout=window_s,
                                                             wait_for_ready=True)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return accepted[0]
    finally:
        sock.close()


def test_our_channels_retry_a_peer_that_is_not_up_within_a_second():
    """In 4 s: gRPC's defaults try at about 0, 1 and 2.6 s (3 attempts, jittered by 20%); ours at about 0, 0.1,
    0.26, 0.52, 0.94, 1.6 s and then every second (8 or so)."""
    assert ("grpc.max_reconnect_backoff_ms", 1000) in channel_options(1 << 20)

    async def both() -> tuple[int, int]:
        return await asyncio.gather(_attempts(None, 4.0), _attempts(RECONNECT_OPTIONS, 4.0))
    default, ours = asyncio.run(both())
    assert default <= 4, f"gRPC's default backoff made {default} attempts in 4 s: the control is broken"
    assert ours >= 6, f"{ours} connection attempts in 4 s: the reconnect backoff is not capped"
