"""The Helm chart rendered by the pinned helm binary that `make install` puts into .venv/bin (helm/get_helm.py),
for the chart tests (test_chart.py, test_chart_tls_per_pod.py, ...).

    objs = render("tls.enabled=true")                 # helm template rel helm/specpipe --namespace ml --set ...
    sts = one(objs, "StatefulSet")
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parent.parent / "helm" / "specpipe"
HELM = Path(sys.executable).parent / "helm"
K8S_VERSION = "1.33.0"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    if not HELM.exists():
        pytest.fail(f"{HELM} is missing: run `make install` (helm/get_helm.py)")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=check,
                          env={"HOME": "/tmp", "PATH": "/usr/bin:/bin", "KUBECONFIG": "/dev/null"})


def render(*sets: str, release: str = "rel", namespace: str = "ml") -> list[dict]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str) -> dict:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]
