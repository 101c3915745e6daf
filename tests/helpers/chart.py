"""The Helm chart rendered by the pinned helm binary that `make install` puts into .venv/bin (helm/get_helm.py),
for the chart tests (tests/chart/); value sets; label selectors.

    objs = render("tls.enabled=true")                 # helm template rel helm/specpipe --namespace ml --set ...
    sts = one(objs, "StatefulSet")
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "specpipe"
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


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


# value sets the chart tests render (every manifest of each is valid Kubernetes: tests/chart/test_chart.py)
VALUE_SETS = {
    "defaults": [],
    "cpu-demo": ["model.source=default", "stages.gpu.count=0", "coordinator.gpu.count=0", "stages.device=cpu",
                 "coordinator.device=cpu", "model.dtype=float32", "stages.replicas=2", "stages.stageTimeMs=120+0.5"],
    "pvc-amd": ["model.source=pvc", "model.pvc.claimName=llama70b", "model.path=Llama-3.1-70B-Instruct",
                "stages.gpu.resourceName=amd.com/gpu", "stages.replicas=8", "stages.nodeSelector.pool=gpu",
                "stages.tolerations[0].key=gpu", "stages.tolerations[0].operator=Exists",
                "coordinator.draft=model", "coordinator.draftModelPath=Llama-3.2-1B-Instruct"],
    "hub": ["model.source=hub", "model.hub.id=meta-llama/Llama-3.1-8B-Instruct", "model.hub.tokenSecret.name=hf",
            "serviceMonitor.enabled=true", "networkPolicy.enabled=false", "podDisruptionBudget.enabled=false",
            "serviceAccount.create=false", "stages.replicas=1"],
}
