"""Prometheus metrics over HTTP, served on the process's event loop (aiohttp), not by a thread per connection.

prometheus-client's own `start_http_server` starts a thread for every connection and never times one out:
a client that opens connections and sends nothing holds a thread each. Here connections are the event loop's,
a request head must arrive within `timeout_s`, and an idle keep-alive connection is closed after it.

    runner = await serve_metrics("127.0.0.1", 9160)     # GET /metrics (and /): the registry's text format
    ...
    await runner.cleanup()
"""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve_metrics(host: str, port: int, timeout_s: float = 10.0) -> web.AppRunner:
    """Serve the registry on host:port until the returned runner is cleaned up."""
    app = web.Application()
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/", _metrics)
    runner = web.AppRunner(app, keepalive_timeout=timeout_s, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
