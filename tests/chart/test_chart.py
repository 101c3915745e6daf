"""The Helm chart: lint, render with several value sets, check the objects, validate every manifest against
the Kubernetes schemas, and parse the rendered container arguments with our own CLI (so chart and code agree).
Uses the pinned helm binary that `make install` puts into .venv/bin (helm/get_helm.py; tests/helpers/chart.py)."""
from __future__ import annotations

import pytest

from helpers.chart import CHART, K8S_VERSION, VALUE_SETS, by_kind, helm, one, render


def test_lint_strict():
    out = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_manifest_is_valid_kubernetes(name):
    import kubernetes_validate
    objs = render(*VALUE_SETS[name])
    assert objs
    for o in objs:
        if o["apiVersion"].startswith("monitoring.coreos.com"):
            continue            # a CRD (prometheus-operator): no schema in kubernetes-validate
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def test_default_objects():
    objs = render()
    sts, dep = one(objs, "StatefulSet"), one(objs, "Deployment")
    assert sts["metadata"]["name"] == "rel-specpipe-stage" and sts["spec"]["replicas"] == 4
    assert sts["spec"]["serviceName"] == "rel-specpipe-stage"
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == 50061
    assert pod["terminationGracePeriodSeconds"] > 30        # longer than the stage's drain (--grace-s=30)
    assert "--grace-s=30" in c["args"]
    svc = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] == "rel-specpipe-stage"][0]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    api = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] == "rel-specpipe-coordinator"][0]
    # the public API only: metrics have their own ClusterIP Service (never behind a LoadBalancer)
    assert {p["name"]: p["port"] for p in api["spec"]["ports"]} == {"grpc": 50051, "http": 8000}
    metrics = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] == "rel-specpipe-coordinator-metrics"][0]
    assert metrics["spec"]["type"] == "ClusterIP" and [p["port"] for p in metrics["spec"]["ports"]] == [9090]
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "rel-specpipe"
    role = one(objs, "Role")
    assert role["rules"][0]["resources"] == ["statefulsets"] and "watch" in role["rules"][0]["verbs"]
    assert one(objs, "RoleBinding")["subjects"][0]["namespace"] == "ml"
    assert one(objs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert one(render("podDisruptionBudget.maxUnavailable=0"), "PodDisruptionBudget")["spec"]["maxUnavailable"] == 0
    assert one(render("podDisruptionBudget.maxUnavailable=25%"), "PodDisruptionBudget")["spec"]["maxUnavailable"] == "25%"
    hook = one(objs, "Pod")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test" and hook["spec"]["containers"][0]["args"][0] == "generate"


def test_network_policies_chain_the_stages():
    objs = render("stages.replicas=3")
    pols = {p["metadata"]["name"]: p for p in by_kind(objs, "NetworkPolicy")}
    assert set(pols) == {"rel-specpipe-stage-0", "rel-specpipe-stage-1", "rel-specpipe-stage-2",
                         "rel-specpipe-stage-scaled", "rel-specpipe-coordinator"}
    def sources(name):
        return [f["podSelector"]["matchLabels"] for f in pols[name]["spec"]["ingress"][0]["from"]]
    assert [s["app.kubernetes.io/component"] for s in sources("rel-specpipe-stage-0")] == ["coordinator"]
    assert sources("rel-specpipe-stage-2")[1]["statefulset.kubernetes.io/pod-name"] == "rel-specpipe-stage-1"
    scaled = pols["rel-specpipe-stage-scaled"]["spec"]["podSelector"]["matchExpressions"][0]
    assert scaled["operator"] == "NotIn" and len(scaled["values"]) == 3


def test_value_sets_reach_the_pods():
    pvc = render(*VALUE_SETS["pvc-amd"])
    spec = one(pvc, "StatefulSet")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["resources"]["limits"]["amd.com/gpu"] == 1 and "nvidia.com/gpu" not in c["resources"]["limits"]
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["tolerations"][0]["key"] == "gpu"
    assert spec["volumes"][0]["persistentVolumeClaim"] == {"claimName": "llama70b", "readOnly": True}
    assert "--model=/models/Llama-3.1-70B-Instruct" in c["args"]
    dep_args = one(pvc, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--draft-model=/models/Llama-3.2-1B-Instruct" in dep_args and "--num-stages=8" in dep_args

    cpu = render(*VALUE_SETS["cpu-demo"])
    c = one(cpu, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {}) and "--device=cpu" in c["args"]

    hub = render(*VALUE_SETS["hub"])
    assert not by_kind(hub, "NetworkPolicy") and not by_kind(hub, "PodDisruptionBudget")
    assert not by_kind(hub, "ServiceAccount") and one(hub, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    env = {e["name"]: e for e in one(hub, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}


@pytest.mark.parametrize("bad, message", [
    ("model.source=pvc", "model.pvc.claimName is required"),
    ("stages.replicas=0", "minimum"),
    ("coordinator.method=beam", "value must be one of"),
    ("stages.gpuz=1", "additional properties"),
])
def test_bad_values_are_refused(bad, message):
    out = helm("template", "rel", str(CHART), "--set", bad, check=False)
    assert out.returncode != 0 and message in out.stderr


def test_rendered_arguments_parse_with_our_cli(monkeypatch):
    """The chart's container args are accepted by `specpipe stage` / `coordinator` / `generate`: stage 2 of 4
    finds stage 3 by DNS, the last stage has no next hop, the coordinator expands its stage list."""
    import socket

    from coordinator.cli.main import build_parser
    from coordinator.config import CoordinatorConfig
    from services.config import StageConfig

    objs = render(namespace="prod")
    stage_args = one(objs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert stage_args[0] == "stage"
    import argparse
    for host, next_hop, depth in [
            ("rel-specpipe-stage-2", "rel-specpipe-stage-3.rel-specpipe-stage.prod.svc.cluster.local:50061", 4),
            ("rel-specpipe-stage-3", "", 4),
            ("rel-specpipe-stage-5", "", 6)]:            # added by kubectl scale: last until re-partitioned
        monkeypatch.setattr(socket, "gethostname", lambda h=host: h)
        p = argparse.ArgumentParser()
        StageConfig.add_arguments(p)
        cpu_args = ["--device=cpu" if x.startswith("--device=") else x for x in stage_args[1:]]   # no GPU here
        cfg = StageConfig.from_args(p.parse_args(cpu_args))
        assert cfg.next_hop == next_hop and cfg.num_stages == depth
    coord_args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    p = argparse.ArgumentParser()
    CoordinatorConfig.add_arguments(p)
    cfg = CoordinatorConfig.from_args(p.parse_args(coord_args[1:]))
    assert cfg.stages == tuple(f"rel-specpipe-stage-{i}.rel-specpipe-stage.prod.svc.cluster.local:50061"
                               for i in range(4))
    assert cfg.metrics_port == 9090 and cfg.method == "specpipe"
    env = {e["name"]: e for e in one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPECPIPE_K8S_STATEFULSET"]["value"] == "rel-specpipe-stage"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    monkeypatch.setenv("SPECPIPE_K8S_STATEFULSET", "rel-specpipe-stage")
    p = argparse.ArgumentParser()
    CoordinatorConfig.add_arguments(p)
    cfg = CoordinatorConfig.from_args(p.parse_args(coord_args[1:]))
    assert cfg.k8s_statefulset == "rel-specpipe-stage" and "{i}" in cfg.stage_template
    hook_args = one(objs, "Pod")["spec"]["containers"][0]["args"]
    assert build_parser().parse_args(hook_args).addr == "rel-specpipe-coordinator:50051"


def test_package(tmp_path):
    out = helm("package", str(CHART), "--destination", str(tmp_path))
    assert (tmp_path / "specpipe-0.1.0.tgz").exists(), out.stdout
