"""Only the right peer may ask: with mutual TLS a stage takes Configure, Results and Control only from the
coordinator's certificate name, Forward from the coordinator or a stage's, Info from any certificate of its CA;
a certificate from another CA fails the handshake; a stage certificate without a CA is refused at start.
Real gRPC servers on 127.0.0.1 with certificates made by test_tls.py's helpers."""
from __future__ import annotations

import argparse

import grpc
import pytest

from protos import stage_pb2, stage_pb2_grpc
from services.config import StageConfig
from common.tls import COORDINATOR_NAME, STAGE_NAME, PeerNames, TLSFiles, open_channel
from helpers.stage_servers import stage_servers

pytestmark = pytest.mark.grpc

ONLY_COORDINATOR = ("Configure", "Results", "Control")


def client(pki: dict, who: str) -> TLSFiles:
    cert, key = pki[who]
    return TLSFiles(cert, key, pki["ca"])


async def call(stub: stage_pb2_grpc.StageStub, rpc: str, info: stage_pb2.StageInfo | None = None,
               refused: bool = False) -> object:
    """One harmless call of `rpc`: an empty stream, a Results subscription until registered (`refused`: until
    its status), a Configure that keeps the stage as it is."""
    if rpc == "Forward":
        return await stub.Forward(iter(()), timeout=10)
    if rpc == "Control":
        return await stub.Control(iter(()), timeout=10)
    if rpc == "Info":
        return await stub.Info(stage_pb2.InfoRequest(), timeout=10)
    if rpc == "Configure":
        assert info is not None
        return await stub.Configure(stage_pb2.ConfigureRequest(
            stage=0, num_stages=1, first_layer=info.first_layer, last_layer=info.last_layer), timeout=30)
    results = stub.Results(stage_pb2.ResultsRequest(), timeout=10)
    try:
        if refused:
            return await results.read()               # raises with the refusal
        await results.initial_metadata()              # sent once the stage has registered the subscriber
        return "subscribed"
    finally:
        results.cancel()


async def test_each_rpc_only_from_the_right_identity(tiny_model, pki):
    tls = dict(tls_cert=pki["stage"][0], tls_key=pki["stage"][1], tls_ca=pki["ca"])
    async with stage_servers(str(tiny_model), 1, tls=tls) as (addrs, _):
        channels = {who: open_channel(addrs[0], client(pki, who)) for who in ("coordinator", "stage", "other")}
        try:
            stubs = {who: stage_pb2_grpc.StageStub(ch) for who, ch in channels.items()}
            info = await call(stubs["stage"], "Info")               # any certificate of the CA may ask Info
            assert (await call(stubs["other"], "Info")).num_layers_total == info.num_layers_total
            for rpc in ("Forward", *ONLY_COORDINATOR):              # the coordinator may ask everything
                assert await call(stubs["coordinator"], rpc, info), rpc
            assert (await call(stubs["stage"], "Forward")).batches == 0, "the previous stage forwards"
            refused = [("stage", rpc) for rpc in ONLY_COORDINATOR] + \
                      [("other", rpc) for rpc in ("Forward", *ONLY_COORDINATOR)]
            for who, rpc in refused:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(stubs[who], rpc, info, refused=True)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (who, rpc)
                name = STAGE_NAME if who == "stage" else "someone-else"
                assert err.value.details().startswith(f"{rpc} is accepted only from "), err.value.details()
                assert name in err.value.details(), "the message names the identity seen"
            assert (await call(stubs["coordinator"], "Info")).active_requests == 0, "the stage still serves"
        finally:
            for ch in channels.values():
                await ch.close()


async def test_another_ca_fails_the_handshake_even_with_the_coordinators_name(tiny_model, pki):
    tls = dict(tls_cert=pki["stage"][0], tls_key=pki["stage"][1], tls_ca=pki["ca"])
    async with stage_servers(str(tiny_model), 1, tls=tls) as (addrs, _):
        # unary calls: a client stream on a failed handshake ends in grpc.aio with CancelledError instead
        async with open_channel(addrs[0], client(pki, "intruder")) as ch:
            for rpc in ("Configure", "Results", "Info"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(stage_pb2_grpc.StageStub(ch), rpc, stage_pb2.StageInfo(last_layer=4), refused=True)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, rpc


async def test_configured_names_replace_the_defaults(tiny_model, pki):
    """--tls-coordinator-name / --tls-peer-names: here the stage certificate is the coordinator, and only
    'someone-else' may forward besides it."""
    tls = dict(tls_cert=pki["stage"][0], tls_key=pki["stage"][1], tls_ca=pki["ca"],
               tls_coordinator_name=STAGE_NAME, tls_peer_names="someone-else")
    async with stage_servers(str(tiny_model), 1, tls=tls) as (addrs, _):
        for who, rpc, ok in [("stage", "Control", True), ("other", "Forward", True), ("coordinator", "Forward", False),
                             ("coordinator", "Control", False), ("other", "Control", False)]:
            async with open_channel(addrs[0], client(pki, who)) as ch:
                if ok:
                    await call(stage_pb2_grpc.StageStub(ch), rpc)
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(stage_pb2_grpc.StageStub(ch), rpc, refused=True)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (who, rpc)


async def test_without_tls_nothing_is_checked(tiny_model):
    async with stage_servers(str(tiny_model), 1) as (addrs, servicers):
        assert servicers[0].config.peer_names is None
        async with open_channel(addrs[0], None) as ch:
            assert (await call(stage_pb2_grpc.StageStub(ch), "Control")).messages == 0


def test_a_stage_certificate_without_a_ca_is_refused_at_start(pki, capsys):
    from services.server import main
    cert, key = pki["stage"]
    with pytest.raises(ValueError, match="needs the CA"):
        StageConfig(tls_cert=cert, tls_key=key)
    with pytest.raises(ValueError, match="needs its own certificate"):
        StageConfig(tls_ca=pki["ca"])
    with pytest.raises(SystemExit) as exit_:                      # before any model is loaded
        main(["--tls-cert", cert, "--tls-key", key])
    assert exit_.value.code == 2
    assert "--tls-ca" in capsys.readouterr().err


def test_identity_flags_and_environment(monkeypatch, pki):
    cert, key = pki["stage"]
    monkeypatch.setenv("SPECPIPE_TLS_PEER_NAMES", "s-a, s-b")
    p = argparse.ArgumentParser()
    StageConfig.add_arguments(p)
    args = p.parse_args(["--tls-cert", cert, "--tls-key", key, "--tls-ca", pki["ca"],
                         "--tls-coordinator-name", "coord-x"])
    cfg = StageConfig.from_args(args)
    assert cfg.peer_names == PeerNames("coord-x", ("s-a", "s-b"))
    assert cfg.peer_names.allowed("Forward") == {"coord-x", "s-a", "s-b"}
    assert cfg.peer_names.allowed("Configure") == {"coord-x"} and cfg.peer_names.allowed("Info") is None
    defaults = StageConfig(tls_cert=cert, tls_key=key, tls_ca=pki["ca"]).peer_names
    assert defaults == PeerNames(COORDINATOR_NAME, (STAGE_NAME,))
    for bad in ("", " x", "a,b"):
        with pytest.raises(ValueError, match="TLS identity"):
            PeerNames(bad)
