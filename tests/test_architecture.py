"""The tree is the architecture: imports go one way, with no cycles (lazy imports count), read from the source.

Layers, lowest first: `coordinator.core` (pure, sans-IO: no grpc, no asyncio) <- `coordinator.engine` (asyncio,
no grpc server, no front ends) <- `coordinator.frontends` <- `coordinator.cli`, `coordinator.bench`. `services`
(the stage) never imports the coordinator; `common` (what both share) imports neither; `client` needs only grpc
and the generated protos.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "services", "common", "client", "protos")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_in_source(source: str, module: str, is_package: bool, filename: str = "<source>") -> set[str]:
    """Every module `source` (the text of module `module`, a package's `__init__` when `is_package`) imports,
    anywhere in it (top level or inside a function), as dotted names; `from a.b import c` counts as a.b.c when
    that is a module of ours, else as a.b."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in MODULES else base)
    return found


def imports_of(path: Path) -> set[str]:
    """Every module the file at `path` imports (see `imports_in_source`)."""
    return imports_in_source(path.read_text(), module_name(path), path.name == "__init__.py", str(path))


GRAPH = {m: {i for i in imports_of(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def test_imports_in_source_reads_lazy_and_relative_imports() -> None:
    src = "import grpc\ndef f():\n    from coordinator.core import tree\n    from . import validate\n"
    found = imports_in_source(src, "coordinator.core._probe_not_a_module", is_package=False)
    assert {"grpc", "coordinator.core.tree", "coordinator.core.validate"} <= found
    assert {"coordinator.core.tree", "coordinator.core.validate"} <= imports_in_source(
        "from . import tree, validate\n", "coordinator.core", is_package=True)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted.

    >>> cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycles_finds_a_cycle_and_only_it() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_anywhere() -> None:
    assert cycles(GRAPH) == []


# what each layer may not import (ours and third-party), by prefix
FORBIDDEN = {
    "coordinator.core": ("grpc", "grpc_health", "asyncio", "aiohttp", "protos", "kubernetes", "prometheus_client",
                         "coordinator.engine", "coordinator.frontends", "coordinator.cli", "coordinator.bench",
                         "services.servicer", "services.server", "common.grpc_server", "common.wire", "common.malformed",
                         "common.metrics_http"),
    "coordinator.engine": ("aiohttp", "coordinator.frontends", "coordinator.cli", "coordinator.bench"),
    "coordinator.frontends": ("coordinator.cli", "coordinator.bench"),
    "coordinator.bench": ("coordinator.cli",),          # what both need lives below them
    "services": ("coordinator", "client"),
    "common": ("services", "coordinator", "client"),      # shared by both: depends on neither
    "client": ("torch", "transformers", "services", "common", "coordinator"),
}


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("layer_name", sorted(FORBIDDEN))
def test_imports_go_one_way(layer_name: str) -> None:
    bad = sorted(f"{m} imports {i}" for m, p in MODULES.items() if _matches(m, layer_name)
                 for i in imports_of(p) for f in FORBIDDEN[layer_name] if _matches(i, f))
    assert bad == []


def test_at_most_eight_modules_directly_in_coordinator() -> None:
    flat = sorted(p.name for p in (ROOT / "coordinator").glob("*.py"))
    assert len(flat) <= 8, flat
