"""Health is the truth: the coordinator's grpc.health.v1 (API port and plaintext health port) and HTTP /health
say NOT_SERVING / 503 while the pipeline cannot serve (a frozen stage, a recovery, a hold, closing) and
SERVING / 200 once it serves again; liveness (the "liveness" service, HTTP /live) stays up throughout; the
chart probes readiness on the first and liveness on the second."""
from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.engine.local import LocalStages, free_port
from coordinator.config import CoordinatorConfig
from coordinator.frontends.server import LIVENESS_SERVICE, SERVICE_NAME, start, start_http
from helpers.reference import hf_greedy
from helpers.stage_servers import stage_servers
from helpers.wait import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Probes:
    """What a load balancer and the kubelet see: gRPC health on both ports, HTTP /health and /live."""

    def __init__(self, api: str, health: str, http: str) -> None:
        self.channels = [grpc.aio.insecure_channel(api), grpc.aio.insecure_channel(health)]
        self.http = http
        self.session = aiohttp.ClientSession()

    async def grpc(self, service: str = "") -> list[int]:
        return [(await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=5)).status for ch in self.channels]

    async def get(self, path: str) -> tuple[int, dict]:
        async with self.session.get(self.http + path) as r:
            return r.status, await r.json()

    async def ready(self) -> tuple[int, int, int, int, int]:
        """(API port "", API port specpipe.v1.Generation, health port "", health port Generation, /health)."""
        overall, named = await self.grpc(), await self.grpc(SERVICE_NAME)
        return overall[0], named[0], overall[1], named[1], (await self.get("/health"))[0]

    async def alive(self) -> bool:
        return await self.grpc(LIVENESS_SERVICE) == [SERVING, SERVING] and (await self.get("/live"))[0] == 200

    async def wait(self, want: tuple, timeout_s: float = 60.0) -> None:
        """Poll until ready() == want; liveness must hold at every poll."""
        got = None

        async def ready_as_wanted() -> bool:
            nonlocal got
            if (got := await self.ready()) == want:
                return True
            assert await self.alive(), "liveness must not fail while the pipeline is down"
            return False
        await wait_until(ready_as_wanted, timeout_s, interval=0.05, what=lambda: f"health {want} (it is {got})")

    async def close(self) -> None:
        await self.session.close()
        for ch in self.channels:
            await ch.close()


UP = (SERVING, SERVING, SERVING, SERVING, 200)
DOWN = (NOT_SERVING, NOT_SERVING, NOT_SERVING, NOT_SERVING, 503)


@asynccontextmanager
async def coordinator(addresses: list[str], model: str, **config) -> AsyncIterator[tuple[object, Probes]]:
    cfg = CoordinatorConfig(stages=tuple(addresses), model=model, port=0, health_port=free_port(), method="pp",
                            **config)
    server, coord = await start(cfg)
    http = await start_http(cfg, coord, port=0)
    probes = Probes(f"127.0.0.1:{server.port}", f"127.0.0.1:{server.health_port}", f"http://127.0.0.1:{http.port}")
    try:
        yield coord, probes
    finally:
        await probes.close()
        await http.stop()
        await server.stop(0)
        await coord.close()


async def generate(coord, prompt: list[int], n: int) -> list[int]:
    from coordinator.frontends.service import GenerateInput
    return [t async for c in coord.generate(GenerateInput(prompt_token_ids=prompt, max_new_tokens=n,
                                                          ignore_eos=True)) for t in c.token_ids]


@pytest.mark.grpc
async def test_health_says_not_serving_while_a_stage_is_frozen_and_serving_once_it_is_back(tiny_model, tiny_hf):
    """Real stage processes; SIGSTOP one (nothing breaks: the coordinator's probe times out and recovery
    waits for it): every readiness check flips, liveness does not; after SIGCONT all flip back. Once the
    recovery gives up on the running requests (--recovery-timeout-s 3; it goes on for later ones), the engine's
    own account names the stage's address: /health, public, says why in general words only."""
    stages = LocalStages(2, model=str(tiny_model))
    stages.start()
    try:
        await stages.wait_ready(timeout_s=180)
        async with coordinator(stages.addresses, str(tiny_model), recovery_timeout_s=3, probe_interval_s=0.2,
                               probe_timeout_s=0.5) as (coord, probes):
            await probes.wait(UP)
            assert await generate(coord, [3, 4, 5], 4) == hf_greedy(tiny_hf, [3, 4, 5], 4)
            os.kill(stages.procs[1].pid, signal.SIGSTOP)
            await probes.wait(DOWN)
            status, body = await probes.get("/health")
            assert body["status"] == "unavailable" and "recovering" in body["reason"]
            frozen = stages.addresses[1]
            await wait_until(lambda: frozen in coord.engine.why, timeout=30, what="the recovery to give up")
            status, body = await probes.get("/health")
            assert status == 503 and body["reason"] and frozen not in body["reason"] and "127.0.0.1" not in \
                body["reason"], ("no stage address to anyone", body, coord.engine.why)
            os.kill(stages.procs[1].pid, signal.SIGCONT)
            await probes.wait(UP, timeout_s=120)
            assert await generate(coord, [3, 4, 5], 4) == hf_greedy(tiny_hf, [3, 4, 5], 4)
    finally:
        for p in stages.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        stages.stop()


@pytest.mark.grpc
async def test_health_follows_a_held_pipeline_and_a_closing_coordinator(tiny_model):
    async with stage_servers(str(tiny_model), 2) as (addrs, _):
        async with coordinator(addrs, str(tiny_model)) as (coord, probes):
            await probes.wait(UP)
            engine = coord.engine
            engine.hold()                               # what a re-partition does while it drains
            await probes.wait(DOWN)
            assert "re-partitioning" in (await probes.get("/health"))[1]["reason"]
            await engine.swap_transport(engine.transport, engine.admission.kv_slots)   # nothing changed
            await probes.wait(UP)
            coord.begin_close()                         # what a SIGTERM drain does
            await probes.wait(DOWN)
            assert "shutting down" in (await probes.get("/health"))[1]["reason"]


@pytest.mark.grpc
async def test_a_drained_api_server_reports_not_serving_on_every_service(tiny_model):
    """Server.stop's graceful shutdown wins over the follower: nothing flips back to SERVING."""
    async with stage_servers(str(tiny_model), 1) as (addrs, _):
        cfg = CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), port=0, health_port=free_port())
        server, coord = await start(cfg)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                stopping = asyncio.create_task(server.stop(2.0))     # a notice period of 0.5 s, then stop
                async def draining() -> bool:
                    check = health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE)
                    return (await stub.Check(check, timeout=5)).status == NOT_SERVING
                await wait_until(draining, 30, what="the drain reported")
                assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == NOT_SERVING
                await stopping
        finally:
            await coord.close()


def test_the_chart_probes_readiness_on_the_truth_and_liveness_on_the_process():
    from helpers.chart import one, render
    for sets in ([], ["coordinator.apiTlsSecret=api-cert"]):
        c = one(render(*sets), "Deployment")["spec"]["template"]["spec"]["containers"][0]
        assert "--health-port=50070" in c["args"], "probes bypass the API's TLS and concurrency limit"
        assert c["readinessProbe"]["grpc"] == {"port": 50070}, "readiness: the overall status (\"\")"
        for probe in ("livenessProbe", "startupProbe"):
            assert c[probe]["grpc"] == {"port": 50070, "service": LIVENESS_SERVICE}, probe

