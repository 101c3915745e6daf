"""The commands of every doc (README.md, docs/*.md, helm/README.md), run as written. A ```bash or ```python
block runs when the line before its fence is

    <!-- readme-test: local -->       it needs a server: runs while ONE shared `specpipe local --stages 2` serves
                                      the README's addresses (gRPC :50051, OpenAI HTTP :8000, metrics :9160). A
                                      foreground `specpipe local` line in it (the reader's "start the server"
                                      step) is not run: the shared server stands in (same ports, checked).
    <!-- readme-test: standalone -->  runs alone, before the shared server starts (may start its own server
                                      on the README's ports, e.g. with `&` ... `kill %1`).

Unmarked blocks do not run (make, docker, helm, kubectl, long benchmarks, output samples). bash blocks run
under `set -eo pipefail` in the repository root, python blocks with the venv's python. A block passes when it
exits 0, prints something and no traceback, and its output has what its commands promise (EXPECTATIONS).
Every process a block starts carries ENV_MARK in its environment: any left when the block ends is a failure.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "helm" / "README.md"]
VENV_BIN = ROOT / ".venv" / "bin"
PYTHON = str(VENV_BIN / "python")
# they share the README's fixed ports: under pytest-xdist one worker runs this module (make test: --dist loadfile)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (VENV_BIN / "specpipe").exists(),
                                                   reason="the README runs .venv/bin/...: needs `make install`")]
KINDS = ("local", "standalone")
GRPC_PORT, HTTP_PORT, METRICS_PORT, SHARED_STAGES = 50051, 8000, 9160, 2
PORTS = (GRPC_PORT, HTTP_PORT, METRICS_PORT, *(METRICS_PORT + 1 + i for i in range(SHARED_STAGES)))
ENV_MARK = "SPECPIPE_README_TEST"          # carried by every process a block (or the shared server) starts
BLOCK_TIMEOUT_S = 300.0
MARKER = re.compile(r"^<!--\s*readme-test:\s*(?P<kind>\S+?)\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
SUMMARY = (r"^\[\d+ tokens \((length|eos|stop)\), \d+\.\d\d tokens/step, \d+\.\d ms between tokens, "
           r"first token after \d+ ms, \d+\.\d\d s(, cost rule: (width \d+( topk \d+)?|no speculation)"
           r"( after a \d+\.\d s warm-up)?)?\]$")


@dataclass(frozen=True)
class Block:
    doc: str             # the file, relative to the repository root
    line: int            # its line of the opening fence (1-based)
    lang: str
    kind: str | None     # the marker's kind; None: not run
    source: str

    @property
    def name(self) -> str:
        return f"{self.doc.replace('/', '-')}-L{self.line}-{self.lang}"

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


# (command, stream, output): when a block's source matches `command`, its stdout or stderr must match `output`
EXPECTATIONS = (
    (r"specpipe run (?!.*--json)", "stderr", SUMMARY),
    (r"specpipe generate (?!.*--json)", "stderr", SUMMARY),
    (r"specpipe (stage|coordinator) --help", "stdout", r"^usage: "),
    (r"grpcurl .*\blist\b", "stdout", r"^specpipe\.v1\.Generation$"),
    (r"Generation/Generate", "stdout", r'"finish_?[rR]eason": "(length|eos|stop)"'),
    (r"grpc\.health\.v1\.Health/Check", "stdout", r'"status": "SERVING"'),
    (r"curl .*/v1/chat/completions", "stdout", r'"object": ?"chat\.completion".*"content": ?"[^"]+'),
    (r'"stream": true', "stdout", r"^data: \[DONE\]$"),
    (r"/metrics \| grep \^specpipe_ ", "stdout", r"^specpipe_requests_total\{.*\} [1-9]"),
    (r"/metrics \| grep \^specpipe_stage_", "stdout", r'^specpipe_stage_batches_total\{stage="0"\} [1-9]'),
    (r"chat\.completions\.create\(", "stdout", r"completion_tokens=[1-9]"),
    (r"client\.generate\(", "stdout", r"\w{3,}"),
    (r"stream\.result\b.*tokens/step", "stdout", r"^\d+ tokens \((length|eos|stop)\), [\d.]+ tokens/step"),
    (r"except SpecPipeError", "stdout", r"^INVALID_ARGUMENT max_new_tokens must be at least 1"),
    (r"ttft_ms, \"ms to the first token\"", "stdout", r"\d+(\.\d+)? ms to the first token"),
)


def parse_readme(text: str, doc: str = "README.md") -> tuple[list[Block], list[str]]:
    """Every fenced block of one doc with its marker kind, and the problems found with markers."""
    blocks, problems, lines = [], [], text.splitlines()
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if m:
            nxt = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if nxt is None or not nxt.group("lang"):
                problems.append(f"{doc}:{i + 1}: a readme-test marker must be right before a ```bash or "
                                f"```python fence")
            elif m.group("kind") not in KINDS:
                problems.append(f"{doc}:{i + 1}: unknown readme-test kind {m.group('kind')!r} (known: "
                                f"{', '.join(KINDS)})")
        f = FENCE.match(lines[i])
        if f:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            prev = MARKER.match(lines[i - 1]) if i > 0 else None
            kind = prev.group("kind") if prev and prev.group("kind") in KINDS else None
            lang = f.group("lang")
            if kind and lang not in ("bash", "python"):
                problems.append(f"{doc}:{i + 1}: only bash and python blocks can be run, not {lang!r}")
                kind = None
            blocks.append(Block(doc, i + 1, lang, kind, "\n".join(lines[i + 1:end])))
            i = end
        i += 1
    return blocks, problems


def parse_docs() -> tuple[list[Block], list[str]]:
    blocks, problems = [], []
    for path in DOCS:
        b, p = parse_readme(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
        blocks += b
        problems += p
    return blocks, problems


BLOCKS, PROBLEMS = parse_docs()
STANDALONE = [b for b in BLOCKS if b.kind == "standalone"]
LOCAL = [b for b in BLOCKS if b.kind == "local"]


def logical_lines(source: str) -> list[tuple[int, int, str]]:
    """(first, last + 1 physical line index, text) of each command line, backslash continuations joined."""
    out, start, parts = [], 0, []
    lines = source.splitlines()
    for k, line in enumerate(lines):
        if not parts:
            start = k
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        out.append((start, k + 1, " ".join(parts)))
        parts = []
    if parts:
        out.append((start, len(lines), " ".join(parts)))
    return out


def local_server_args(command: str) -> list[str] | None:
    """The arguments of a `specpipe local` command line, None for any other line; raises for one that runs
    in the background (that block must be `standalone`)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    if len(words) < 2 or not words[0].endswith("specpipe") or words[1] != "local":
        return None
    if "&" in words or command.split("#")[0].rstrip().endswith("&"):
        raise ValueError("starts `specpipe local` in the background: mark the block standalone")
    return words[2:]


