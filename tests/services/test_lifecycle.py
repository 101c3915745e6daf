"""Process lifecycle: a stage drains on SIGTERM (health NOT_SERVING, then a clean exit), and on the death of
the process that started it."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.forkserver import Child
from coordinator.engine.local import LocalStages, free_ports
from helpers.wait import wait_until
from protos import stage_pb2, stage_pb2_grpc

pytestmark = pytest.mark.grpc


async def test_stage_drains_and_exits_cleanly_on_sigterm(tiny_model, monkeypatch):
    monkeypatch.setenv("SPECPIPE_GRACE_S", "2")
    stages = LocalStages(1, model=str(tiny_model))
    stages.start()
    try:
        await stages.wait_ready(timeout_s=120)
        async with grpc.aio.insecure_channel(stages.addresses[0]) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
            control = stage_pb2_grpc.StageStub(ch).Control()     # an open stream the drain must wait for
            await control.write(stage_pb2.ControlMessage(request_id="x", release=True))
            stages.procs[0].send_signal(signal.SIGTERM)
            started = time.monotonic()
            status = None

            async def drain_reported_or_gone() -> bool:
                nonlocal status
                try:
                    status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=1)).status
                except grpc.aio.AioRpcError:
                    return True                   # gone: the status seen last must have been NOT_SERVING
                return status == health_pb2.HealthCheckResponse.NOT_SERVING
            await wait_until(drain_reported_or_gone, timeout=2.5, interval=0.05, what="NOT_SERVING while draining")
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            code = await asyncio.to_thread(stages.procs[0].wait, 30)
            assert code == 0
            assert time.monotonic() - started < 15
        log = stages.log_path(0).read_text()
        assert "draining" in log and "stopped" in log
    finally:
        stages.stop()


PARENT = """
import sys, time
from coordinator.engine.local import LocalStages, free_ports
stages = LocalStages(1, model=sys.argv[1], preloaded=sys.argv[2] == "forked")
stages.start()
print(stages.procs[0].pid, type(stages.procs[0]).__name__, flush=True)
time.sleep(600)             # killed by the test long before
"""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a stage re-parented to this test's session leader may be
    reaped late; its state then reads Z)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["forked", pytest.param("plain", marks=pytest.mark.slow)])
async def test_a_stage_stops_when_the_process_that_started_it_is_killed(tiny_model, monkeypatch, how):
    """`specpipe bench` or `run` killed by SIGKILL (no clean-up runs) leaves no stage process behind: the
    stage sees it was re-parented (a forked stage: its fork server exits with the launcher) and drains as on
    SIGTERM."""
    monkeypatch.setenv("SPECPIPE_GRACE_S", "1")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_model), how], stdout=subprocess.PIPE,
                              text=True)
    stage_pid = 0
    try:
        pid, kind = (await asyncio.to_thread(parent.stdout.readline)).split()
        stage_pid = int(pid)
        assert kind == {"forked": "Child", "plain": "Popen"}[how]
        assert alive(stage_pid)
        parent.kill()
        parent.wait(30)
        await wait_until(lambda: not alive(stage_pid), timeout=60, interval=0.2, what="the orphaned stage exits")
    finally:
        parent.kill()
        parent.wait(30)
        if stage_pid and alive(stage_pid):
            os.kill(stage_pid, signal.SIGKILL)


def test_stages_are_forked_from_the_preloaded_server_but_not_on_cuda_nor_once_the_import_environment_changed(
        tiny_model, monkeypatch, tmp_path):
    """On CUDA an import may have initialised CUDA in the fork server (a forked child could not use it); a
    variable that torch or the hub read at import, changed since the server started, would not be seen."""
    kinds = {}
    for name, device in (("cpu", "cpu"), ("cuda", "cuda")):
        stages = LocalStages(1, model=str(tiny_model), device=device)
        planned = stages.plan()                      # the addresses first, nothing started
        assert stages.procs == [] and planned == stages.addresses
        stages.start()
        assert stages.addresses == planned and stages.procs[0].poll() is None
        kinds[name] = type(stages.procs[0])
        stages.stop()
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    stages = LocalStages(1, model=str(tiny_model))
    stages.start()
    kinds["changed"] = type(stages.procs[0])
    stages.stop()
    assert kinds == {"cpu": Child, "cuda": subprocess.Popen, "changed": subprocess.Popen}


def test_free_ports_are_distinct_and_free():
    """The stages' ports are picked together (all held bound until every one is picked): one port per stage,
    never the same twice (picked one at a time, the system may hand the one it just saw closed out again:
    two stages told the same port, seen in CI as a pipeline whose stages 1 and 2 were one server)."""
    for _ in range(20):
        ports = free_ports(16)
        assert len(set(ports)) == 16
        for port in ports:                     # each one can be bound now
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))
