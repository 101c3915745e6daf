"""Bad input to every RPC, over real gRPC (hypothesis): Stage Forward / Results / Control / Info / Configure,
Generation/Generate, health and reflection. Each answer is a specific status code (or, for a micro-batch,
a per-segment error code) predicted by a reference validator written here; the services survive (exact
greedy output afterwards) and keep no state for what was released."""
from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from helpers.fuzz_harness import (HIDDEN, LAYERS, MAX_MB, SC, VOCAB, Env, check_invariants, code_of, decodable,
                                  micro_batch, raw, segment_ok)
from helpers.reference import hf_greedy
from protos import common_pb2, generation_pb2, stage_pb2
from common.batch import Control

pytestmark = pytest.mark.grpc

INVALID = SC.INVALID_ARGUMENT.value[0]
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])



def assert_exact_and_clean(fuzz_env: Env, tiny_hf) -> None:
    """The raw pipeline still decodes exactly and holds nothing."""
    prompt = [10, 20, 30, 40]
    assert fuzz_env.run(fuzz_env.greedy_a(prompt, 4)) == hf_greedy(tiny_hf, prompt, 4)
    assert fuzz_env.run(fuzz_env.held_a()) == [[], []]


# -- Forward ------------------------------------------------------------------------------------------
@settings(FUZZ, max_examples=200)
@given(case=micro_batch())
def test_forward_malformed_micro_batches_fail_only_their_segments(fuzz_env, case):
    stage, segs, preset, hidden, logprobs, return_logprobs = case
    rids = []
    for s in segs:
        s["request_id"] = {"fresh": fuzz_env.rid(), "empty": ""}.get(s["rid"], rids[-1] if rids else "")
        rids.append(s["request_id"])
    msg = stage_pb2.MicroBatch(return_logprobs=return_logprobs)
    for s in segs:
        msg.segments.add(**{k: v for k, v in s.items() if k != "rid"})
    if preset:
        msg.segments.add(request_id=fuzz_env.rid(), error="rejected upstream", error_code=9, error_stage=0)
    if hidden is not None:
        msg.hidden.CopyFrom(hidden)
    if logprobs is not None:
        msg.logprobs.CopyFrom(logprobs)
    out = fuzz_env.run(fuzz_env.send_a(msg, stage))

    assert [s.request_id for s in out.segments] == [s.request_id for s in msg.segments]
    if preset:
        last = out.segments[-1]
        assert (last.error, last.error_code, last.error_stage, len(last.node_ids)) == ("rejected upstream", 9, 0, 0)
    rows = sum(len(s["node_ids"]) for s in segs)
    batch_ok = (hidden is None or decodable(hidden)) and (logprobs is None or decodable(logprobs)) and (
        stage == 0 or (hidden is None and rows == 0) or
        (hidden is not None and hidden.dtype == "float32" and list(hidden.shape) == [rows, HIDDEN]))
    repeated = {r for r in rids if rids.count(r) > 1}
    outputs = 0
    for s, o in zip(segs, out.segments):
        if batch_ok and segment_ok(s, stage, repeated):
            assert not o.error, (s, o.error)
            assert list(o.node_ids) == s["node_ids"]
            outputs += sum(s["want_output"])
        else:
            assert o.error and o.error_code == INVALID and not o.node_ids, (s, batch_ok, o)
    assert len(out.argmax) == outputs and all(0 <= t < VOCAB for t in out.argmax)
    fuzz_env.run(fuzz_env.control_a(*[Control(r, release=True) for r in set(rids) if r]))
    assert fuzz_env.run(fuzz_env.held_a()) == [[], []], "released requests leave nothing behind"


def test_forward_fuzz_leaves_the_pipeline_exact(fuzz_env, tiny_hf):
    assert_exact_and_clean(fuzz_env, tiny_hf)


# -- Control: random commit / prune / release interleaved with rows ------------------------------------
OPS = st.one_of(
    st.tuples(st.just("rows"), st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True), st.booleans()),
    st.tuples(st.just("commit"), st.lists(st.integers(-2, 11), max_size=3)),
    st.tuples(st.just("prune"), st.lists(st.integers(-2, 11), max_size=3)),
    st.tuples(st.just("both"), st.lists(st.integers(0, 9), max_size=2), st.lists(st.integers(0, 9), max_size=2)),
    st.tuples(st.just("release")),
)


