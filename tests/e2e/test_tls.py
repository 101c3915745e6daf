"""Security: mutual TLS on the internal hops (stages refuse peers without a certificate from their CA),
TLS and a bearer token on the public API, and nothing decoded from the network by pickle or eval.
Certificates are made in the test with `cryptography`; the stage and coordinator certificates carry the
default identities (common/tls.py), which test_tls_identity.py checks RPC by RPC."""
from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.frontends.server import start
from protos import generation_pb2, generation_pb2_grpc, stage_pb2, stage_pb2_grpc
from helpers.reference import hf_greedy
from common.tls import TLSFiles, open_channel
from helpers.stage_servers import stage_servers

pytestmark = pytest.mark.grpc

ROOT = Path(__file__).resolve().parent.parent


async def stage_info(address: str, tls: TLSFiles | None) -> stage_pb2.StageInfo:
    async with open_channel(address, tls) as ch:
        return await stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=5)


async def test_mutual_tls_pipeline_serves_and_stages_refuse_other_peers(tiny_model, tiny_hf, pki):
    cert, key = pki["stage"]
    stage_tls = dict(tls_cert=cert, tls_key=key, tls_ca=pki["ca"])
    async with stage_servers(str(tiny_model), 2, tls=stage_tls) as (addrs, _):
        ccert, ckey = pki["coordinator"]
        server, coord = await start(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), port=0,
                                                      method="specpipe", tls_cert=ccert, tls_key=ckey,
                                                      tls_ca=pki["ca"]))
        try:
            out = []
            from coordinator.frontends.service import GenerateInput
            async for chunk in coord.generate(GenerateInput(prompt_token_ids=[3, 4, 5], max_new_tokens=8,
                                                            ignore_eos=True)):
                out += chunk.token_ids
            assert out == hf_greedy(tiny_hf, [3, 4, 5], 8), "stage 0 -> stage 1 and both hops to the coordinator"
            ok = await stage_info(addrs[1], TLSFiles(ccert, ckey, pki["ca"]))
            assert ok.stage == 1
            icert, ikey = pki["intruder"]
            for name, tls in [("plaintext", None), ("TLS without a client certificate", TLSFiles(ca=pki["ca"])),
                              ("a certificate from another CA", TLSFiles(icert, ikey, pki["ca"]))]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stage_info(addrs[0], tls)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
        finally:
            await server.stop(0)
            await coord.close()


async def test_api_over_tls_requires_the_bearer_token(tiny_model, tiny_hf, pki):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    async with stage_servers(str(tiny_model), 1) as (addrs, _):
        cert, key = pki["coordinator"]
        server, coord = await start(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), port=0,
                                                      method="pp", api_tls_cert=cert, api_tls_key=key,
                                                      api_token="s3cret"))
        addr = f"127.0.0.1:{server.port}"
        req = generation_pb2.GenerateRequest(prompt_token_ids=[7, 8], max_new_tokens=4, ignore_eos=True)
        try:
            async with open_channel(addr, TLSFiles(ca=pki["ca"])) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                for metadata in [None, (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)]:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        [m async for m in stub.Generate(req, timeout=10, metadata=metadata)]
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                msgs = [m async for m in stub.Generate(req, timeout=30,
                                                       metadata=(("authorization", "Bearer s3cret"),))]
                assert [t for m in msgs for t in m.token_ids] == hf_greedy(tiny_hf, [7, 8], 4)
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING, "probes need no token"
            with pytest.raises(grpc.aio.AioRpcError) as err:               # plaintext to a TLS API
                async with open_channel(addr, None) as ch:
                    await generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=5).read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)
            await coord.close()


def test_tls_files_are_checked(pki):
    with pytest.raises(ValueError, match="both"):
        TLSFiles(cert="x.crt")
    with pytest.raises(ValueError, match="does not exist"):
        TLSFiles(cert="/nonexistent.crt", key="/nonexistent.key")
    cert, key = pki["stage"]
    with pytest.raises(ValueError, match="needs the CA"):          # a stage would skip client authentication
        TLSFiles(cert, key).mutual_server_credentials()
    with pytest.raises(ValueError, match="needs its own certificate"):       # it would serve plaintext
        TLSFiles(ca=pki["ca"]).mutual_server_credentials()
    assert TLSFiles().mutual_server_credentials() is None                   # plaintext: nothing changes
    assert TLSFiles(cert, key).server_credentials() is not None             # server-only TLS (the public API)


def test_nothing_from_the_network_is_decoded_with_pickle_or_eval():
    """No module of the services imports pickle/marshal/shelve or calls eval/exec; torch.load is not used
    (tensors travel as raw bytes with dtype and shape, common/codec.py)."""
    for path in [*ROOT.glob("services/**/*.py"), *ROOT.glob("coordinator/**/*.py"), *ROOT.glob("protos/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                assert not {"pickle", "marshal", "shelve", "dill"} & set(names), f"{path}: imports {names}"
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name):                       # the builtins, not methods like Module.eval
                    assert f.id not in {"eval", "exec", "compile", "__import__"}, f"{path}:{node.lineno}: {f.id}()"
                if isinstance(f, ast.Attribute) and f.attr == "load":
                    assert getattr(f.value, "id", "") != "torch", f"{path}:{node.lineno}: torch.load()"
