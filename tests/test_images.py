"""The container images install exactly what `make install` installs (no Docker daemon runs here, so the
images themselves are not built in CI; helm/README.md says so)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_lines(dockerfile: Path) -> list[str]:
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    return [line[4:].strip() for line in text.splitlines() if line.startswith("RUN ")]


@pytest.mark.parametrize("name, torch_index", [("Dockerfile", None),
                                              ("Dockerfile.cpu", "https://download.pytorch.org/whl/cpu")])
def test_image_installs_with_the_makefile(name, torch_index):
    runs = run_lines(ROOT / name)
    installs = [r for r in runs if "make install" in r]
    assert len(installs) == 1, f"{name}: exactly one `make install` step"
    assert "make install-runtime" in installs[0], f"{name}: the runtime install (no test tools, no helm)"
    assert not any("pip install" in r for r in runs), f"{name}: no pip install besides the Makefile's"
    step = installs[0]
    assert "VENV=/opt/venv" in step
    if torch_index:
        assert f"TORCH_INDEX={torch_index}" in step
    else:
        assert "TORCH_INDEX" not in step           # PyPI's default torch wheel is the CUDA build
    text = (ROOT / name).read_text()
    assert 'ENTRYPOINT ["specpipe"]' in text and "PATH=/opt/venv/bin" in text


def test_makefile_install_pins_torch_like_pyproject():
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"pip install --quiet torch=={pin} $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))" in makefile
    assert "pip install --quiet -e '.$(EXTRAS)'" in makefile and "EXTRAS  ?= [test]" in makefile
    assert "$(if $(filter 1,$(HELM)),$(BIN)/python helm/get_helm.py $(BIN)/helm)" in makefile
    assert "$(MAKE) install EXTRAS= HELM=0" in makefile          # install-runtime: the same recipe, less


def test_dockerignore_keeps_local_state_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)


# import name -> distribution, for the packages the product's code imports
DISTRIBUTIONS = {"aiohttp": "aiohttp", "google": "protobuf", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
                 "grpc_reflection": "grpcio-reflection", "grpc_tools": "grpcio-tools",
                 "huggingface_hub": "huggingface-hub", "jinja2": "jinja2", "kubernetes": "kubernetes",
                 "matplotlib": "matplotlib", "numpy": "numpy", "prometheus_client": "prometheus-client", "safetensors": "safetensors",
                 "structlog": "structlog", "torch": "torch", "transformers": "transformers",
                 "typing_extensions": "typing-extensions", "urllib3": "urllib3", "tokenizers": "tokenizers",
                 "gguf": "gguf", "accelerate": "accelerate"}


def test_the_runtime_install_has_every_package_the_code_imports():
    """The images install no test extras: whatever coordinator/, services/, common/ and protos/ import must be a
    declared dependency (not one that only `[test]` or a transitive dependency happens to bring)."""
    import ast
    import sys
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=\[ ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    imported = set()
    for root in ("coordinator", "services", "common", "protos"):
        for f in (ROOT / root).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"coordinator", "services", "common", "protos", "client"}
    unknown = third_party - DISTRIBUTIONS.keys()
    assert not unknown, f"map these imports to their distribution: {sorted(unknown)}"
    missing = sorted(DISTRIBUTIONS[n] for n in third_party if DISTRIBUTIONS[n] not in declared)
    assert not missing, f"imported but not declared in pyproject's dependencies: {missing}"
