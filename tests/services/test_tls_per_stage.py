"""A certificate per stage (`--tls-peer-template specpipe-stage-{index}`): stage i takes Forward only from
stage i-1's certificate, stage 0 only from the coordinator's; Configure, Results and Control stay the
coordinator's. The allowed predecessor follows the index Configure gives a stage, also on an open Forward
stream. Real gRPC stage servers on 127.0.0.1 with certificates made here (tests/helpers/certs.py), and a whole
generation over mutual TLS in which every hop presents its own certificate."""
from __future__ import annotations

import argparse
import asyncio
import doctest
import re

import grpc
import pytest

import common.tls
from helpers.certs import make_ca, make_leaf, write, write_ca
from protos import stage_pb2, stage_pb2_grpc
from helpers.reference import hf_greedy
from services.config import StageConfig
from common.tls import COORDINATOR_NAME, PeerNames, TLSFiles, open_channel
from helpers.stage_servers import stage_servers

pytestmark = pytest.mark.grpc

TEMPLATE = "specpipe-stage-{index}"
STAGES = 4
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, TLSFiles]:
    """One CA; the coordinator's certificate, and stage i's named specpipe-stage-i."""
    tmp = tmp_path_factory.mktemp("per-stage-pki")
    ca = make_ca("specpipe-ca")
    ca_file = write_ca(tmp, "ca", ca)
    names = {"coordinator": COORDINATOR_NAME, **{f"stage-{i}": TEMPLATE.format(index=i) for i in range(STAGES)}}
    return {who: TLSFiles(*write(tmp, who, *make_leaf(ca, name)), ca_file) for who, name in names.items()}


def stage_flags(certs: dict[str, TLSFiles], i: int) -> dict:
    tls = certs[f"stage-{i}"]
    return dict(tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca, tls_peer_template=TEMPLATE)


async def forward_status(address: str, tls: TLSFiles) -> grpc.StatusCode:
    """The status of an empty Forward stream to `address` presenting `tls`'s certificate."""
    async with open_channel(address, tls) as ch:
        try:
            summary = await stage_pb2_grpc.StageStub(ch).Forward(iter(()), timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code()
    assert summary.batches == 0
    return grpc.StatusCode.OK


async def configure(address: str, tls: TLSFiles, stage: int, num_stages: int, next_hop: str) -> stage_pb2.StageInfo:
    """Move the stage at `address` to index `stage`, keeping its layers."""
    async with open_channel(address, tls) as ch:
        stub = stage_pb2_grpc.StageStub(ch)
        info = await stub.Info(stage_pb2.InfoRequest(), timeout=10)
        return await stub.Configure(stage_pb2.ConfigureRequest(
            stage=stage, num_stages=num_stages, first_layer=info.first_layer, last_layer=info.last_layer,
            next_hop=next_hop), timeout=30)


async def test_forward_only_from_the_stage_before(tiny_model, certs):
    """Every stage against every certificate: Forward passes exactly from stage i-1 (stage 0: the coordinator)."""
    async with stage_servers(str(tiny_model), STAGES, tls=[stage_flags(certs, i) for i in range(STAGES)]) as (addrs, _):
        callers = ["coordinator", *(f"stage-{i}" for i in range(STAGES))]
        for i, address in enumerate(addrs):
            allowed = "coordinator" if i == 0 else f"stage-{i - 1}"
            seen = {who: await forward_status(address, certs[who]) for who in callers}
            assert seen == {who: grpc.StatusCode.OK if who == allowed else DENIED for who in callers}, f"stage {i}"
        async with open_channel(addrs[2], certs["stage-1"]) as ch:         # the predecessor may only forward
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stage_pb2_grpc.StageStub(ch).Control(iter(()), timeout=10)
            assert err.value.code() == DENIED
            assert (await stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=10)).stage == 2
        async with open_channel(addrs[2], certs["stage-0"]) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stage_pb2_grpc.StageStub(ch).Forward(iter(()), timeout=10)
            assert err.value.details().startswith("Forward is accepted only from specpipe-stage-1; "), \
                err.value.details()
            assert "specpipe-stage-0" in err.value.details(), "the message names the certificate seen"


async def test_the_allowed_predecessor_follows_configure(tiny_model, certs):
    """Stage 2 moved to index 1, then 0 (same layers): Forward then passes from stage-0's certificate, then from
    the coordinator's alone; back at index 2, from stage-1's again."""
    async with stage_servers(str(tiny_model), STAGES, tls=[stage_flags(certs, i) for i in range(STAGES)]) as (addrs, _):
        coord = certs["coordinator"]
        for index, allowed in [(1, "stage-0"), (0, "coordinator"), (2, "stage-1")]:
            info = await configure(addrs[2], coord, index, STAGES, addrs[3])
            assert info.stage == index
            for who in ("coordinator", "stage-0", "stage-1", "stage-3"):
                expected = grpc.StatusCode.OK if who == allowed else DENIED
                assert await forward_status(addrs[2], certs[who]) == expected, (index, who)


