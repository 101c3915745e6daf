"""TLS in the Helm chart: mutual TLS on the internal hops from two Secrets (optionally cert-manager Certificates),
one for the stages and one for the coordinator, whose names are the identities the stages check; TLS and a
bearer token on the public API, kubelet probes on a plaintext health-only port. The certificates' names are
checked with real gRPC handshakes: against the DNS names the chart gives the stages, and RPC by RPC against
the identity flags the chart gives the stages."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import stage_pb2, stage_pb2_grpc
from services.config import MiB
from common.grpc_server import Server
from services.server import SERVICE_NAME
from common.tls import TLSFiles
from helpers.stage_servers import stage_servers
from helpers.chart import CHART, K8S_VERSION, by_kind, helm, one, render
from helpers.certs import make_ca, write

TLS = ["tls.enabled=true", "tls.certManager.enabled=true", "tls.certManager.issuerRef.name=specpipe-ca",
       "coordinator.apiTlsSecret=api-cert", "coordinator.apiTokenSecret.name=api-token"]


def container(objs, kind: str) -> dict:
    return one(objs, kind)["spec"]["template"]["spec"]["containers"][0]


def certificate(objs, component: str) -> dict:
    found = [o for o in by_kind(objs, "Certificate")
             if o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    assert len(found) == 1, f"{len(found)} {component} Certificates"
    return found[0]


def secrets(objs, kind: str) -> set[str]:
    return {v["secret"]["secretName"] for v in one(objs, kind)["spec"]["template"]["spec"]["volumes"]
            if "secret" in v and v["name"] == "tls"}


def flag(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))


def test_tls_manifests_are_valid_kubernetes():
    import kubernetes_validate
    objs = render(*TLS)
    kinds = {o["kind"] for o in objs}
    assert {"StatefulSet", "Deployment", "Certificate", "Service"} <= kinds, f"rendered only {sorted(kinds)}"
    checked = 0
    for o in objs:
        if o["apiVersion"].startswith(("monitoring.coreos.com", "cert-manager.io")):
            continue             # CRDs: no schema in kubernetes-validate
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 4, "nothing was validated"


def test_tls_reaches_every_pod_and_probes_use_the_health_port():
    objs = render(*TLS)
    stage, coord = container(objs, "StatefulSet"), container(objs, "Deployment")
    files = ["--tls-cert=/etc/specpipe/tls/tls.crt", "--tls-key=/etc/specpipe/tls/tls.key",
             "--tls-ca=/etc/specpipe/tls/ca.crt"]
    for c in (stage, coord):
        assert all(f in c["args"] for f in files)
        assert "--health-port=50070" in c["args"]
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/etc/specpipe/tls"}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == 50070, f"{c['name']} {probe} must not probe the TLS port"
    assert secrets(objs, "StatefulSet") == {"rel-specpipe-tls"}
    assert secrets(objs, "Deployment") == {"rel-specpipe-coordinator-tls"}, "the coordinator has its own identity"
    assert flag(stage["args"], "tls-coordinator-name") == "rel-specpipe-coordinator"
    assert flag(stage["args"], "tls-peer-names") == "rel-specpipe-stage"
    assert not any(a.startswith(("--tls-coordinator-name", "--tls-peer-names")) for a in coord["args"])
    assert "--api-tls-cert=/etc/specpipe/api-tls/tls.crt" in coord["args"]
    env = {e["name"]: e for e in coord["env"]}
    assert env["SPECPIPE_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "api-token", "key": "token"}
    test_pod = one(objs, "Pod")["spec"]["containers"][0]
    assert "--tls-ca=/etc/specpipe/api-ca/ca.crt" in test_pod["args"] and "--insecure" not in test_pod["args"]
    test_env = {e["name"]: e for e in test_pod["env"]}
    assert test_env["SPECPIPE_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "api-token"
    [ca] = [v for v in one(objs, "Pod")["spec"]["volumes"] if "secret" in v]
    assert ca["secret"] == {"secretName": "api-cert", "items": [{"key": "ca.crt", "path": "ca.crt"}]}, \
        "the test pod mounts the CA alone, not the API's private key"
    for policy in by_kind(objs, "NetworkPolicy"):
        ports = [p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])]
        assert 50070 in ports, "the kubelet must reach the health port"


def test_without_tls_nothing_changes():
    objs = render()
    stage = container(objs, "StatefulSet")
    assert not any(a.startswith(("--tls-", "--health-port")) for a in stage["args"])
    assert stage["readinessProbe"]["grpc"]["port"] == 50061
    assert not by_kind(objs, "Certificate")
    coord = container(objs, "Deployment")
    assert "SPECPIPE_API_TOKEN" not in {e["name"] for e in coord["env"]}


def test_cert_manager_needs_an_issuer():
    out = helm("template", "rel", str(CHART), "--set", "tls.enabled=true", "--set", "tls.certManager.enabled=true",
               check=False)
    assert out.returncode != 0 and "issuerRef.name" in out.stderr


def test_the_certificates_carry_distinct_identities_the_stages_are_told():
    objs = render(*TLS)
    stage_cert, coord_cert = certificate(objs, "stage")["spec"], certificate(objs, "coordinator")["spec"]
    assert (stage_cert["secretName"], coord_cert["secretName"]) == ("rel-specpipe-tls", "rel-specpipe-coordinator-tls")
    assert stage_cert["commonName"] == "rel-specpipe-stage" and "rel-specpipe-stage" in stage_cert["dnsNames"]
    assert coord_cert["commonName"] == "rel-specpipe-coordinator"
    assert "rel-specpipe-coordinator" in coord_cert["dnsNames"]
    assert "server auth" not in coord_cert["usages"], "the coordinator serves no internal hop"
    assert not set(coord_cert["dnsNames"]) & set(stage_cert["dnsNames"])
    names = ["tls.coordinatorName=boss", "tls.stageName=worker", "tls.coordinatorSecretName=boss-tls",
             "tls.secretName=worker-tls"]
    objs = render(*TLS, *names)
    args = container(objs, "StatefulSet")["args"]
    assert (flag(args, "tls-coordinator-name"), flag(args, "tls-peer-names")) == ("boss", "worker")
    assert certificate(objs, "coordinator")["spec"]["commonName"] == "boss"
    assert certificate(objs, "stage")["spec"]["secretName"] == "worker-tls"
    assert (secrets(objs, "StatefulSet"), secrets(objs, "Deployment")) == ({"worker-tls"}, {"boss-tls"})
    own = render("tls.enabled=true")                                    # Secrets you made: no Certificates
    assert not by_kind(own, "Certificate") and secrets(own, "Deployment") == {"rel-specpipe-coordinator-tls"}
    out = helm("template", "rel", str(CHART), "--set", "tls.enabled=true", "--set", "tls.coordinatorName=x",
               "--set", "tls.stageName=x", check=False)
    assert out.returncode != 0 and "must differ" in out.stderr


def _leaf(ca, names: list[str], common_name: str = "", client_only: bool = False):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client_only else [ExtendedKeyUsageOID.SERVER_AUTH,
                                                                     ExtendedKeyUsageOID.CLIENT_AUTH]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name or names[0])])
    cert = (x509.CertificateBuilder().subject_name(subject)
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _issue(tmp_path, ca, spec: dict, name: str) -> tuple[str, str]:
    """A certificate as cert-manager would issue it from a Certificate's spec."""
    return write(tmp_path, name, *_leaf(ca, spec["dnsNames"], spec["commonName"],
                                         client_only="server auth" not in spec["usages"]))


