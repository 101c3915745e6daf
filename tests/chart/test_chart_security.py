"""The chart on a shared cluster: every pod it renders meets the *restricted* Pod Security Standard (checked
here rule by rule, the rules written out below), writes only to its emptyDirs and cache volume, mounts a
service-account token only where the coordinator watches its StatefulSet (RBAC: that watch and nothing
more, checked against the call coordinator/engine/k8s.py makes), the coordinator's NetworkPolicy, the per-workload
knobs (extraArgs ... securityContext), the coordinator's limits as flags our CLI parses, every TLS/token
combination (`helm test` can work, or the render says why not), and the hub cache.
Rendered with the pinned helm (tests/helpers/chart.py)."""
from __future__ import annotations

import argparse
import itertools

import pytest
import yaml

from helpers.chart import CHART, K8S_VERSION, VALUE_SETS, by_kind, helm, one, render, selects

# -- the restricted Pod Security Standard (https://kubernetes.io/docs/concepts/security/pod-security-standards/,
#    policy version "latest" as of Kubernetes 1.33): the baseline rules plus the restricted ones ----------------

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(pod: dict) -> list[str]:
    """What in a pod spec the restricted Pod Security Standard refuses (empty: the pod is admitted)."""
    bad: list[str] = []
    psc = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            bad.append(f"{field}: true")
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']}: {sorted(kinds - RESTRICTED_VOLUMES)} not allowed (hostPath: not even "
                       f"by baseline)")
    for s in psc.get("sysctls") or []:
        if s["name"] not in SAFE_SYSCTLS:
            bad.append(f"sysctl {s['name']}")
    if psc.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    if ((psc.get("appArmorProfile") or {}).get("type")) == "Unconfined":
        bad.append("pod appArmorProfile Unconfined")
    if ((psc.get("seLinuxOptions") or {}).get("type", "")) not in SELINUX_TYPES:
        bad.append("pod seLinuxOptions type")
    if (psc.get("seLinuxOptions") or {}).get("user") or (psc.get("seLinuxOptions") or {}).get("role"):
        bad.append("pod seLinuxOptions user/role")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        bad.append(f"pod seccompProfile {pod_seccomp}")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        bad.append("pod hostProcess")
    containers = [*(pod.get("initContainers") or []), *pod["containers"], *(pod.get("ephemeralContainers") or [])]
    for c in containers:
        sc, name = c.get("securityContext") or {}, c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad.append(f"{name}: hostProcess")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            bad.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount")
        if ((sc.get("appArmorProfile") or {}).get("type")) == "Unconfined":
            bad.append(f"{name}: appArmorProfile Unconfined")
        if ((sc.get("seLinuxOptions") or {}).get("type", "")) not in SELINUX_TYPES:
            bad.append(f"{name}: seLinuxOptions type")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation must be false")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            bad.append(f"{name}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost (pod or container), not {seccomp}")
    return bad


def pod_specs(objs: list[dict]) -> dict[str, dict]:
    """Every pod spec the release creates: the workloads' templates and the `helm test` pod."""
    specs = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs
             if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet")}
    specs.update({o["metadata"]["name"]: o["spec"] for o in by_kind(objs, "Pod")})
    return specs


def render_values(tmp_path, values: dict, *sets: str, check: bool = True):
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    args = ["template", "rel", str(CHART), "--namespace", "ml", "-f", str(f)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args, check=check)
    return [d for d in yaml.safe_load_all(out.stdout) if d] if check else out


def refused(*sets: str) -> str:
    args = ["template", "rel", str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args, check=False)
    assert out.returncode != 0, f"{sets} rendered"
    return out.stderr


TLS_ALL = ["tls.enabled=true", "tls.certManager.enabled=true", "tls.certManager.issuerRef.name=ca",
           "coordinator.apiTlsSecret=api-cert", "coordinator.apiTokenSecret.name=api-token"]
ADMITTED = {name: sets for name, sets in VALUE_SETS.items()} | {
    "tls": TLS_ALL,
    "metrics-off": ["metrics.enabled=false", "networkPolicy.enabled=false"],
    "no-follow": ["coordinator.followScale=false", "coordinator.httpPort=0"],
    "hub-pvc-caches": ["model.source=hub", "model.hub.id=org/model", "model.hub.cache.claimName=hf-cache",
                       "model.hub.cache.perStage.size=100Gi"],
    "token-plaintext": ["coordinator.apiTokenSecret.name=t", "coordinator.allowTokenWithoutTls=true"],
}


