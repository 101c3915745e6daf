"""Load: 64 concurrent client streams for a minute on a local pipeline (real gRPC API and stages).

No error but the documented RESOURCE_EXHAUSTED (admission queue full), every completed output exact, memory
bounded, nothing left anywhere afterwards. SPECPIPE_LOAD_SECONDS changes the duration (default 60).
"""
from __future__ import annotations

import asyncio
import gc
import os
import random
import resource
import time

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.frontends.server import start
from helpers.reference import hf_greedy
from helpers.stage_servers import stage_servers
from helpers.wait import wait_until
from protos import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.grpc

CLIENTS = 64
METHODS = ["pp", "cb-pp", "specpipe", "sps", "tree", "pipeinfer"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


async def test_64_streams_for_a_minute(tiny_model, tiny_hf):
    seconds = float(os.environ.get("SPECPIPE_LOAD_SECONDS", "60"))
    rng = random.Random(64)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 24))] for _ in range(12)]
    want = {tuple(p): hf_greedy(tiny_hf, p, 24) for p in prompts}
    async with stage_servers(str(tiny_model), 3, kv_limit_mb=64) as (addrs, servicers):
        server, coord = await start(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), port=0,
                                                      max_active=24, max_queue=24, draft="ngram",
                                                      max_new_tokens_cap=64, default_max_new_tokens=16))
        done = {"ok": 0, "exhausted": 0}
        errors: list[str] = []
        rss: list[float] = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                deadline = time.monotonic() + seconds

                async def client(k: int) -> None:
                    r = random.Random(k)
                    while time.monotonic() < deadline:
                        prompt, n, method = r.choice(prompts), r.randrange(1, 25), r.choice(METHODS)
                        req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n,
                                                             method=method, ignore_eos=True)
                        ids: list[int] = []
                        try:
                            async for m in stub.Generate(req, timeout=120):
                                ids += m.token_ids
                        except grpc.aio.AioRpcError as e:
                            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                                done["exhausted"] += 1
                                await asyncio.sleep(r.uniform(0.05, 0.3))  # a client backing off (the test)
                            else:
                                errors.append(f"{method}: {e.code().name} {e.details()}")
                            continue
                        if ids != want[tuple(prompt)][:n]:
                            errors.append(f"{method} not exact for {prompt} (n={n})")
                        done["ok"] += 1

                async def sample_memory() -> None:
                    while time.monotonic() < deadline:
                        rss.append(_rss_mb())
                        await asyncio.sleep(1.0)                     # a sample a second (a period, not a wait)

                await asyncio.gather(sample_memory(), *(client(k) for k in range(CLIENTS)))
            assert not errors, errors[:5]
            assert done["ok"] >= CLIENTS, done
            # memory: after a warm-up fifth, the resident size stays within a bound (no per-request growth)
            warm = rss[len(rss) // 5:]
            assert max(warm) - warm[0] < 300, f"resident memory grew from {warm[0]:.0f} to {max(warm):.0f} MiB"
            await wait_until(lambda: coord.engine.active == 0 and all(not s.runner.cache.requests for s in servicers),
                             timeout=5, interval=0.1, what="nothing running or held")
            assert [len(s.runner.cache.requests) for s in servicers] == [0, 0, 0]
            assert [s.runner.cache.nbytes() for s in servicers] == [0, 0, 0]
            print(f"load: {done['ok']} completed, {done['exhausted']} RESOURCE_EXHAUSTED in {seconds:.0f} s; "
                  f"rss {warm[0]:.0f} -> {max(warm):.0f} MiB")
        finally:
            await server.stop(0)
            await coord.close()
            gc.collect()
