"""common/metrics_http.py: metrics served on the event loop. Idle connections hold no thread and are
closed; before, prometheus-client's server started a thread for every connection and kept it forever."""
from __future__ import annotations

import asyncio
import threading

import aiohttp

from coordinator.engine.local import free_port
from common.metrics_http import serve_metrics


async def test_metrics_are_served_and_idle_connections_cost_no_thread_and_close():
    port = free_port()
    runner = await serve_metrics("127.0.0.1", port, timeout_s=0.5)
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            assert "# TYPE python_info gauge" in await r.text()         # the default registry's text format
        threads = threading.active_count()
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(50)]
        await asyncio.sleep(0)                      # let the server accept them
        assert threading.active_count() <= threads + 1, "a thread per connection"
        for reader, _ in idle:                      # each is closed by the server within the timeout
            assert await asyncio.wait_for(reader.read(), timeout=5) == b""
        for _, writer in idle:
            writer.close()
    finally:
        await runner.cleanup()
