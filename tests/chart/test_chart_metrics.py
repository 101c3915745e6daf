"""The chart's metrics wiring: every pod serves Prometheus metrics on a port named `metrics` (container,
Service, `--metrics-port` argument our CLI parses), the ServiceMonitor selects the coordinator's and the
stages' Services, the stages' NetworkPolicies let the scrape in, and `metrics.enabled=false` removes it all.
Rendered with the pinned helm (tests/helpers/chart.py)."""
from __future__ import annotations

import argparse

import pytest

from helpers.chart import CHART, K8S_VERSION, by_kind, helm, one, render, selects

MONITORED = ["serviceMonitor.enabled=true", "stages.replicas=3", "stages.metricsPort=9400",
             "coordinator.metricsPort=9500",
             "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring"]


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def named_ports(ports: list[dict]) -> dict[str, int]:
    return {p["name"]: p.get("containerPort", p.get("port")) for p in ports}


def test_every_pod_serves_metrics_on_a_named_port_by_default():
    objs = render()
    stage, coord = container(one(objs, "StatefulSet")), container(one(objs, "Deployment"))
    assert named_ports(stage["ports"]) == {"grpc": 50061, "metrics": 9090}
    assert named_ports(coord["ports"]) == {"grpc": 50051, "http": 8000, "metrics": 9090, "health": 50070}
    assert "--metrics-port=9090" in stage["args"] and "--metrics-port=9090" in coord["args"]
    services = {s["metadata"]["name"]: s for s in by_kind(objs, "Service")}
    for name in ("rel-specpipe-stage", "rel-specpipe-coordinator-metrics"):
        metrics = [p for p in services[name]["spec"]["ports"] if p["name"] == "metrics"]
        assert metrics == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    # the public API's Service never carries metrics (a LoadBalancer would expose them)
    assert "metrics" not in {p["name"] for p in services["rel-specpipe-coordinator"]["spec"]["ports"]}
    for svc_type in ("LoadBalancer", "NodePort"):
        exposed = [s for s in by_kind(render(f"coordinator.service.type={svc_type}"), "Service")
                   if s["spec"].get("type") == svc_type]
        assert [s["metadata"]["name"] for s in exposed] == ["rel-specpipe-coordinator"]
        assert {p["name"] for p in exposed[0]["spec"]["ports"]} == {"grpc", "http"}
    assert services["rel-specpipe-coordinator-metrics"]["spec"]["type"] == "ClusterIP"
    assert services["rel-specpipe-coordinator-metrics"]["spec"]["selector"] == \
        services["rel-specpipe-coordinator"]["spec"]["selector"]


def test_rendered_stage_arguments_turn_metrics_on_in_our_cli(monkeypatch):
    import socket

    from services.config import StageConfig

    args = container(one(render(*MONITORED), "StatefulSet"))["args"]
    monkeypatch.setattr(socket, "gethostname", lambda: "rel-specpipe-stage-1")
    p = argparse.ArgumentParser()
    StageConfig.add_arguments(p)
    cpu_args = ["--device=cpu" if a.startswith("--device=") else a for a in args[1:]]     # no GPU here
    assert StageConfig.from_args(p.parse_args(cpu_args)).metrics_port == 9400


