"""Changing the pipeline depth while serving: re-partition over real stage services (2 -> 4 -> 1 -> 0 -> 3)
with requests in flight, outputs exact and none lost; driven directly and by a StatefulSet watched with the
real `kubernetes` client against kmock (an in-memory Kubernetes API)."""
from __future__ import annotations

import asyncio

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.engine.scaling import Repartitioner, plan
from coordinator.engine.state import EngineState
from coordinator.frontends.server import start
from coordinator.frontends.service import GenerateInput, GenerationFailed
from helpers.reference import hf_greedy, prompts
from helpers.stage_servers import stage_servers
from helpers.wait import wait_until


def test_plan_splits_layers_evenly_and_chains_the_stages():
    p = plan(["a:1", "b:1", "c:1"], 8)
    assert [(s.first_layer, s.last_layer, s.next_hop) for s in p] == [(0, 3, "b:1"), (3, 6, "c:1"), (6, 8, "")]
    assert [s.stage for s in p] == [0, 1, 2] and all(s.num_stages == 3 for s in p)


async def generate(coord, prompt, n) -> list[int]:
    out = []
    async for chunk in coord.generate(GenerateInput(prompt_token_ids=prompt, max_new_tokens=n, ignore_eos=True)):
        out += chunk.token_ids
    return out


async def stage_layers(coord) -> list[tuple[int, int]]:
    return [(i.first_layer, i.last_layer) for i in coord.pipeline.infos]


@pytest.mark.grpc
async def test_scale_while_serving_loses_nothing(tiny_model8, tiny_hf8):
    ps = prompts(6, seed=21)
    want = [hf_greedy(tiny_hf8, p, 12) for p in ps]
    async with stage_servers(str(tiny_model8), 4, stage_time_ms="5") as (addrs, servicers):
        server, coord = await start(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model8), port=0,
                                                      method="specpipe", max_new_tokens_cap=64,
                                                      default_max_new_tokens=16))
        try:
            rep = Repartitioner(coord, lambda i: addrs[i])
            assert rep.current == 4
            await rep.scale(2)
            assert await stage_layers(coord) == [(0, 4), (4, 8)]
            for depth, layers in [(4, [(0, 2), (2, 4), (4, 6), (6, 8)]), (1, [(0, 8)]), (3, [(0, 3), (3, 6), (6, 8)])]:
                running = [asyncio.create_task(generate(coord, p, 12)) for p in ps[:3]]
                await wait_until(lambda: len(coord.engine.admission.active) == 3,   # in flight when the
                                 what="3 requests running")                          # re-partition starts
                scaling = asyncio.create_task(rep.scale(depth))
                await wait_until(lambda: coord.engine.admission.held or scaling.done(), interval=0.002,
                                 what="new requests held")
                arriving = [asyncio.create_task(generate(coord, p, 12)) for p in ps[3:]]   # held, then served
                assert await asyncio.gather(*running) == want[:3]
                assert await asyncio.gather(*arriving) == want[3:]
                await scaling
                assert coord.pipeline.num_stages == depth and await stage_layers(coord) == layers
            await rep.scale(0)
            with pytest.raises(GenerationFailed, match="scaled to 0") as err:
                await generate(coord, ps[0], 4)
            assert err.value.code == 14
            await rep.scale(2)
            assert await generate(coord, ps[0], 12) == want[0]
        finally:
            await server.stop(0)
            await coord.close()


@pytest.mark.grpc
async def test_kubectl_scale_of_the_statefulset_is_followed(kmock, tiny_model8, tiny_hf8):
    """The real `kubernetes` client watches a StatefulSet served by kmock; patching its replicas (what
    `kubectl scale` does) and its ready count (what the StatefulSet controller reports) re-partitions the
    pipeline: 4 -> 2, a scale to 4 waits until 4 stages are ready, then 1."""
    from kubernetes import client

    from coordinator.engine.k8s import watch_statefulset

    kmock.resources.load_bundled()
    conf = client.Configuration()
    conf.host = str(kmock.url).rstrip("/")
    apps = client.AppsV1Api(client.ApiClient(conf))
    name, ns = "rel-specpipe-stage", "ml"
    labels = {"app.kubernetes.io/component": "stage"}
    await asyncio.to_thread(apps.create_namespaced_stateful_set, ns, {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name, "namespace": ns},
        "spec": {"replicas": 4, "serviceName": name, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "stage", "image": "x"}]}}},
        "status": {"replicas": 4, "readyReplicas": 4}})

    async def scale(replicas: int, ready: int) -> None:
        await asyncio.to_thread(apps.patch_namespaced_stateful_set, name, ns,
                                {"spec": {"replicas": replicas}, "status": {"readyReplicas": ready}})

    prompt = [9, 8, 7]
    want = hf_greedy(tiny_hf8, prompt, 10)
    async with stage_servers(str(tiny_model8), 4) as (addrs, _):
        server, coord = await start(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model8), port=0,
                                                      method="specpipe", max_new_tokens_cap=64,
                                                      default_max_new_tokens=16))
        rep = Repartitioner(coord, lambda i: addrs[i])
        watcher = watch_statefulset(apps, ns, name, rep, asyncio.get_running_loop())
        try:
            await scale(2, 2)
            await wait_until(lambda: rep.current == 2, timeout=20, interval=0.05, what="2 stages")
            assert await generate(coord, prompt, 10) == want
            await scale(4, 3)                                  # the fourth stage is still starting
            await asyncio.sleep(1.0)                           # nothing happens meanwhile (the test, not a wait)
            assert rep.current == 2
            await scale(4, 4)
            await wait_until(lambda: rep.current == 4, timeout=20, interval=0.05, what="4 stages")
            assert await generate(coord, prompt, 10) == want
            await scale(1, 1)
            await wait_until(lambda: rep.current == 1, timeout=20, interval=0.05, what="1 stage")
            assert await generate(coord, prompt, 10) == want and coord.pipeline.num_stages == 1
            coord.engine.fail_all(RuntimeError("results stream broke"))      # e.g. a stage pod restarted
            await scale(1, 0)
            await scale(1, 1)                                   # ready again: the partition is re-applied
            await wait_until(lambda: coord.engine.state is EngineState.RUNNING, timeout=20, interval=0.05,
                             what="the failure cleared")
            assert await generate(coord, prompt, 10) == want
        finally:
            await asyncio.to_thread(watcher.stop)
            await server.stop(0)
            await coord.close()


@pytest.mark.grpc
async def test_repartition_with_stage_processes(tiny_model8, tiny_hf8):
    """The same path over real stage processes (as `specpipe local` starts them): 3 -> 2 -> 3, counted."""
    from coordinator.engine.local import LocalStages
    from coordinator.engine.scaling import REPARTITIONS

    ok = REPARTITIONS.labels("ok")
    before = ok._value.get()
    prompt = [4, 44, 104]
    want = hf_greedy(tiny_hf8, prompt, 8)
    stages = LocalStages(3, model=str(tiny_model8))
    stages.start()
    try:
        await stages.wait_ready(timeout_s=120)
        server, coord = await start(CoordinatorConfig(stages=tuple(stages.addresses), model=str(tiny_model8),
                                                      port=0, max_new_tokens_cap=64, default_max_new_tokens=16))
        try:
            rep = Repartitioner(coord, lambda i: stages.addresses[i])
            for depth in (2, 3):
                await rep.scale(depth)
                assert coord.pipeline.num_stages == depth and await generate(coord, prompt, 8) == want
            assert ok._value.get() == before + 2
        finally:
            await server.stop(0)
            await coord.close()
    finally:
        stages.stop()


@pytest.mark.grpc
async def test_a_failed_repartition_answers_unavailable_and_can_be_retried(tiny_model8, tiny_hf8):
    """A stage that cannot be reached: the re-partition fails once (no retry loop), requests get
    UNAVAILABLE with the reason, and a later scale to reachable stages serves again."""
    async with stage_servers(str(tiny_model8), 2) as (addrs, _):
        server, coord = await start(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model8), port=0,
                                                      max_new_tokens_cap=64, default_max_new_tokens=16))
        try:
            from coordinator.engine.local import free_port
            targets = {0: addrs[0], 1: addrs[1], 2: f"127.0.0.1:{free_port()}"}     # nothing listens there
            rep = Repartitioner(coord, lambda i: targets[i])
            import coordinator.engine.scaling as scaling
            real = scaling.configure
            scaling.configure = lambda p, timeout_s=2.0, attempts=1, tls=None: real(p, timeout_s, attempts, tls)
            try:
                await asyncio.wait_for(rep.scale(3), timeout=30)
            finally:
                scaling.configure = real
            with pytest.raises(GenerationFailed, match="re-partition to 3 stages failed") as err:
                await generate(coord, [1, 2, 3], 4)
            assert err.value.code == 14
            await rep.scale(2)
            assert await generate(coord, [1, 2, 3], 6) == hf_greedy(tiny_hf8, [1, 2, 3], 6)
        finally:
            await server.stop(0)
            await coord.close()
