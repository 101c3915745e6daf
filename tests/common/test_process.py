"""The way out of a process (common/process.py) and who takes it."""
from __future__ import annotations

import gc
from pathlib import Path

from common.process import before_exit


def test_before_exit_freezes_the_heap():
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        before_exit()
        assert gc.get_freeze_count() > 1000        # this process's modules, at least
    finally:
        gc.unfreeze()                              # (this process goes on: its garbage is collectable again)


def test_the_console_script_and_the_services_take_the_quick_way_out(monkeypatch):
    import coordinator.cli.main as cli
    calls = []
    monkeypatch.setattr(cli, "main", lambda argv=None: 7)
    monkeypatch.setattr(cli, "before_exit", lambda: calls.append("out"))
    assert cli.entry() == 7 and calls == ["out"]
    root = Path(__file__).resolve().parents[2]
    assert 'specpipe = "coordinator.cli.main:entry"' in (root / "pyproject.toml").read_text()
    for module in ("services/server.py", "coordinator/frontends/server.py"):
        tail = (root / module).read_text().split('if __name__ == "__main__":')[1]
        assert "before_exit()" in tail, module