def bash_script(block: Block) -> tuple[str, list[str]]:
    """The script to run and, for a `local` block, the `specpipe local` lines the shared server stands for."""
    lines, replaced = block.source.splitlines(), []
    if block.kind == "local":
        for start, end, command in logical_lines(block.source):
            args = local_server_args(command)
            if args is None:
                continue
            from coordinator.cli.main import build_parser      # the README's flags must exist and match our ports
            parsed = build_parser().parse_args(["local", *args])
            if (parsed.host, parsed.port, parsed.http_port) != ("127.0.0.1", GRPC_PORT, HTTP_PORT):
                raise ValueError(f"{block.doc}:{block.line + 1 + start}: {command.strip()!r} serves other ports "
                                 f"than the shared server ({GRPC_PORT}, HTTP {HTTP_PORT})")
            for k in range(start, end):
                lines[k] = ": # (the shared test server stands in for this line)"
            replaced.append(command.strip())
    return "set -eo pipefail\n" + "\n".join(lines) + "\n", replaced


def marked_pids(token: str) -> list[int]:
    """The processes whose environment carries ENV_MARK=token (children inherit it, stage processes too)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"{ENV_MARK}={token}".encode() in env.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def reap(token: str, wait_s: float) -> list[str]:
    """Wait up to wait_s for the processes carrying `token` to exit; kill and describe the ones left."""
    deadline = time.monotonic() + wait_s
    while (pids := marked_pids(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace(chr(0), " ")
            left.append(f"{pid}: {cmdline[:200]}")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in marked_pids(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + 10
        while marked_pids(token) and time.monotonic() < end:
            time.sleep(0.2)
    return left


def ports_in_use(wait_s: float = 30.0) -> list[int]:
    """The README's ports that still accept connections after up to wait_s (a server that just exited may
    hold its sockets a moment longer than its /proc entry shows it)."""
    deadline = time.monotonic() + wait_s
    while True:
        used = []
        for port in PORTS:
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    used.append(port)
        if not used or time.monotonic() > deadline:
            return used
        time.sleep(0.5)


def run_block(block: Block, tmp: Path) -> None:
    """Run one marked block; fail with its README line, source, output and stray processes."""
    if re.search(r"^\s*curl ", block.source, re.M) and shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    token = uuid.uuid4().hex
    env = dict(os.environ, **{ENV_MARK: token})
    env.pop("SPECPIPE_DEBUG", None)
    if block.lang == "bash":
        script, replaced = bash_script(block)
        path, argv = tmp / f"{block.name}.sh", ["bash"]
    else:
        script, replaced = block.source + "\n", []
        path, argv = tmp / f"{block.name}.py", [PYTHON]
    path.write_text(script)
    out_path, err_path = tmp / f"{block.name}.out", tmp / f"{block.name}.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([*argv, str(path)], cwd=ROOT, env=env, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    # a server the block stopped itself (kill %1) may take a few seconds to drain; after a failure, none
    strays = reap(token, wait_s=45.0 if rc == 0 else 0.0)
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    numbered = "\n".join(f"  {block.line + k:4d}  {line}" for k, line in enumerate(block.source.splitlines(), 1))
    where = (f"{block.where} ({block.kind} {block.lang} block)\n{numbered}\n--- stdout (tail)\n"
             f"{stdout[-3000:]}\n--- stderr (tail)\n{stderr[-3000:]}")
    if rc != 0:
        pytest.fail(f"exit code {rc} from {where}", pytrace=False)
    if strays:
        pytest.fail(f"processes left running by {where}\n--- left\n" + "\n".join(strays), pytrace=False)
    problems = check_output(block, stdout, stderr)
    if problems:
        pytest.fail("\n".join(problems) + f"\nfrom {where}", pytrace=False)
    stood_in = f" (the shared server stood in for {replaced})" if replaced else ""
    print(f"{block.where}{stood_in}\n--- stdout (tail)\n{stdout[-1500:]}\n--- stderr\n{stderr[-800:]}")


def check_output(block: Block, stdout: str, stderr: str) -> list[str]:
    problems = []
    if not stdout.strip():
        problems.append("the block printed nothing on stdout")
    if "Traceback (most recent call last)" in stderr:
        problems.append("a traceback on stderr")
    streams = {"stdout": stdout, "stderr": stderr}
    for command, stream, output in EXPECTATIONS:
        if re.search(command, block.source) and not re.search(output, streams[stream], re.M | re.S):
            problems.append(f"commands matching {command!r} should print {output!r} on {stream}")
    if re.search(r"specpipe (run|generate) .*--json", block.source):
        objects = []
        for line in stdout.splitlines():
            try:
                objects.append(json.loads(line))
            except ValueError:
                continue
        if not any(isinstance(o, dict) and o.get("text") and o.get("token_ids") for o in objects):
            problems.append("--json printed no object with `text` and `token_ids`")
    return problems


class SharedServer:
    """One `specpipe local` on the README's ports for all `local` blocks; stopped with SIGINT."""

    def __init__(self, tmp: Path) -> None:
        self.token = uuid.uuid4().hex
        self.log = tmp / "specpipe-local.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        env = dict(os.environ, **{ENV_MARK: self.token})
        argv = [str(VENV_BIN / "specpipe"), "local", "--stages", str(SHARED_STAGES), "--port", str(GRPC_PORT),
                "--http-port", str(HTTP_PORT), "--metrics-port", str(METRICS_PORT)]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specpipe local exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"specpipe local not serving after {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> tuple[int | None, list[str]]:
        """SIGINT (Ctrl-C), then the exit code and any process of the server still running after 30 s."""
        if self.proc is None:
            return None, []
        rc = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = self.proc.wait(timeout=30)
        strays = reap(self.token, wait_s=15.0)
        self.proc = None
        return rc, strays


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    if used := ports_in_use():
        pytest.fail(f"ports {used} are in use: another specpipe server is running here", pytrace=False)
    from services.model.loader import ensure_default_model
    ensure_default_model()
    server = SharedServer(tmp_path_factory.mktemp("readme"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_readme_markers_are_well_formed():
    assert not PROBLEMS, "\n".join(PROBLEMS)
    assert LOCAL and STANDALONE, "the docs have no blocks marked <!-- readme-test: local|standalone -->"
    for block in LOCAL:
        if block.lang == "bash":
            bash_script(block)                        # `specpipe local` lines parse and use the shared ports


def test_parser_finds_markers_and_stand_ins():
    text = ("x\n<!-- readme-test: local -->\n```bash\n.venv/bin/specpipe local --stages 4   # serve\n"
            "curl -s 127.0.0.1:8000/health\n```\n\n```bash\nmake test\n```\n<!-- readme-test: locl -->\n"
            "```bash\necho\n```\n")
    blocks, problems = parse_readme(text)
    assert [(b.line, b.kind) for b in blocks] == [(3, "local"), (8, None), (12, None)]
    assert len(problems) == 1 and "unknown readme-test kind 'locl'" in problems[0]
    script, replaced = bash_script(blocks[0])
    assert replaced == [".venv/bin/specpipe local --stages 4   # serve"]
    assert script.splitlines()[1].startswith(": #") and script.splitlines()[2].startswith("curl")
    with pytest.raises(ValueError, match="background"):
        local_server_args(".venv/bin/specpipe local --stages 2 &")
    with pytest.raises(ValueError, match="other ports"):
        bash_script(Block("README.md", 1, "bash", "local", "specpipe local --port 50052"))


def test_output_checks_catch_wrong_output():
    health = Block("README.md", 1, "bash", "local", "grpcurl -plaintext 127.0.0.1:50051 grpc.health.v1.Health/Check")
    assert check_output(health, '{\n  "status": "SERVING"\n}\n', "") == []
    assert any("SERVING" in p for p in check_output(health, '{\n  "status": "NOT_SERVING"\n}\n', ""))
    run = Block("README.md", 1, "bash", "local", '.venv/bin/specpipe run "x" --json')
    assert check_output(run, '{"text": "Paris", "token_ids": [1]}\n', "") == []
    assert check_output(run, '{"text": "", "token_ids": []}\n', "") and check_output(run, "", "")
    gen = Block("README.md", 1, "bash", "local", '.venv/bin/specpipe generate "Hi"')
    line = "[12 tokens (eos), 1.71 tokens/step, 19.8 ms between tokens, first token after 95 ms, 0.33 s]"
    assert check_output(gen, "Hello", f"{line}\n") == []
    assert check_output(gen, "Hello", "Traceback (most recent call last):\n" + line)


@pytest.mark.parametrize("block", STANDALONE, ids=lambda b: b.name)
def test_standalone_block(block, tmp_path):
    if used := ports_in_use():
        pytest.fail(f"ports {used} are in use: another specpipe server is running here", pytrace=False)
    from services.model.loader import ensure_default_model
    ensure_default_model()                           # the one-time conversion, before any timeout counts
    run_block(block, tmp_path)


@pytest.mark.parametrize("block", LOCAL, ids=lambda b: b.name)
def test_local_block(block, shared_server, tmp_path):
    if shared_server.proc is None or shared_server.proc.poll() is not None:
        pytest.fail(f"the shared specpipe local is not running:\n{shared_server.tail()}", pytrace=False)
    run_block(block, tmp_path)


def test_shared_server_stops_on_ctrl_c(shared_server):
    """Last: SIGINT stops `specpipe local` with exit code 0 and leaves no stage process behind."""
    rc, strays = shared_server.stop()
    assert rc == 0, f"specpipe local exited with {rc} on SIGINT:\n{shared_server.tail()}"
    assert not strays, "left running after specpipe local stopped:\n" + "\n".join(strays)
