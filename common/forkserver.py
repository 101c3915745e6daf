"""Start many processes of one program for the cost of one import: a preloaded fork server.

A stage process spends most of its start-up importing torch and transformers (~5.5 s of CPU of ~8 s to ready
on the 2-core dev machine, SmolLM2's 8-layer shard); `specpipe local --stages 4` paid that four times, and a
stage that dies and is restarted paid it again before its streams could resume. multiprocessing's fork server
imports the `preload` modules once, in a process of its own started at the first launch; every launch then
forks it (a copy-on-write copy, torch already imported) and runs `target(argv)` in the child:

    child = launch("services.server:forked_main", argv, env, log_path)   # a Child: poll, wait, send_signal
    child.wait(timeout=30)

The child is what `python -m <program> argv` would be: its own session (`setsid`, as `start_new_session`),
stdout and stderr appended to `log_path`, the environment `env`, the working directory `cwd`. What the
preloaded modules read from the environment when they were imported (cache folders, thread and CUDA
settings: `IMPORT_ENV`) is the fork server's: `launch` refuses (`EnvironmentChanged`; the caller starts a
plain process) when `env` differs there from the environment the server was started with. The fork server
exits once the process that started it and every child it forked have closed their end of its "alive" pipe:
a child closes its end at once, so that a launcher that dies (even by SIGKILL) takes the fork server with it,
and the children, re-parented, can see it (a stage's `--parent-pid`). The fork server's own stdout and stderr
go to /dev/null, not the launcher's.
"""
from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from pathlib import Path


def _imported_by_the_fork_server() -> bool:
    """This module is being imported by multiprocessing's fork server, preloading (`launch` names it first)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_code.co_filename == multiprocessing.forkserver.__file__:
            return True
        frame = frame.f_back
    return False


if _imported_by_the_fork_server():
    # The fork server outlives its launcher by its own teardown (~1.5 s with torch imported): holding the
    # launcher's stdout and stderr, it would keep a reader waiting for their end (`specpipe run --json | jq`,
    # a test capturing output) that long after the launcher exits. Its children get theirs from `_child`.
    _null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(_null, 1)
    os.dup2(_null, 2)
    os.close(_null)


class EnvironmentChanged(RuntimeError):
    """The launch's environment differs from the one the preloaded modules were imported under."""


class Child:
    """A forked child, with the part of `subprocess.Popen`'s interface that the launchers and their tests use
    (`pid`, `poll`, `wait`, `returncode`, `send_signal`, `terminate`, `kill`; a signal's death is -signum)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid: int = process.pid or 0
        self.args = process.name

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:                 # never a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# Variables that torch, transformers, safetensors, huggingface_hub, OpenMP or the loader read when imported
# (by prefix); the others are read when used, in the child, from `env`.
IMPORT_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "SAFETENSORS_", "TORCH", "PYTORCH_", "CUDA_", "NCCL_",
              "NVIDIA_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "PYTHON", "XDG_", "HOME")

_lock = threading.Lock()
_server_env: dict[str, str] | None = None        # IMPORT_ENV's values when the fork server was started


def _import_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV)}


def launch(target: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path, *,
           preload: Sequence[str], cwd: str | None = None, truncate: bool = False) -> Child:
    """Fork `target` ("package.module:function", called with argv; its return value is the exit code) from
    the fork server that has imported `preload` (started at the first launch of this process). `truncate`:
    empty the log first (else append). Raises EnvironmentChanged as above."""
    global _server_env
    ctx = multiprocessing.get_context("forkserver")
    with _lock:
        if _server_env is None:
            ctx.set_forkserver_preload([__name__, *preload])
            _server_env = _import_env(os.environ)
        if _import_env(env) != _server_env:
            changed = sorted(k for k in _import_env(env).keys() | _server_env.keys()
                             if env.get(k) != _server_env.get(k))
            raise EnvironmentChanged(f"{', '.join(changed)} changed since the fork server started")
        if truncate:
            log_path.write_bytes(b"")
        process = ctx.Process(target=_child, args=(target, list(argv), dict(env), cwd or os.getcwd(),
                                                   str(log_path)),
                              name=target, daemon=True)
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")   # see _child
        try:
            process.start()
        finally:
            sys.modules["__main__"] = main
    return Child(process)


def _child(target: str, argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked child: become what a fresh process of the program would be, then run it. (multiprocessing
    would first import the launcher's main module here, as a spawned child needs it: the `specpipe` script,
    pytest, a user's script without a `__main__` guard. `launch` hides it while it starts the child: `target`
    is all the child runs.)"""
    alive = getattr(multiprocessing.forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:               # the fork server's life is its launcher's, not this child's
        os.close(alive)
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    module, _, function = target.partition(":")
    raise SystemExit(getattr(importlib.import_module(module), function)(argv))
