"""Local stage processes on 127.0.0.1, as `specpipe local` and `specpipe run` start them.

Ports are picked up front so every stage starts at once with its next hop known; the pipeline is ready
when every stage answers Info.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos import stage_pb2, stage_pb2_grpc


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LocalStages:
    num_stages: int
    model: str = "default"
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1
    stage_time_ms: str = "0"
    kv_limit_mb: float = 0.0
    host: str = "127.0.0.1"
    log_dir: Path | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    def start(self) -> list[str]:
        if self.num_stages < 1:
            raise ValueError("--stages must be at least 1")
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="specpipe-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ports = [free_port(self.host) for _ in range(self.num_stages)]
        self.addresses = [f"{self.host}:{p}" for p in ports]
        env = dict(os.environ, SPECPIPE_LOG_FORMAT=os.environ.get("SPECPIPE_LOG_FORMAT", "json"))
        for i, port in enumerate(ports):
            cmd = [sys.executable, "-m", "services.server", "--model", self.model, "--stage", str(i),
                   "--num-stages", str(self.num_stages), "--host", self.host, "--port", str(port),
                   "--next-hop", self.addresses[i + 1] if i + 1 < self.num_stages else "",
                   "--dtype", self.dtype, "--device", self.device, "--threads", str(self.threads),
                   "--stage-time-ms", self.stage_time_ms, "--kv-limit-mb", str(self.kv_limit_mb)]
            log = open(self.log_path(i), "w")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True))
            log.close()
        return self.addresses

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"stage-{i}.log"

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Wait until every stage answers Info; raise with the stage's log tail if one exits."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.num_stages))
        channels = [grpc.aio.insecure_channel(a) for a in self.addresses]
        try:
            while pending:
                for i in sorted(pending):
                    if self.procs[i].poll() is not None:
                        raise RuntimeError(f"stage {i} exited with code {self.procs[i].returncode}:\n"
                                           f"{self.log_tail(i)}")
                    try:
                        await stage_pb2_grpc.StageStub(channels[i]).Info(stage_pb2.InfoRequest(), timeout=0.5)
                        pending.discard(i)
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

    def __exit__(self, *exc) -> None:
        self.stop()
