"""Processes forked from a preloaded fork server (common/forkserver.py): what the child is, what it is not
allowed to differ in, and that it dies with nobody. Each launcher is a fresh interpreter (a fork server is one
per process: this worker's belongs to the stages its tests start)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers.wait import wait_until_blocking

ROOT = Path(__file__).resolve().parents[2]

LAUNCHER = r'''
import json, os, signal, subprocess, sys
from pathlib import Path
from common.forkserver import EnvironmentChanged, launch

log, cwd = Path(sys.argv[1]), sys.argv[2]
out = {}
child = launch("helpers.forked:report", ["a", "b c"], dict(os.environ, FORKED_GREETING="hello"), log,
               preload=("helpers.forked",), cwd=cwd, truncate=True)
out["code"], out["launcher"] = child.wait(60), os.getpid()
try:
    launch("helpers.forked:report", [], dict(os.environ, HF_HOME="/elsewhere"), log, preload=())
except EnvironmentChanged as e:
    out["refused"] = str(e)
sleeper = launch("helpers.forked:sleep", ["60"], dict(os.environ), Path(sys.argv[3]), preload=())
try:
    sleeper.wait(timeout=0.2)
except subprocess.TimeoutExpired:
    out["timed_out"] = True
sleeper.kill()
out["killed"] = sleeper.wait(30)
server = int(json.loads(log.read_text().splitlines()[0])["ppid"])
out["stdio"] = {fd: [os.readlink(f"/proc/{pid}/fd/{fd}") for pid in (os.getpid(), server)] for fd in (1, 2)}
print(json.dumps(out))
'''


def run_launcher(tmp_path: Path, script: str, *args: str) -> subprocess.Popen:
    """The script as a file with no `__main__` guard: a child that ran it again (as multiprocessing would,
    importing the main module) would launch from a daemonic process and fail."""
    (tmp_path / "launcher.py").write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)


def test_a_forked_child_is_the_program_with_its_argv_env_cwd_session_and_log(tmp_path):
    log, sleeper_log = tmp_path / "child.log", tmp_path / "sleeper.log"
    log.write_text("left from before\n")
    proc = run_launcher(tmp_path, LAUNCHER, str(log), str(tmp_path), str(sleeper_log))
    out = json.loads(proc.communicate(timeout=120)[0])
    assert proc.returncode == 0
    lines = log.read_text().splitlines()
    assert lines[1] == "to stderr" and "left from before" not in lines          # truncated, then both streams
    seen = json.loads(lines[0])
    assert seen["argv"] == ["a", "b c"] and seen["cwd"] == str(tmp_path) and seen["greeting"] == "hello"
    assert seen["sid"] == seen["pid"]                                   # its own session
    assert seen["ppid"] not in (out["launcher"], seen["pid"])           # forked from the server...
    assert seen["imported_in"] == seen["ppid"]                          # ...which had imported its module
    assert out["code"] == 3
    assert "HF_HOME" in out["refused"]                                  # read at import: refused
    assert out["timed_out"] and out["killed"] == -signal.SIGKILL
    for fd, (launcher, server) in out["stdio"].items():      # a reader of the launcher's output ends with it
        assert launcher != os.devnull and server == os.devnull, (fd, launcher, server)


ORPHAN = r'''
import json, os, sys
from pathlib import Path
from common.forkserver import launch
child = launch("helpers.forked:sleep", ["120"], dict(os.environ), Path(sys.argv[1]), preload=("helpers.forked",))
print(json.dumps({"child": child.pid}), flush=True)
sys.stdin.read()            # until killed
'''


def ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_the_fork_server_dies_with_its_launcher_and_its_children_see_it(tmp_path):
    log = tmp_path / "sleeper.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN, str(log)], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    child = json.loads(proc.stdout.readline())["child"]
    try:
        wait_until_blocking(lambda: log.exists() and log.read_text().strip(), timeout=60, what="the child's line")
        server = json.loads(log.read_text().splitlines()[0])["ppid"]
        assert server != proc.pid and ppid(server) == proc.pid
        proc.kill()
        proc.wait()
        wait_until_blocking(lambda: ppid(server) is None, timeout=30, what="the fork server's exit")
        assert ppid(child) not in (None, server)             # alive, re-parented: what --parent-pid watches
    finally:
        proc.kill()
        proc.wait()
        if ppid(child) is not None:
            os.kill(child, signal.SIGKILL)