async def test_the_certificate_names_pass_grpc_hostname_checks_for_the_chart_stage_addresses(tiny_model, tmp_path):
    """Issue the stages' certificate with exactly their Certificate's names; a client that dials a stage by the
    name the chart gives it (--stages / --next-hop) completes the mutual-TLS handshake; another name does not."""
    from cryptography.hazmat.primitives import serialization
    objs = render(*TLS)
    ca = make_ca("specpipe-ca")
    (tmp_path / "ca.crt").write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    cert, key = _issue(tmp_path, ca, certificate(objs, "stage")["spec"], "pod")
    tls = TLSFiles(cert, key, str(tmp_path / "ca.crt"))
    coord_args = container(objs, "Deployment")["args"]
    template = next(a for a in coord_args if a.startswith("--stages=")).split("=", 1)[1]
    async with stage_servers(str(tiny_model), 1, tls=dict(tls_cert=cert, tls_key=key, tls_ca=tls.ca)) as (addrs, _):
        port = addrs[0].rsplit(":", 1)[1]
        for host, ok in [(template.replace("{i}", "2").rsplit(":", 1)[0], True),
                         ("rel-specpipe-stage-2.rel-specpipe-stage", True),
                         ("rel-specpipe-coordinator", False),          # the coordinator's name is its own
                         ("rel-specpipe-stage-2.other-stage.ml.svc.cluster.local", False)]:
            options = [("grpc.ssl_target_name_override", host), ("grpc.default_authority", host)]
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", tls.channel_credentials(), options) as ch:
                call = stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=10)
                if ok:
                    assert (await call).num_layers_total == 4, host
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, host


