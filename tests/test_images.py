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
    assert "pip install --quiet -e '.[test]'" in makefile and "helm/get_helm.py" in makefile


def test_dockerignore_keeps_local_state_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)
