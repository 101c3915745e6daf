"""`tls.certManager.perPod`: each stage pod mounts its own certificate, issued by the cert-manager csi-driver
(`csi.cert-manager.io` inline volume) for the pod's name, and the stages get `--tls-peer-template` so that
stage i takes Forward only from pod i-1. Checked here: the rendered volume attributes against the driver's
(cert-manager/csi-driver pkg/apis/v1alpha1/types.go and defaults.go), the arguments through our own CLI,
certificates issued the way the driver would (its ${POD_NAME} / ${POD_NAMESPACE} substitution, here by
`expand`) in real mutual-TLS handshakes and RPCs, and the render refusals. No cluster, no cert-manager, no
driver runs here."""
from __future__ import annotations

import argparse
import re
import socket

import grpc
import pytest

from helpers.certs import make_ca, make_leaf, write, write_ca
from helpers.chart import CHART, K8S_VERSION, by_kind, helm, one, render
from protos import stage_pb2, stage_pb2_grpc
from services.config import StageConfig
from common.tls import TLSFiles
from helpers.stage_servers import stage_servers

PER_POD = ["tls.enabled=true", "tls.certManager.enabled=true", "tls.certManager.issuerRef.name=specpipe-ca",
           "tls.certManager.perPod=true"]
STAGE = "rel-specpipe-stage"
COORDINATOR = "rel-specpipe-coordinator"
DRIVER = "csi.cert-manager.io"
# every volume attribute the driver reads (csi-driver pkg/apis/v1alpha1/types.go): a misspelt key is ignored by it
DRIVER_ATTRIBUTES = {f"{DRIVER}/{k}" for k in (
    "issuer-name", "issuer-kind", "issuer-group", "literal-subject", "common-name", "organizations",
    "organizationalunits", "countries", "provinces", "localities", "streetaddresses", "postalcodes", "serialnumber",
    "dns-names", "ip-sans", "uri-sans", "duration", "is-ca", "key-usages", "key-algorithm", "key-encoding",
    "key-size", "ca-file", "certificate-file", "privatekey-file", "fs-group", "renew-before", "reuse-private-key",
    "pkcs12-enable", "pkcs12-filename", "pkcs12-password")}


def stage_pod(objs: list[dict]) -> dict:
    return one(objs, "StatefulSet")["spec"]["template"]["spec"]


def tls_volume(objs: list[dict]) -> dict:
    [volume] = [v for v in stage_pod(objs)["volumes"] if v["name"] == "tls"]
    return volume


def flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def expand(value: str, pod: str, namespace: str) -> str:
    """What the driver makes of an attribute for a pod (Go os.Expand over its volume context)."""
    known = {"POD_NAME": pod, "POD_NAMESPACE": namespace}
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: known[m.group(1) or m.group(2)], value)


def issue(tmp, ca, attributes: dict[str, str], pod: str, namespace: str = "ml") -> TLSFiles:
    """The certificate the driver would ask the issuer for on behalf of `pod` (a CA issuer signs it as asked)."""
    usages = attributes[f"{DRIVER}/key-usages"].split(",")
    assert {"server auth", "client auth"} <= {u.strip() for u in usages}
    name = expand(attributes[f"{DRIVER}/common-name"], pod, namespace)
    dns = [n.strip() for n in expand(attributes[f"{DRIVER}/dns-names"], pod, namespace).split(",")]
    cert, key = write(tmp, pod, *make_leaf(ca, name, dns_names=dns, ips=()))
    return TLSFiles(cert, key, str(tmp / "ca.crt"))


def test_per_pod_manifests_are_valid_kubernetes():
    import kubernetes_validate
    for sets in (PER_POD, [*PER_POD, "coordinator.apiTlsSecret=api-cert", "coordinator.apiTokenSecret.name=t",
                           "stages.replicas=8", "networkPolicy.enabled=false"]):
        objs = render(*sets)
        kinds = {o["kind"] for o in objs}
        assert {"StatefulSet", "Deployment", "Certificate"} <= kinds, f"rendered only {sorted(kinds)}"
        checked = 0
        for o in objs:
            if o["apiVersion"].startswith(("monitoring.coreos.com", "cert-manager.io")):
                continue             # CRDs: no schema in kubernetes-validate
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
            checked += 1
        assert checked >= 3, "nothing was validated"