async def test_the_chart_identities_decide_who_may_call_what(tiny_model, tmp_path):
    """Both certificates issued from the chart's Certificates, a stage started with the identity flags the chart
    gives it: the coordinator's certificate may Control and Configure, the stages' may Forward but not Control."""
    from cryptography.hazmat.primitives import serialization
    objs = render(*TLS)
    ca = make_ca("specpipe-ca")
    ca_file = str(tmp_path / "ca.crt")
    (tmp_path / "ca.crt").write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    stage = TLSFiles(*_issue(tmp_path, ca, certificate(objs, "stage")["spec"], "stage"), ca_file)
    coord = TLSFiles(*_issue(tmp_path, ca, certificate(objs, "coordinator")["spec"], "coordinator"), ca_file)
    args = container(objs, "StatefulSet")["args"]
    flags = dict(tls_cert=stage.cert, tls_key=stage.key, tls_ca=ca_file,
                 tls_coordinator_name=flag(args, "tls-coordinator-name"), tls_peer_names=flag(args, "tls-peer-names"))
    async with stage_servers(str(tiny_model), 1, tls=flags) as (addrs, _):
        for who, tls in [("coordinator", coord), ("stage", stage)]:
            options = [("grpc.ssl_target_name_override", "rel-specpipe-stage-0.rel-specpipe-stage")]
            async with grpc.aio.secure_channel(addrs[0], tls.channel_credentials(), options) as ch:
                stub = stage_pb2_grpc.StageStub(ch)
                info = await stub.Info(stage_pb2.InfoRequest(), timeout=10)
                assert (await stub.Forward(iter(()), timeout=10)).batches == 0, who
                if who == "coordinator":
                    assert (await stub.Control(iter(()), timeout=10)).messages == 0
                    again = await stub.Configure(stage_pb2.ConfigureRequest(
                        stage=0, num_stages=1, first_layer=0, last_layer=info.last_layer), timeout=30)
                    assert again.last_layer == info.last_layer
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Control(iter(()), timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "rel-specpipe-coordinator" in err.value.details() and "rel-specpipe-stage" in err.value.details()


async def test_health_port_serves_health_alone_in_plaintext(tmp_path):
    """The main port requires mutual TLS; the health port answers grpc.health.v1 in plaintext and nothing else."""
    from cryptography.hazmat.primitives import serialization
    ca = make_ca("specpipe-ca")
    (tmp_path / "ca.crt").write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    cert, key = write(tmp_path, "pod", *_leaf(ca, ["localhost"]))
    tls = TLSFiles(cert, key, str(tmp_path / "ca.crt"))
    server = Server([SERVICE_NAME], 4 * MiB)
    main = server.bind("127.0.0.1", 0, tls.server_credentials())
    health = server.bind_health("127.0.0.1", 0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health}") as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                               timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        async with grpc.aio.insecure_channel(f"127.0.0.1:{main}") as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        await server.health.enter_graceful_shutdown()             # what a draining pod reports
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health}") as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await server.stop(0)