async def test_an_open_forward_stream_is_checked_again_after_configure(tiny_model, certs):
    """Stage-1's stream into stage 2 carries a micro-batch (stage 2 computes it and forwards it to stage 3 with
    its own certificate); once Configure has made stage 2 index 1, the next micro-batch on that same stream is
    refused and not computed."""
    async with stage_servers(str(tiny_model), STAGES,
                             tls=[stage_flags(certs, i) for i in range(STAGES)]) as (addrs, servicers):
        async with open_channel(addrs[2], certs["stage-1"]) as ch:
            call = stage_pb2_grpc.StageStub(ch).Forward(timeout=30)
            await call.write(stage_pb2.MicroBatch(batch_id=1))
            for _ in range(200):
                if servicers[3].runner.counters.batches == 1:
                    break
                await asyncio.sleep(0.02)
            assert (servicers[2].runner.counters.batches, servicers[3].runner.counters.batches) == (1, 1)
            await configure(addrs[2], certs["coordinator"], 1, STAGES, addrs[3])
            await call.write(stage_pb2.MicroBatch(batch_id=2))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == DENIED
            assert "specpipe-stage-0" in err.value.details() and "specpipe-stage-1" in err.value.details()
            assert servicers[2].runner.counters.batches == 1, "the refused micro-batch was not computed"


async def test_generation_over_per_stage_certificates(tiny_model, tiny_hf, certs):
    """The coordinator presents its certificate to every stage; each stage presents its own to the next. The
    output is transformers' greedy one, and every stage computed."""
    from coordinator.config import CoordinatorConfig
    from coordinator.frontends.server import start
    from coordinator.frontends.service import GenerateInput
    async with stage_servers(str(tiny_model), STAGES,
                             tls=[stage_flags(certs, i) for i in range(STAGES)]) as (addrs, servicers):
        coord = certs["coordinator"]
        server, service = await start(CoordinatorConfig(stages=tuple(addrs), model=str(tiny_model), port=0,
                                                        method="specpipe", tls_cert=coord.cert, tls_key=coord.key,
                                                        tls_ca=coord.ca))
        try:
            out: list[int] = []
            async for chunk in service.generate(GenerateInput(prompt_token_ids=[3, 4, 5], max_new_tokens=8,
                                                              ignore_eos=True)):
                out += chunk.token_ids
            assert out == hf_greedy(tiny_hf, [3, 4, 5], 8)
            assert all(s.runner.counters.batches > 0 for s in servicers), "every hop carried the micro-batches"
        finally:
            await server.stop(0)
            await service.close()


def test_flag_environment_and_index_from_the_host_name(monkeypatch, certs):
    """--tls-peer-template or SPECPIPE_TLS_PEER_TEMPLATE; with --stage auto the index (so the predecessor) is the
    pod's ordinal."""
    tls = certs["stage-3"]
    files = ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca]

    def config(*argv: str) -> StageConfig:
        p = argparse.ArgumentParser()
        StageConfig.add_arguments(p)
        return StageConfig.from_args(p.parse_args([*files, *argv]))

    monkeypatch.setattr("services.config.socket.gethostname", lambda: "rel-specpipe-stage-3")
    cfg = config("--stage", "auto", "--num-stages", "4", "--tls-peer-template", "rel-specpipe-stage-{index}")
    assert cfg.stage == 3 and cfg.peer_names.allowed("Forward") == {"rel-specpipe-stage-2"}
    assert cfg.peer_names.allowed("Configure") == {COORDINATOR_NAME}
    monkeypatch.setenv("SPECPIPE_TLS_PEER_TEMPLATE", "s{index}.pipe")
    assert config("--stage", "0", "--num-stages", "2").peer_names.allowed("Forward") == {COORDINATOR_NAME}
    assert config("--stage", "1", "--num-stages", "2").peer_names.allowed("Forward") == {"s0.pipe"}
    monkeypatch.delenv("SPECPIPE_TLS_PEER_TEMPLATE")
    default = config("--stage", "2", "--num-stages", "4")
    assert default.tls_peer_template == "" and default.peer_names.allowed("Forward") == {COORDINATOR_NAME,
                                                                                          "specpipe-stage"}


@pytest.mark.parametrize("template, message", [
    ("specpipe-stage", "needs {index} exactly once"),
    ("stage-{index}-{index}", "needs {index} exactly once"),
    ("stage-{index.real}", "needs {index} exactly once"),
    ("stage-{index}-{0}", "no other braces"),
    ("stage {index}", "is not a certificate name"),
])
def test_bad_templates_are_refused(template, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PeerNames(predecessor=template)
    with pytest.raises(ValueError, match=re.escape(message)):
        StageConfig(tls_peer_template=template)


def test_a_template_that_forms_the_coordinators_name_is_refused():
    """Else the stage of that index would hold the coordinator's identity (Configure, Results, Control)."""
    for coordinator, template in [("specpipe-7", "specpipe-{index}"), ("coordinator12", "coordinator{index}"),
                                  ("a-0.b", "a-{index}.b")]:
        with pytest.raises(ValueError, match="is a stage's name by the TLS peer template"):
            PeerNames(coordinator=coordinator, predecessor=template)
    assert PeerNames(coordinator="specpipe-coordinator", predecessor="specpipe-{index}").stage_name(4) == "specpipe-4"


def test_the_contract_examples_hold():
    assert doctest.testmod(common.tls).failed == 0
    with pytest.raises(ValueError, match="not an index"):
        PeerNames(predecessor=TEMPLATE, stage=-1)