def depth(i: int) -> int:
    return 0 if i == 0 else depth((i - 1) // 2) + 1


@settings(FUZZ, max_examples=80)
@given(ops=st.lists(OPS, max_size=8), stranger=st.sampled_from(["", "unknown"]))
# a refused prune (4 is committed) used to delete 1 anyway; 7's parent 3 then led to a KeyError: INTERNAL
@example(ops=[("rows", [0, 1, 3, 4], False), ("commit", [0, 4]), ("prune", [1]), ("rows", [7], False)], stranger="")
def test_control_messages_never_break_the_stream_or_the_node_tables(fuzz_env, ops, stranger):
    """Nodes form a fixed binary tree (parent of i is (i - 1) // 2, position = depth); rows, commits
    (of unknown, pruned or negative nodes), prunes (of the root, of committed nodes) and releases arrive in
    any order. Control streams always end OK; a row either computes or is refused with INVALID_ARGUMENT;
    the tables stay consistent; release frees everything."""
    rid, sent = fuzz_env.rid(), set()
    for op in ops:
        if op[0] == "rows":
            ids = set(op[1])
            if op[2]:                                   # with the ancestors not sent yet
                ids |= {a for i in op[1] for a in ancestors(i)}
            ids = sorted(ids - sent)
            if not ids:
                continue
            msg = stage_pb2.MicroBatch()
            msg.segments.add(request_id=rid, node_ids=ids, parent_ids=[(i - 1) // 2 if i else -1 for i in ids],
                             positions=[depth(i) for i in ids], token_ids=[5 + i for i in ids],
                             want_output=[True] * len(ids))
            out = fuzz_env.run(fuzz_env.send_a(msg)).segments[0]
            assert not out.error or out.error_code == INVALID, out
            sent |= set(ids) if not out.error else set()
        else:
            commit = op[1] if op[0] in ("commit", "both") else []
            prune = op[-1] if op[0] in ("prune", "both") else []
            ctl = Control(rid, commit=commit, prune=prune, release=op[0] == "release")
            fuzz_env.run(fuzz_env.control_a(ctl, Control(stranger, commit=[1], prune=[2])))
        for servicer in fuzz_env.servicers:
            kv = servicer.runner.cache.requests.get(rid)
            if kv is not None:
                fuzz_env.run(_call(check_invariants, kv))
    fuzz_env.run(fuzz_env.control_a(Control(rid, release=True), Control("unknown", release=True)))
    assert fuzz_env.run(fuzz_env.held_a()) == [[], []]


def ancestors(i: int) -> list[int]:
    out = []
    while i:
        i = (i - 1) // 2
        out.append(i)
    return out


async def _call(fn, *args):
    return fn(*args)


def test_control_fuzz_leaves_the_pipeline_exact(fuzz_env, tiny_hf):
    assert_exact_and_clean(fuzz_env, tiny_hf)


# -- Info, Configure, Results ------------------------------------------------------------------------
@settings(FUZZ, max_examples=30)
@given(rid=st.text(max_size=40))
def test_info_for_any_request_id(fuzz_env, rid):
    for stub in fuzz_env.stubs:
        info = fuzz_env.run(lambda: stub.Info(stage_pb2.InfoRequest(request_id=rid), timeout=10))
        assert list(info.requests) == [] and info.num_layers_total == LAYERS and info.active_requests == 0


def hop_ok(hop: str) -> bool:
    host, sep, port = hop.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        return False
    if host.startswith("["):
        return len(host) > 2 and host.endswith("]") and all(c in "0123456789abcdefABCDEF:." for c in host[1:-1])
    return all(c.isascii() and (c.isalnum() or c in "._-") for c in host)


SMALL = st.integers(-2, 6) | st.sampled_from([-(1 << 31), (1 << 31) - 1])
HOPS = st.sampled_from(["", "", "127.0.0.1:1", "garbage", "host:0", "host:65536", "host:00080", "host:000080",
                        ":80", "a b:80", "[::1]:50051", "[zz]:1", "x:\u0663", "h\u00e9:80"]) | st.text(max_size=12)
LAYOUTS = st.sampled_from([(0, 2, 0, 2), (2, 4, 1, 2), (0, 4, 0, 1), (1, 4, 2, 3), (0, 1, 0, 4)])


@settings(FUZZ, max_examples=80)
@given(target=st.sampled_from([0, 1]), layout=st.tuples(SMALL, SMALL, SMALL, SMALL) | LAYOUTS, hop=HOPS)
def test_configure_refuses_absurd_layouts_and_never_moves_a_busy_stage(fuzz_env, target, layout, hop):
    """A request holds KV on both stages, so a well-formed re-partition gets FAILED_PRECONDITION and a
    malformed one INVALID_ARGUMENT; the stage keeps its layers either way."""
    first, last, stage, n = layout
    holder = fuzz_env.rid()
    fuzz_env.run(fuzz_env.control_a(Control(holder, commit=[0])))
    valid = (0 <= first < last <= LAYERS and 0 <= stage < n and (stage == n - 1) == (hop == "")
             and (last == LAYERS) == (stage == n - 1) and (hop == "" or hop_ok(hop)))
    req = stage_pb2.ConfigureRequest(stage=stage, num_stages=n, first_layer=first, last_layer=last, next_hop=hop)
    code = code_of(lambda: fuzz_env.run(lambda: fuzz_env.stubs[target].Configure(req, timeout=30)))
    assert code == (SC.FAILED_PRECONDITION if valid else SC.INVALID_ARGUMENT), (layout, hop)
    info = fuzz_env.run(lambda: fuzz_env.stubs[target].Info(stage_pb2.InfoRequest(), timeout=10))
    assert (info.first_layer, info.last_layer, info.stage) == ((0, 2, 0) if target == 0 else (2, 4, 1))
    fuzz_env.run(fuzz_env.control_a(Control(holder, release=True)))


def test_configure_to_the_same_layout_then_exact(fuzz_env, tiny_hf):
    for i, stub in enumerate(fuzz_env.stubs):
        req = stage_pb2.ConfigureRequest(stage=i, num_stages=2, first_layer=2 * i, last_layer=2 * i + 2,
                                         next_hop=fuzz_env.addrs[1] if i == 0 else "")
        info = fuzz_env.run(lambda: stub.Configure(req, timeout=30))
        assert (info.first_layer, info.last_layer, info.next_hop) == (2 * i, 2 * i + 2, req.next_hop)
    assert_exact_and_clean(fuzz_env, tiny_hf)


def test_results_only_on_the_last_stage_and_a_bad_subscription_replaces_nothing(fuzz_env, tiny_hf):
    async def subscribe(stub) -> SC:
        try:
            await stub.Results(stage_pb2.ResultsRequest(), timeout=10).read()
        except grpc.aio.AioRpcError as e:
            return e.code()
        return SC.OK
    assert fuzz_env.run(subscribe(fuzz_env.stubs[0])) == SC.FAILED_PRECONDITION
    assert raw(fuzz_env, "stage1", "/specpipe.v1.Stage/Results", "us", b"\x0a\xff\xff\xff\xff\x0f") == SC.INVALID_ARGUMENT
    assert_exact_and_clean(fuzz_env, tiny_hf)            # the test's own subscription still gets the results


# -- undecodable bytes and oversized messages, every service ------------------------------------------
STAGE_TYPES = {"Info": stage_pb2.InfoRequest, "Configure": stage_pb2.ConfigureRequest,
               "Results": stage_pb2.ResultsRequest, "Forward": stage_pb2.MicroBatch,
               "Control": stage_pb2.ControlMessage}
KINDS = {"Info": "uu", "Configure": "uu", "Results": "us", "Forward": "su", "Control": "su"}
RAW = [(w, f"/specpipe.v1.Stage/{m}", KINDS[m], t) for w in ("stage0", "stage1") for m, t in STAGE_TYPES.items()] + \
      [(w, p, k, t) for w in ("stage0", "api") for p, k, t in (
          ("/grpc.health.v1.Health/Check", "uu", health_pb2.HealthCheckRequest),
          ("/grpc.health.v1.Health/Watch", "us", health_pb2.HealthCheckRequest),
          ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "ss",
           reflection_pb2.ServerReflectionRequest))] + \
      [("api", "/specpipe.v1.Generation/Generate", "us", generation_pb2.GenerateRequest)]


def parses(kind: type, payload: bytes) -> bool:
    try:
        kind.FromString(payload)
    except DecodeError:
        return False
    return True


@settings(FUZZ, max_examples=150)
@given(target=st.sampled_from(RAW), prefix=st.binary(max_size=48))
def test_undecodable_bytes_get_invalid_argument_everywhere(fuzz_env, target, prefix):
    where, path, kind, request_type = target
    payload = prefix + b"\x0a\xff\xff\xff\xff\x0f"        # usually ends in a field running past the end
    assume(not parses(request_type, payload))
    assert raw(fuzz_env, where, path, kind, payload) == SC.INVALID_ARGUMENT, target


def test_messages_beyond_the_size_limit_get_resource_exhausted(fuzz_env, tiny_hf):
    big = "x" * (MAX_MB * 1024 * 1024 + 1000)
    stage = fuzz_env.stubs[0]
    assert code_of(lambda: fuzz_env.run(lambda: stage.Info(stage_pb2.InfoRequest(request_id=big), timeout=10))) \
        == SC.RESOURCE_EXHAUSTED
    assert code_of(lambda: fuzz_env.run(lambda: stage.Configure(stage_pb2.ConfigureRequest(next_hop=big), timeout=10))) \
        == SC.RESOURCE_EXHAUSTED
    huge = stage_pb2.MicroBatch(hidden=common_pb2.Tensor(dtype="float32", shape=[len(big) // 4], data=big.encode()))
    assert raw(fuzz_env, "stage0", "/specpipe.v1.Stage/Forward", "su", huge.SerializeToString()) == SC.RESOURCE_EXHAUSTED
    ctl = stage_pb2.ControlMessage(request_id=big)
    assert raw(fuzz_env, "stage0", "/specpipe.v1.Stage/Control", "su", ctl.SerializeToString()) == SC.RESOURCE_EXHAUSTED
    gen = generation_pb2.GenerateRequest(prompt=big)
    assert raw(fuzz_env, "api", "/specpipe.v1.Generation/Generate", "us", gen.SerializeToString()) == SC.RESOURCE_EXHAUSTED
    # many rows within the limit are fine: 2000 children of one root in one micro-batch
    rid, n = fuzz_env.rid(), 2000
    msg = stage_pb2.MicroBatch()
    msg.segments.add(request_id=rid, node_ids=range(n + 1), parent_ids=[-1] + [0] * n, positions=[0] + [1] * n,
                     token_ids=[5] * (n + 1), want_output=[True] * (n + 1))
    out = fuzz_env.run(fuzz_env.send_a(msg))
    assert not out.segments[0].error and len(out.argmax) == n + 1 and len(set(out.argmax[1:])) == 1
    fuzz_env.run(fuzz_env.control_a(Control(rid, release=True)))
    assert_exact_and_clean(fuzz_env, tiny_hf)


def test_health_and_reflection_still_answer_well_formed_requests(fuzz_env):
    """The interceptor that turns undecodable bytes into INVALID_ARGUMENT passes good requests through,
    including to handlers that stream with context.write (Health/Watch)."""
    from grpc_health.v1 import health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2_grpc

    async def check(addr: str) -> tuple[int, list[str]]:
        channel = fuzz_env.channels[addr]
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        first = await watch.read()
        watch.cancel()
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=10)
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        listed = await call.read()
        await call.done_writing()
        return first.status, sorted(s.name for s in listed.list_services_response.service)
    for addr, service in ((fuzz_env.addrs[0], "specpipe.v1.Stage"), (fuzz_env.api_addr, "specpipe.v1.Generation")):
        status, services = fuzz_env.run(check(addr))
        assert status == health_pb2.HealthCheckResponse.SERVING and service in services