@pytest.mark.parametrize("name", list(ADMITTED))
def test_every_pod_meets_the_restricted_pod_security_standard(name):
    import kubernetes_validate
    objs = render(*ADMITTED[name])
    for o in objs:
        if not o["apiVersion"].startswith(("monitoring.coreos.com", "cert-manager.io")):   # CRDs: no schema
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    specs = pod_specs(objs)
    assert set(specs) == {"rel-specpipe-coordinator", "rel-specpipe-stage", "rel-specpipe-test-generate"}
    for pod_name, spec in specs.items():
        assert restricted_violations(spec) == [], pod_name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, f"{pod_name}/{c['name']}"
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
        psc = spec["securityContext"]
        assert (psc["runAsUser"], psc["runAsGroup"], psc["fsGroup"]) == (65532, 65532, 65532), \
            "the image's USER 65532:65532 (Dockerfile, Dockerfile.cpu)"
        assert psc["runAsNonRoot"] is True and psc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_image_user_is_the_one_the_pods_run_as():
    from pathlib import Path
    root = Path(CHART).parent.parent
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        text = (root / dockerfile).read_text()
        assert "USER 65532:65532" in text and "HOME=/tmp" in text, dockerfile


def test_the_checks_catch_what_restricted_refuses():
    """The rule checks above are not vacuous: the chart's own escape hatches trip them."""
    host = pod_specs(render("model.source=hostPath", "model.hostPath.path=/data/llama"))
    for name in ("rel-specpipe-coordinator", "rel-specpipe-stage"):
        [problem] = restricted_violations(host[name])
        assert "volume model" in problem and "hostPath" in problem
    assert restricted_violations(host["rel-specpipe-test-generate"]) == []
    cases = {
        "stages.securityContext.privileged=true": "privileged",
        "stages.securityContext.allowPrivilegeEscalation=true": "allowPrivilegeEscalation",
        "stages.securityContext.capabilities.add[0]=SYS_ADMIN": "SYS_ADMIN",
        "stages.podSecurityContext.seccompProfile.type=Unconfined": "seccompProfile",
        "stages.podSecurityContext.runAsUser=0": "runAsUser 0",
        "stages.securityContext.runAsNonRoot=false": "runAsNonRoot",
    }
    for setting, word in cases.items():
        stage = pod_specs(render(setting))["rel-specpipe-stage"]
        assert any(word in p for p in restricted_violations(stage)), setting
        assert restricted_violations(pod_specs(render(setting))["rel-specpipe-coordinator"]) == [], \
            "a stage override stays on the stages"
    ok = pod_specs(render("coordinator.securityContext.capabilities.add[0]=NET_BIND_SERVICE"))
    assert restricted_violations(ok["rel-specpipe-coordinator"]) == []
    assert ok["rel-specpipe-coordinator"]["containers"][0]["securityContext"]["capabilities"] == {
        "drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}


def test_writes_go_to_writable_volumes_only():
    """Read-only root filesystem: HOME, /tmp, SPECPIPE_CACHE and HF_HOME lie on emptyDirs or the cache volume."""
    for sets in ([], ["model.source=hub", "model.hub.id=org/model", "model.hub.cache.perStage.size=50Gi"],
                 ["model.source=pvc", "model.pvc.claimName=models"]):
        objs = render(*sets)
        sts = one(objs, "StatefulSet")
        templates = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
        for name, spec in pod_specs(objs).items():
            volumes = {v["name"]: v for v in spec["volumes"]}
            c = spec["containers"][0]
            writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")
                        and (m["name"] in templates or "emptyDir" in volumes.get(m["name"], {})
                             or "persistentVolumeClaim" in volumes.get(m["name"], {}))]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["HOME"] == "/tmp" and "/tmp" in writable, name
            paths = [env[k] for k in ("SPECPIPE_CACHE", "HF_HOME") if k in env]
            if name != "rel-specpipe-test-generate":
                assert len(paths) == 2
            for path in paths:
                assert any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable), (name, path)
            for m in c["volumeMounts"]:                   # the model and the certificates stay read-only
                if m["name"] in ("model", "tls", "api-tls", "api-ca"):
                    assert m["readOnly"] is True, (name, m)