def test_service_monitor_scrapes_the_coordinator_and_every_stage():
    import kubernetes_validate

    objs = render(*MONITORED)
    for o in objs:
        if not o["apiVersion"].startswith("monitoring.coreos.com"):     # a CRD: no schema to validate with
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    monitor = one(objs, "ServiceMonitor")
    selected = [s for s in by_kind(objs, "Service") if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert sorted(s["metadata"]["name"] for s in selected) == ["rel-specpipe-coordinator-metrics", "rel-specpipe-stage"]
    [endpoint] = monitor["spec"]["endpoints"]
    ports = {s["metadata"]["name"]: {p["name"]: p["port"] for p in s["spec"]["ports"]} for s in selected}
    assert ports["rel-specpipe-stage"][endpoint["port"]] == 9400
    assert ports["rel-specpipe-coordinator-metrics"][endpoint["port"]] == 9500
    # the coordinator's metrics Service selects the coordinator pod, whose port of that name serves metrics
    coord = container(one(objs, "Deployment"))
    [metrics_svc] = [s for s in selected if s["metadata"]["name"] == "rel-specpipe-coordinator-metrics"]
    assert selects({"matchLabels": metrics_svc["spec"]["selector"]},
                   one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"])
    assert named_ports(coord["ports"])["metrics"] == 9500 and "--metrics-port=9500" in coord["args"]
    # the stage Service selects the stage pods, whose container port of that name is the one they serve on
    stage = container(one(objs, "StatefulSet"))
    assert named_ports(stage["ports"])["metrics"] == 9400 and "--metrics-port=9400" in stage["args"]


def test_network_policies_let_the_scrape_reach_every_stage():
    objs = render(*MONITORED)
    policies = [p for p in by_kind(objs, "NetworkPolicy") if p["metadata"]["name"] != "rel-specpipe-coordinator"]
    assert len(policies) == 4                              # stages 0..2 and the scaled ones
    for pol in policies:
        rules = pol["spec"]["ingress"]
        grpc = [r for r in rules if r["ports"] == [{"port": 50061, "protocol": "TCP"}]]
        scrape = [r for r in rules if r["ports"] == [{"port": 9400, "protocol": "TCP"}]]
        assert len(grpc) == 1 and grpc[0]["from"], pol["metadata"]["name"]      # gRPC stays restricted
        assert scrape == [{"ports": [{"port": 9400, "protocol": "TCP"}],
                           "from": [{"namespaceSelector": {"matchLabels": {
                               "kubernetes.io/metadata.name": "monitoring"}}}]}], pol["metadata"]["name"]
    # the coordinator's metrics port: from metricsFrom as well, and not part of its API rule
    [coord] = [p for p in by_kind(objs, "NetworkPolicy") if p["metadata"]["name"] == "rel-specpipe-coordinator"]
    scrape = [r for r in coord["spec"]["ingress"] if r["ports"] == [{"port": 9500, "protocol": "TCP"}]]
    assert scrape == [{"ports": [{"port": 9500, "protocol": "TCP"}],
                       "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}]
    assert not [r for r in coord["spec"]["ingress"] if r is not scrape[0]
                and {"port": 9500, "protocol": "TCP"} in r["ports"]]
    # without metricsFrom, any pod may scrape (a rule with ports and no `from`)
    for pol in by_kind(render("stages.replicas=2"), "NetworkPolicy"):
        assert {"ports": [{"port": 9090, "protocol": "TCP"}]} in pol["spec"]["ingress"]


def test_metrics_disabled_leaves_no_port_argument_or_rule():
    objs = render("metrics.enabled=false", "stages.replicas=2")
    for workload in (one(objs, "StatefulSet"), one(objs, "Deployment")):
        c = container(workload)
        assert "metrics" not in named_ports(c["ports"])
        assert not [a for a in c["args"] if a.startswith("--metrics-port")]
    for svc in by_kind(objs, "Service"):
        assert "metrics" not in {p["name"] for p in svc["spec"]["ports"]}
    for pol in by_kind(objs, "NetworkPolicy"):
        if pol["metadata"]["name"] == "rel-specpipe-coordinator":          # its API and its health port
            assert [r["ports"][0]["port"] for r in pol["spec"]["ingress"]] == [50051, 50070]
        else:
            assert len(pol["spec"]["ingress"]) == 1
    assert "rel-specpipe-coordinator-metrics" not in {s["metadata"]["name"] for s in by_kind(objs, "Service")}


@pytest.mark.parametrize("sets, message", [
    (["metrics.enabled=false", "serviceMonitor.enabled=true"], "serviceMonitor.enabled needs metrics.enabled"),
    (["stages.metricsPort=50061"], "stages.metricsPort must differ from stages.port"),
    (["stages.metricsPort=0"], "minimum"),
    (["metrics.port=9090"], "additional properties"),
    (["networkPolicy.metricsFrom=all"], "networkPolicy/metricsFrom"),
])
def test_bad_metrics_values_are_refused(sets, message):
    args = ["template", "rel", str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr
