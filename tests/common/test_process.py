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
    monkeypatch.setattr(cli, "as_program", lambda: calls.append("program"))
    assert cli.entry() == 7 and calls == ["program", "out"]
    root = Path(__file__).resolve().parents[2]
    assert 'specpipe = "coordinator.cli.main:entry"' in (root / "pyproject.toml").read_text()
    for module in ("services/server.py", "coordinator/frontends/server.py"):
        tail = (root / module).read_text().split('if __name__ == "__main__":')[1]
        assert "before_exit()" in tail, module


HEAP = r'''
import gc, json, weakref
from common.process import after_load, as_program

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

out = {"outside_a_program": after_load()}
out["frozen_outside"] = gc.get_freeze_count()
as_program()                                   # the entry point: what the imports made is frozen
out["frozen_at_entry"] = gc.get_freeze_count()
loaded = [Node() for _ in range(5000)]         # the "model"
garbage_before = cycle()                       # a cycle that loading left behind, unreachable
out["frozen"] = after_load()
out["garbage_before_freed"] = garbage_before() is None
out["model_frozen"] = out["frozen"] >= out["frozen_at_entry"] + 5000
kept = Node(); kept.self = kept                # a cycle of the "model" that a re-configure drops
dropped = weakref.ref(kept)
after_load()
del kept
gc.collect()
out["frozen_cycle_kept_by_plain_collect"] = dropped() is not None
after_load(replaced=True)                      # a re-configure: what the old model left in cycles goes
out["frozen_cycle_freed_when_replaced"] = dropped() is None
garbage_after = cycle()
gc.collect()
out["garbage_after_freed"] = garbage_after() is None
print(json.dumps(out))
'''


def test_a_program_freezes_its_heap_once_loaded_and_frees_what_a_replaced_model_left():
    """In a fresh interpreter (freezing is for the whole process): nothing outside a program; at the entry
    point what the imports made; after loading the model too, garbage collected first; a re-configure's
    dropped model freed even when it held reference cycles; garbage made while serving still collected."""
    import json
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", HEAP], capture_output=True, text=True, cwd=root, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["outside_a_program"] == 0 and out["frozen_outside"] == 0
    assert out["frozen_at_entry"] > 1000
    assert out["model_frozen"] and out["garbage_before_freed"] and out["garbage_after_freed"]
    assert out["frozen_cycle_kept_by_plain_collect"]          # what freezing does: the control for the next line
    assert out["frozen_cycle_freed_when_replaced"]


def test_the_programs_freeze_their_heap_and_the_services_do_once_loaded():
    root = Path(__file__).resolve().parents[2]
    for module in ("services/server.py", "coordinator/frontends/server.py"):
        tail = (root / module).read_text().split('if __name__ == "__main__":')[1]
        assert tail.index("as_program()") < tail.index("main()"), module
    assert "after_load()" in (root / "services/server.py").read_text()
    assert "after_load()" in (root / "coordinator/frontends/service.py").read_text()
    assert "after_load(replaced=True)" in (root / "services/servicer.py").read_text()