# -- the service-account token and RBAC ------------------------------------------------------------------

def test_the_token_is_mounted_only_where_the_coordinator_watches_its_statefulset():
    objs = render()
    specs = pod_specs(objs)
    assert specs["rel-specpipe-stage"]["automountServiceAccountToken"] is False
    assert specs["rel-specpipe-test-generate"]["automountServiceAccountToken"] is False
    assert specs["rel-specpipe-coordinator"]["automountServiceAccountToken"] is True
    assert one(objs, "ServiceAccount")["automountServiceAccountToken"] is False, "opt-in per pod"
    off = render("coordinator.followScale=false")
    assert pod_specs(off)["rel-specpipe-coordinator"]["automountServiceAccountToken"] is False
    assert not by_kind(off, "Role") and not by_kind(off, "RoleBinding"), "nothing to grant without the watch"
    env = {e["name"] for e in one(off, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "SPECPIPE_K8S_STATEFULSET" not in env
    own = render("serviceAccount.create=false", "serviceAccount.name=mine")
    assert pod_specs(own)["rel-specpipe-coordinator"]["serviceAccountName"] == "mine"
    assert pod_specs(own)["rel-specpipe-coordinator"]["automountServiceAccountToken"] is True
    assert not by_kind(own, "ServiceAccount") and not by_kind(own, "Role")
    for name in ("rel-specpipe-stage", "rel-specpipe-test-generate"):      # never the coordinator's account
        assert "serviceAccountName" not in specs[name]


def test_rbac_grants_exactly_the_watch_the_code_makes():
    """The Role allows list/watch of the stage StatefulSet by name; coordinator/engine/k8s.py watches it with the
    field selector metadata.name=<that name>, which is how RBAC authorizes a watch by resourceNames."""
    from kubernetes.client.exceptions import ApiException

    from coordinator.engine.k8s import StatefulSetWatcher

    objs = render()
    [rule] = one(objs, "Role")["rules"]
    assert rule == {"apiGroups": ["apps"], "resources": ["statefulsets"], "resourceNames": ["rel-specpipe-stage"],
                    "verbs": ["list", "watch"]}
    binding = one(objs, "RoleBinding")
    assert binding["roleRef"]["name"] == one(objs, "Role")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-specpipe", "namespace": "ml"}]
    env = {e["name"]: e for e in one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    name = env["SPECPIPE_K8S_STATEFULSET"]["value"]
    assert rule["resourceNames"] == [name]

    calls = []

    class Apps:                     # what the watcher asks the API server for
        def list_namespaced_stateful_set(self, namespace, **kwargs):
            calls.append((namespace, kwargs))
            watcher._stop.set()
            raise ApiException(status=403, reason="recorded")

    watcher = StatefulSetWatcher(Apps(), "ml", name, on_depth=lambda n: None, read_timeout_s=0.1)
    watcher._run()
    [(namespace, kwargs)] = calls
    assert namespace == "ml" and kwargs["watch"] is True
    assert kwargs["field_selector"] == f"metadata.name={name}", "resourceNames authorize only a watch by name"


# -- NetworkPolicy of the coordinator --------------------------------------------------------------------

def coordinator_policy(objs):
    [pol] = [p for p in by_kind(objs, "NetworkPolicy") if p["metadata"]["name"] == "rel-specpipe-coordinator"]
    return pol


RELEASE_NS = {"kubernetes.io/metadata.name": "ml"}


def admits(policy: dict, port: int, labels: dict | None = None, namespace: dict = RELEASE_NS) -> bool:
    """Whether an ingress rule of `policy` lets a peer reach `port` of the pods it selects: a pod with
    `labels` in a namespace with labels `namespace`, or (labels None) a client outside the cluster."""
    for rule in policy["spec"]["ingress"]:
        if port not in [p["port"] for p in rule.get("ports", [])]:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            if labels is None:
                continue                                   # only ipBlock peers admit outside traffic
            ns_ok = selects(peer["namespaceSelector"], namespace) if "namespaceSelector" in peer else \
                namespace == RELEASE_NS                    # a podSelector alone: the policy's namespace
            pod_ok = selects(peer["podSelector"], labels) if "podSelector" in peer else True
            if ns_ok and pod_ok:
                return True
    return False


def test_coordinator_network_policy():
    objs = render()
    pol = coordinator_policy(objs)
    coord_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(pol["spec"]["podSelector"], coord_labels) and pol["spec"]["policyTypes"] == ["Ingress"]
    test_labels = one(objs, "Pod")["metadata"]["labels"]
    ports = {p["port"] for r in pol["spec"]["ingress"] for p in r["ports"]}
    assert ports == {50051, 8000, 9090, 50070}, "nothing but the API, metrics and the health port"
    # default: the API from anywhere (a LoadBalancer's clients, an ingress controller anywhere)
    for port in (50051, 8000):
        assert admits(pol, port) and admits(pol, port, {"app": "x"}, {"team": "other"})
    assert admits(pol, 50070), "the kubelet's probes"
    assert not admits(pol, 50061), "no other port"

    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    ingress_ns = {"kubernetes.io/metadata.name": "ingress"}
    objs = render("networkPolicy.apiFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=ingress",
                  "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
                  "coordinator.httpPort=8080")
    pol = coordinator_policy(objs)
    for port in (50051, 8080):
        assert admits(pol, port, {"app": "nginx"}, ingress_ns)
        assert not admits(pol, port) and not admits(pol, port, {"app": "x"}, {"team": "other"})
        assert admits(pol, port, test_labels), "helm test reaches the API under any apiFrom"
        assert not admits(pol, port, {"app": "x"}), "other pods of the namespace do not"
    assert admits(pol, 9090, {"app": "prometheus"}, monitoring) and not admits(pol, 9090, {"app": "x"}, ingress_ns)
    assert not admits(pol, 9090, test_labels) and not admits(pol, 50051, {"app": "p"}, monitoring)
    assert admits(pol, 50070)
    off = coordinator_policy(render("metrics.enabled=false"))
    assert {p["port"] for r in off["spec"]["ingress"] for p in r["ports"]} == {50051, 8000, 50070}
    assert not by_kind(render("networkPolicy.enabled=false"), "NetworkPolicy")


# -- the knobs of both workloads -------------------------------------------------------------------------

KNOBS = {
    "extraArgs": None,                      # per workload below
    "extraEnv": [{"name": "NCCL_DEBUG", "value": "INFO"}],
    "extraVolumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
    "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    "podLabels": {"team": "ml", "app.kubernetes.io/component": "hijack"},
    "podAnnotations": {"example.com/owner": "ml"},
    "runtimeClassName": "nvidia",
    "priorityClassName": "gpu-high",
    "schedulerName": "volcano",
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                   "whenUnsatisfiable": "DoNotSchedule"}],
    "podSecurityContext": {"supplementalGroups": [44]},
    "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}},
}


def test_workload_knobs_reach_both_pods(tmp_path, monkeypatch):
    import kubernetes_validate
    import socket

    from coordinator.config import CoordinatorConfig
    from services.config import StageConfig

    values = {w: {k: v for k, v in KNOBS.items() if v is not None} for w in ("coordinator", "stages")}
    values["coordinator"]["extraArgs"] = ["--probe-timeout-s=20", "--topk=4"]
    values["stages"]["extraArgs"] = ["--threads=8"]           # repeats a chart flag: the last one wins
    objs = render_values(tmp_path, values)
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    for kind, component in (("Deployment", "coordinator"), ("StatefulSet", "stage")):
        w = one(objs, kind)
        meta, spec = w["spec"]["template"]["metadata"], w["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert meta["labels"]["team"] == "ml"
        assert meta["labels"]["app.kubernetes.io/component"] == component, "the chart's labels win"
        assert selects(w["spec"]["selector"], meta["labels"])
        assert meta["annotations"] == {"example.com/owner": "ml"}
        assert (spec["runtimeClassName"], spec["priorityClassName"], spec["schedulerName"]) == \
            ("nvidia", "gpu-high", "volcano")
        [spread] = spec["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert selects(spread["labelSelector"], meta["labels"]), "a constraint without selector spreads its own pods"
        assert {"name": "NCCL_DEBUG", "value": "INFO"} in c["env"] and "HF_HOME" in {e["name"] for e in c["env"]}
        assert {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}} in spec["volumes"]
        assert {"name": "scratch", "mountPath": "/scratch"} in c["volumeMounts"]
        assert spec["securityContext"]["supplementalGroups"] == [44]
        assert spec["securityContext"]["runAsUser"] == 65532, "an override merges, it does not replace"
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}
        assert restricted_violations(spec) == []
    coord_args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    p = argparse.ArgumentParser()
    CoordinatorConfig.add_arguments(p)
    cfg = CoordinatorConfig.from_args(p.parse_args(coord_args[1:]))
    assert cfg.probe_timeout_s == 20 and cfg.topk == 4
    stage_args = one(objs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert stage_args[-1] == "--threads=8"
    monkeypatch.setattr(socket, "gethostname", lambda: "rel-specpipe-stage-1")
    p = argparse.ArgumentParser()
    StageConfig.add_arguments(p)
    cpu_args = ["--device=cpu" if a.startswith("--device=") else a for a in stage_args[1:]]
    assert StageConfig.from_args(p.parse_args(cpu_args)).threads == 8
    # the schema knows every knob, and nothing else
    for w in ("coordinator", "stages"):
        out = helm("template", "rel", str(CHART), "--set", f"{w}.extraArgz[0]=x", check=False)
        assert out.returncode != 0 and "additional properties" in out.stderr
    assert "pattern" in refused("stages.extraArgs[0]=threads")        # a flag, not a positional


def test_empty_knobs_render_nothing():
    spec = one(render(), "StatefulSet")["spec"]["template"]["spec"]
    for field in ("runtimeClassName", "priorityClassName", "schedulerName", "topologySpreadConstraints",
                  "nodeSelector", "tolerations", "affinity"):
        assert field not in spec
    assert one(render(), "StatefulSet")["spec"]["template"]["metadata"].get("annotations") is None


# -- the coordinator's settings as flags ---------------------------------------------------------------

SETTINGS = {"prefillChunk": ("prefill_chunk", 128), "apiMaxMessageMb": ("api_max_message_mb", 16),
            "apiMaxConcurrentRpcs": ("api_max_concurrent_rpcs", 64), "httpTimeoutSeconds": ("http_timeout_s", 12.5),
            "maxPerClient": ("max_per_client", 8), "batchTimeoutSeconds": ("batch_timeout_s", 45),
            "drainTimeoutSeconds": ("drain_timeout_s", 90), "draftDtype": ("draft_dtype", "float16"),
            "width": ("width", 16)}


def _coordinator_config(objs, files=None):
    """The coordinator's config from its rendered args; the files they name (certificates) are made under
    `files` (a tmp_path), since the config checks they exist."""
    from coordinator.config import CoordinatorConfig
    args = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    if files is not None:
        args = [a.replace("=/etc/specpipe/", f"={files}/etc/specpipe/") for a in args]
        for a in args:
            if f"={files}/" in a:
                path = files / a.split(f"={files}/", 1)[1]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
    p = argparse.ArgumentParser()
    CoordinatorConfig.add_arguments(p)
    return CoordinatorConfig.from_args(p.parse_args(args[1:]))


def test_coordinator_settings_are_flags_our_cli_parses(tmp_path):
    from coordinator.config import CoordinatorConfig
    cfg = _coordinator_config(render())
    for key, (field, _) in SETTINGS.items():
        assert getattr(cfg, field) == getattr(CoordinatorConfig, field), f"{key}: the chart's default is the code's"
    cfg = _coordinator_config(render_values(tmp_path, {"coordinator": {k: v for k, (_, v) in SETTINGS.items()}}))
    for key, (field, value) in SETTINGS.items():
        assert getattr(cfg, field) == value, key
    assert cfg.health_port == 50070 and _coordinator_config(render(*TLS_ALL), tmp_path).health_port == 50070


def test_the_chart_tells_the_cost_rule_its_stages_are_on_their_own_gpus(tmp_path):
    """The stage pods compute apart from the coordinator's draft (not the code's default, which suits one
    machine); `shared` is passed through for a deployment that puts both on one accelerator."""
    assert _coordinator_config(render()).stage_hardware == "apart"
    shared = render_values(tmp_path, {"coordinator": {"stageHardware": "shared"}})
    assert _coordinator_config(shared).stage_hardware == "shared"


@pytest.mark.parametrize("bad, message", [
    ("coordinator.prefillChunk=0", "minimum"),
    ("coordinator.apiMaxMessageMb=0", "minimum"),
    ("coordinator.httpTimeoutSeconds=0", "exclusiveMinimum"),
    ("coordinator.maxPerClient=-1", "minimum"),
    ("coordinator.draftDtype=int8", "value must be one of"),
    ("coordinator.stageHardware=gpu", "value must be one of"),
    ("coordinator.width=-1", "minimum"),
    ("coordinator.draft=model", "coordinator.draft=model needs coordinator.draftModelPath"),
    ("coordinator.httpPort=50051", "the coordinator's ports must differ"),
    ("coordinator.metricsPort=50070", "the coordinator's ports must differ"),
    ("podDisruptionBudget.maxUnavailable=half", "podDisruptionBudget/maxUnavailable"),
])
def test_bad_settings_are_refused(bad, message):
    assert message in refused(bad)


def test_draft_model_follows_the_model_source():
    cfg = _coordinator_config(render("model.source=pvc", "model.pvc.claimName=m", "coordinator.draft=model",
                                     "coordinator.draftModelPath=Llama-3.2-1B"))
    assert cfg.draft_model == "/models/Llama-3.2-1B"
    cfg = _coordinator_config(render("model.source=hub", "model.hub.id=meta-llama/Llama-3.1-8B-Instruct",
                                     "coordinator.draft=model", "coordinator.draftModelPath=meta-llama/Llama-3.2-1B"))
    assert cfg.draft_model == "meta-llama/Llama-3.2-1B", "no model volume with hub: a hub id"


# -- TLS and token: every combination works under `helm test`, or is refused at render --------------------

COMBOS = list(itertools.product([False, True], [False, True], [False, True], [False, True], [False, True]))


@pytest.mark.parametrize("api_tls, token, allow_plain, mtls, own_ca", COMBOS)
def test_helm_test_works_under_every_tls_and_token_combination(api_tls, token, allow_plain, mtls, own_ca,
                                                                monkeypatch, tmp_path):
    from coordinator.cli.main import build_parser
    from client.client import _metadata

    sets = [f"coordinator.allowTokenWithoutTls={str(allow_plain).lower()}", f"tls.enabled={str(mtls).lower()}"]
    sets += ["coordinator.apiTlsSecret=api-cert"] if api_tls else []
    sets += ["coordinator.apiTokenSecret.name=api-token"] if token else []
    sets += ["tests.caSecret.name=my-ca", "tests.caSecret.key=root.pem"] if own_ca else []
    plaintext_token = token and not api_tls and not allow_plain
    if plaintext_token or (own_ca and not api_tls):
        err = refused(*sets)                      # one of the reasons, each with what to change
        if plaintext_token:
            assert "coordinator.apiTokenSecret needs coordinator.apiTlsSecret" in err
            assert "allowTokenWithoutTls" in err and "plaintext" in err
        else:
            assert "tests.caSecret" in err and "needs coordinator.apiTlsSecret" in err
        return
    objs = render(*sets)
    pod = one(objs, "Pod")["spec"]
    c = pod["containers"][0]
    args = build_parser().parse_args(c["args"])
    env = {e["name"]: e for e in c["env"]}
    coord = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    coord_env = {e["name"]: e for e in coord["env"]}
    # the test pod sends the token iff the coordinator requires it, from the same Secret
    assert ("SPECPIPE_API_TOKEN" in env) == ("SPECPIPE_API_TOKEN" in coord_env) == token
    if token:
        assert env["SPECPIPE_API_TOKEN"]["valueFrom"] == coord_env["SPECPIPE_API_TOKEN"]["valueFrom"]
    # it speaks TLS iff the API does, trusting a CA file its volumes provide
    assert bool(args.tls_ca) == api_tls == ("--api-tls-cert=/etc/specpipe/api-tls/tls.crt" in coord["args"])
    if api_tls:
        mount = next(m for m in c["volumeMounts"] if args.tls_ca.startswith(m["mountPath"] + "/"))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == ("my-ca" if own_ca else "api-cert")
        assert volume["secret"]["items"] == [{"key": "root.pem" if own_ca else "ca.crt",
                                              "path": args.tls_ca.rsplit("/", 1)[1]}]
    # what `specpipe generate` decides before it dials: it would refuse a token in plaintext (the known bug)
    metadata = _metadata("secret" if token else None, args.addr, args.tls_ca or None, args.insecure)
    assert (metadata is not None) == token
    assert args.insecure == (token and not api_tls), "--insecure only where the token must go in plaintext"
    # the coordinator's side parses, and serves its probes on the plaintext health port either way
    monkeypatch.setenv("SPECPIPE_API_TOKEN", "secret" if token else "")
    cfg = _coordinator_config(objs, tmp_path)
    assert bool(cfg.api_token) == token and bool(cfg.api_tls_cert) == api_tls and cfg.health_port == 50070
    assert restricted_violations(pod) == []


# -- the model from the hub --------------------------------------------------------------------------------

def test_hub_needs_an_id():
    err = refused("model.source=hub")
    assert "model.hub.id is required with model.source=hub" in err


def test_hub_cache_volumes(tmp_path):
    import kubernetes_validate

    hub = ["model.source=hub", "model.hub.id=meta-llama/Llama-3.1-70B-Instruct"]
    objs = render(*hub)
    for name, spec in pod_specs(objs).items():
        if name == "rel-specpipe-test-generate":
            continue
        cache = next(v for v in spec["volumes"] if v["name"] == "cache")
        assert cache == {"name": "cache", "emptyDir": {"sizeLimit": "200Gi"}}
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["HF_HOME"] == "/cache/hf" and "--model=meta-llama/Llama-3.1-70B-Instruct" in \
            spec["containers"][0]["args"]
    # one shared claim for every pod: a restart downloads nothing
    objs = render(*hub, "model.hub.cache.claimName=hf-cache")
    for name in ("rel-specpipe-coordinator", "rel-specpipe-stage"):
        cache = next(v for v in pod_specs(objs)[name]["volumes"] if v["name"] == "cache")
        assert cache == {"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}
    # or a claim per stage (each keeps only its own layers' files); the coordinator keeps the shared one
    objs = render(*hub, "model.hub.cache.claimName=hf-cache", "model.hub.cache.perStage.size=100Gi",
                  "model.hub.cache.perStage.storageClassName=fast")
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    sts = one(objs, "StatefulSet")
    [template] = sts["spec"]["volumeClaimTemplates"]
    assert template["metadata"]["name"] == "cache" and template["spec"]["storageClassName"] == "fast"
    assert template["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "cache" not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert {"name": "cache", "mountPath": "/cache"} in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    coord = pod_specs(objs)["rel-specpipe-coordinator"]
    assert next(v for v in coord["volumes"] if v["name"] == "cache")["persistentVolumeClaim"] == {"claimName": "hf-cache"}
    assert "volumeClaimTemplates" not in one(render(*hub), "StatefulSet")["spec"]
    assert "additional properties" in refused("model.hub.cacheSizeLimit=1Gi")


def test_lint_strict_with_the_shared_cluster_values(tmp_path):
    values = {"networkPolicy": {"apiFrom": [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]},
              "model": {"source": "hub", "hub": {"id": "org/model", "cache": {"perStage": {"size": "10Gi"}}}},
              "coordinator": {"apiTlsSecret": "api", "apiTokenSecret": {"name": "tok", "key": "token"}}}
    f = tmp_path / "v.yaml"
    f.write_text(yaml.safe_dump(values))
    out = helm("lint", "--strict", str(CHART), "-f", str(f))
    assert "0 chart(s) failed" in out.stdout


def test_service_names_fit_a_dns_label_for_a_long_release():
    objs = render("fullnameOverride=" + "r" * 60)
    names = [s["metadata"]["name"] for s in by_kind(objs, "Service")]
    assert len(names) == 3 and len(set(names)) == 3
    assert all(len(n) <= 63 and not n.endswith("-") for n in names), names