def test_each_stage_pod_mounts_a_certificate_for_its_own_name():
    objs = render(*PER_POD)
    csi = tls_volume(objs)["csi"]
    assert csi["driver"] == DRIVER and csi["readOnly"] is True
    attributes = csi["volumeAttributes"]
    assert set(attributes) <= DRIVER_ATTRIBUTES, set(attributes) - DRIVER_ATTRIBUTES
    assert all(isinstance(v, str) for v in attributes.values()), "volumeAttributes are strings"
    assert attributes == {
        f"{DRIVER}/issuer-name": "specpipe-ca", f"{DRIVER}/issuer-kind": "Issuer",
        f"{DRIVER}/issuer-group": "cert-manager.io",
        f"{DRIVER}/common-name": "${POD_NAME}",
        f"{DRIVER}/dns-names": f"${{POD_NAME}},${{POD_NAME}}.{STAGE},${{POD_NAME}}.{STAGE}.${{POD_NAMESPACE}}.svc,"
                               f"${{POD_NAME}}.{STAGE}.${{POD_NAMESPACE}}.svc.cluster.local",
        f"{DRIVER}/key-usages": "digital signature,key encipherment,server auth,client auth",
        f"{DRIVER}/key-algorithm": "ECDSA", f"{DRIVER}/key-size": "256",
        f"{DRIVER}/duration": "2160h", f"{DRIVER}/renew-before": "360h",
        f"{DRIVER}/certificate-file": "tls.crt", f"{DRIVER}/privatekey-file": "tls.key", f"{DRIVER}/ca-file": "ca.crt",
        f"{DRIVER}/fs-group": "65532",
    }
    container = stage_pod(objs)["containers"][0]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    files = {f"--tls-{k}={mount['mountPath']}/{attributes[f'{DRIVER}/{f}']}"
             for k, f in (("cert", "certificate-file"), ("key", "privatekey-file"), ("ca", "ca-file"))}
    assert files <= set(container["args"]), "the stage reads the files the driver writes"
    assert flag(container["args"], "tls-peer-template") == f"{STAGE}-{{index}}"
    assert flag(container["args"], "tls-coordinator-name") == COORDINATOR
    assert not any(a.startswith("--tls-peer-names") for a in container["args"])
    [cert] = by_kind(objs, "Certificate")
    assert cert["metadata"]["labels"]["app.kubernetes.io/component"] == "coordinator", "no shared stage Certificate"
    assert cert["spec"]["commonName"] == COORDINATOR
    coord = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert [v["secret"]["secretName"] for v in coord["volumes"] if v["name"] == "tls"] == [f"{COORDINATOR}-tls"]
    assert not any("csi" in v for v in coord["volumes"]), "the coordinator keeps its Certificate's Secret"


def test_the_key_is_written_for_the_stages_group():
    """fs-group: the stages' fsGroup (the driver writes the key readable by that group alone), else runAsGroup."""
    def group(*sets: str) -> str:
        return tls_volume(render(*PER_POD, *sets))["csi"]["volumeAttributes"][f"{DRIVER}/fs-group"]
    assert group("stages.podSecurityContext.fsGroup=1234") == "1234"
    assert group("podSecurityContext.fsGroup=null", "podSecurityContext.runAsGroup=777") == "777"


def test_the_template_names_the_pod_before_each_stage(monkeypatch, tmp_path):
    """The rendered stage arguments through our CLI, as pod NAME-k (--stage auto): Forward from pod k-1 alone,
    which is the common name the driver gives that pod; pod 0 only from the coordinator's Certificate name."""
    objs = render(*PER_POD, "stages.replicas=4", "stages.device=cpu")
    attributes = tls_volume(objs)["csi"]["volumeAttributes"]
    ca = make_ca("specpipe-ca")
    write_ca(tmp_path, "ca", ca)
    tls = issue(tmp_path, ca, attributes, f"{STAGE}-0")
    args = stage_pod(objs)["containers"][0]["args"][1:]
    files = {"--tls-cert": tls.cert, "--tls-key": tls.key, "--tls-ca": tls.ca}
    args = [f"{a.split('=')[0]}={files[a.split('=')[0]]}" if a.split("=")[0] in files else a for a in args]
    for k in range(4):
        monkeypatch.setattr(socket, "gethostname", lambda k=k: f"{STAGE}-{k}")
        p = argparse.ArgumentParser()
        StageConfig.add_arguments(p)
        cfg = StageConfig.from_args(p.parse_args(args))
        before = COORDINATOR if k == 0 else expand(attributes[f"{DRIVER}/common-name"], f"{STAGE}-{k - 1}", "ml")
        assert cfg.stage == k and cfg.peer_names.allowed("Forward") == {before}, k
        assert cfg.peer_names.allowed("Configure") == {COORDINATOR}


