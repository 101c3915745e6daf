"""Local stage processes on 127.0.0.1, as `specpipe local` and `specpipe run` start them.

Ports are picked up front so every stage starts at once with its next hop known; the pipeline is ready
when every stage answers Info. `supervise()` restarts a stage process that exits, on the same port with the
same arguments, as Kubernetes restarts a pod (the coordinator's recovery then resumes the streams). On the
CPU the stages are forked from a fork server that has imported torch and transformers once
(common/forkserver.py): four stages of the default model ready in ~7 s instead of ~14 s, a restart in ~0.5 s
instead of ~6.5 s (2-core dev machine).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos import stage_pb2, stage_pb2_grpc
from common.forkserver import Child, EnvironmentChanged, launch
from common.grpc_server import RECONNECT_OPTIONS
from common.logs import get_logger

log = get_logger(__name__)


# What a stage imports before it loads a shard: the fork server imports it once (transformers' Llama modules
# serve Mistral and Qwen too; their own modules are imported by the stage that needs them).
STAGE_PRELOAD = ("services.server", "transformers.models.auto.configuration_auto",
                 "transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama",
                 "safetensors.torch")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free now: all n sockets are held bound until every port is picked (one at a time, the
    system may hand out a port it just handed out and saw closed: two stages on one port)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


@dataclass
class LocalStages:
    num_stages: int
    model: str = "default"
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1
    stage_time_ms: str = "0"
    kv_limit_mb: float = 0.0
    metrics_port: int = 0          # stage i serves metrics on metrics_port + 1 + i (0 = none)
    host: str = "127.0.0.1"
    log_dir: Path | None = None
    procs: list[subprocess.Popen | Child] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)       # per stage, by supervise()
    # Fork stages from a server that has imported torch (common/forkserver.py). Not on CUDA: an import that
    # asks torch.cuda.is_available() initialises CUDA, which a forked child then cannot use.
    preloaded: bool | None = None  # None: on for device "cpu"
    _args: list[list[str]] = field(default_factory=list)
    _env: dict[str, str] = field(default_factory=dict)
    _stopping: bool = False

    def plan(self) -> list[str]:
        """Pick the ports and build each stage's arguments, starting nothing: the addresses, known before any
        stage runs (what a coordinator's config needs while the stages start)."""
        if self.num_stages < 1:
            raise ValueError("--stages must be at least 1")
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="specpipe-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ports = free_ports(self.num_stages, self.host)
        self.addresses = [f"{self.host}:{p}" for p in ports]
        self._env = dict(os.environ, SPECPIPE_LOG_FORMAT=os.environ.get("SPECPIPE_LOG_FORMAT", "json"))
        self._args = [["--model", self.model, "--stage", str(i),
                       "--num-stages", str(self.num_stages), "--host", self.host, "--port", str(port),
                       "--next-hop", self.addresses[i + 1] if i + 1 < self.num_stages else "",
                       "--dtype", self.dtype, "--device", self.device, "--threads", str(self.threads),
                       "--stage-time-ms", self.stage_time_ms, "--kv-limit-mb", str(self.kv_limit_mb),
                       # never the coordinator's SPECPIPE_METRICS_PORT from the environment
                       "--metrics-port", str(self.metrics_port + 1 + i if self.metrics_port else 0),
                       # its one caller is this process, which has closed its streams when it stops the stage:
                       # no load balancer to give notice to (the notice is grace / 4, at most 1 s)
                       "--grace-s", "2"]
                      for i, port in enumerate(ports)]
        return self.addresses

    def start(self) -> list[str]:
        """Start every stage process (planned first if `plan` was not called). The first launch of a process
        waits for its fork server's imports (~6 s on 2 cores): whatever should load meanwhile (a draft) is
        started before this, on a thread of its own."""
        if not self._args:
            self.plan()
        self.procs = []
        for i in range(self.num_stages):       # one by one: stop() reaches those started if a launch fails
            self.procs.append(self._launch(i, "w"))
        self.restarts = [0] * self.num_stages
        return self.addresses

    def _launch(self, i: int, mode: str) -> subprocess.Popen | Child:
        """Start stage i: forked from the preloaded server (~0.3 s to its shard's loading instead of ~5.5 s of
        imports) or, when that cannot be (`preloaded` off, an environment changed since the server started), as
        `python -m services.server`. Either outlives no launcher that dies (`--parent-pid`)."""
        if self.preloaded if self.preloaded is not None else self.device.split(":")[0] == "cpu":
            try:
                return launch("services.server:forked_main", self._args[i], self._env, self.log_path(i),
                              preload=STAGE_PRELOAD, truncate=mode == "w")
            except (EnvironmentChanged, OSError, EOFError) as e:     # (a fork server that failed to start)
                log.info("stage started as a new process", stage=i, why=str(e))
        cmd = [sys.executable, "-m", "services.server", *self._args[i], "--parent-pid", str(os.getpid())]
        with open(self.log_path(i), mode) as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self._env,
                                    start_new_session=True)

    async def supervise(self, poll_s: float = 0.25, max_backoff_s: float = 30.0) -> None:
        """Restart stage processes that exit, until cancelled: at once, then with a doubling delay (up to
        max_backoff_s) while one keeps exiting within a minute of its start, as a crash-looping pod would."""
        started = [time.monotonic()] * self.num_stages
        backoff = [0.0] * self.num_stages
        while True:
            await asyncio.sleep(poll_s)
            for i, proc in enumerate(self.procs):
                if self._stopping or proc.poll() is None or time.monotonic() < started[i] + backoff[i]:
                    continue
                if time.monotonic() - started[i] > 60:
                    backoff[i] = 0.0
                log.warning("stage process exited: restarting it", stage=i, exit_code=proc.returncode,
                            restarts=self.restarts[i] + 1, log=str(self.log_path(i)))
                self.procs[i] = await asyncio.to_thread(self._launch, i, "a")   # (a fork server may start)
                self.restarts[i] += 1
                started[i] = time.monotonic()
                backoff[i] = min(max_backoff_s, max(1.0, backoff[i] * 2))

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"stage-{i}.log"

    async def wait_ready(self, timeout_s: float = 300.0, on_ready: Callable[[int], None] | None = None) -> None:
        """Wait until every stage answers Info (calling on_ready(i) as stage i does); raise with the
        stage's log tail if one exits."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.num_stages))
        channels = [grpc.aio.insecure_channel(a, options=RECONNECT_OPTIONS) for a in self.addresses]
        try:
            while pending:
                for i in sorted(pending):
                    if self.procs[i].poll() is not None:
                        raise RuntimeError(f"stage {i} exited with code {self.procs[i].returncode}:\n"
                                           f"{self.log_tail(i)}")
                    try:
                        await stage_pb2_grpc.StageStub(channels[i]).Info(stage_pb2.InfoRequest(), timeout=0.5)
                        pending.discard(i)
                        if on_ready is not None:
                            on_ready(i)
                    except grpc.aio.AioRpcError:
                        pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stages {sorted(pending)} not ready after {timeout_s:.0f} s")
                if pending:
                    await asyncio.sleep(0.2)
        finally:
            for c in channels:
                await c.close()

    def log_tail(self, i: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path(i).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every stage (they drain), then SIGKILL what is left."""
        self._stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def __enter__(self) -> "LocalStages":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