async def test_certificates_issued_as_the_driver_would_pass_only_for_their_own_pod(tiny_model, tmp_path):
    """Four stage servers, each with the certificate the driver would issue for pod k and the rendered flags. The
    coordinator dialing pod k by the chart's address completes the handshake; dialing pod k's server under pod
    k+1's name does not (no wildcard any more). Pod 2 takes Forward from pod 1's certificate alone."""
    objs = render(*PER_POD, "stages.replicas=4")
    attributes = tls_volume(objs)["csi"]["volumeAttributes"]
    args = stage_pod(objs)["containers"][0]["args"]
    ca = make_ca("specpipe-ca")
    write_ca(tmp_path, "ca", ca)
    pods = [issue(tmp_path, ca, attributes, f"{STAGE}-{k}") for k in range(4)]
    spec = [c for c in by_kind(objs, "Certificate") if c["spec"]["commonName"] == COORDINATOR][0]["spec"]
    coord = TLSFiles(*write(tmp_path, "coordinator", *make_leaf(ca, spec["commonName"], dns_names=spec["dnsNames"],
                                                                 ips=(), client_only=True)), str(tmp_path / "ca.crt"))
    flags = [dict(tls_cert=t.cert, tls_key=t.key, tls_ca=t.ca, tls_coordinator_name=flag(args, "tls-coordinator-name"),
                  tls_peer_template=flag(args, "tls-peer-template")) for t in pods]
    stages = flag(one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"], "stages")
    next_hop = flag(args, "next-hop")

    async def status(address: str, tls: TLSFiles, host: str, rpc: str = "Info") -> grpc.StatusCode:
        options = [("grpc.ssl_target_name_override", host)]
        async with grpc.aio.secure_channel(address, tls.channel_credentials(), options) as ch:
            stub = stage_pb2_grpc.StageStub(ch)
            try:
                if rpc == "Info":
                    await stub.Info(stage_pb2.InfoRequest(), timeout=10)
                else:
                    await stub.Forward(iter(()), timeout=10)
            except grpc.aio.AioRpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    async with stage_servers(str(tiny_model), 4, tls=flags) as (addrs, _):
        for k, address in enumerate(addrs):
            own = stages.replace("{i}", str(k)).rsplit(":", 1)[0]
            assert own == next_hop.replace("{next}", str(k)).rsplit(":", 1)[0], "stages and coordinator agree"
            assert await status(address, coord, own) == grpc.StatusCode.OK, own
            assert await status(address, coord, f"{STAGE}-{k}.{STAGE}") == grpc.StatusCode.OK
            other = stages.replace("{i}", str((k + 1) % 4)).rsplit(":", 1)[0]
            assert await status(address, coord, other) == grpc.StatusCode.UNAVAILABLE, f"pod {k} as {other}"
        host = stages.replace("{i}", "2").rsplit(":", 1)[0]
        seen = {who: await status(addrs[2], tls, host, "Forward")
                for who, tls in [("coordinator", coord), *((f"pod-{k}", pods[k]) for k in range(4))]}
        assert seen == {"coordinator": grpc.StatusCode.PERMISSION_DENIED, "pod-0": grpc.StatusCode.PERMISSION_DENIED,
                        "pod-1": grpc.StatusCode.OK, "pod-2": grpc.StatusCode.PERMISSION_DENIED,
                        "pod-3": grpc.StatusCode.PERMISSION_DENIED}
        assert await status(addrs[0], coord, stages.replace("{i}", "0").rsplit(":", 1)[0], "Forward") == \
            grpc.StatusCode.OK, "stage 0 takes Forward from the coordinator"


@pytest.mark.parametrize("sets, message", [
    (["tls.certManager.perPod=true"], "tls.certManager.perPod needs tls.enabled=true"),
    (["tls.enabled=true", "tls.certManager.perPod=true"], "tls.certManager.perPod needs tls.certManager.enabled=true"),
    (["tls.enabled=true", "tls.certManager.enabled=true", "tls.certManager.perPod=true"], "issuerRef.name"),
    ([*PER_POD, "tls.stageName=worker"], "leave tls.stageName empty"),
    ([*PER_POD, "tls.secretName=stage-tls"], "leave tls.secretName empty"),
    ([*PER_POD, f"tls.coordinatorName={STAGE}-7"], f"tls.coordinatorName {STAGE}-7 is the name of a stage pod"),
    ([*PER_POD, "podSecurityContext.fsGroup=null", "podSecurityContext.runAsGroup=null"], "needs the stages' group"),
    ([*PER_POD, "fullnameOverride=" + "a" * 57], "at most 64 characters"),
])
def test_inconsistent_values_are_refused_at_render(sets, message):
    args = ["template", "rel", str(CHART), "--namespace", "ml"]
    for s in sets:
        args += ["--set", s]
    out = helm(*args, check=False)
    assert out.returncode != 0, f"{sets} rendered"
    assert message in out.stderr, out.stderr


def test_without_per_pod_the_shared_stage_certificate_stays():
    objs = render(*PER_POD[:-1])
    assert {c["metadata"]["labels"]["app.kubernetes.io/component"] for c in by_kind(objs, "Certificate")} == \
        {"stage", "coordinator"}
    assert "secret" in tls_volume(objs)
    assert flag(stage_pod(objs)["containers"][0]["args"], "tls-peer-names") == STAGE
