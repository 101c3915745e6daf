"""The coordinator's and the stage's settings: every speculation field reaches the schedulers' SpecOptions, and
the environment variable names and flags the chart, the README and deployments use stay as they were."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from services.config import StageConfig, TLSOptions
from common.options import options

from coordinator.cli.main import _generate_parser, build_parser
from coordinator.config import CoordinatorConfig, SpecConfig, spec_kwargs
from coordinator.core.schedulers.registry import SpecOptions, Speculation

# a valid value other than the default, for each speculation field
OTHER = {"width": 5, "tree_policy": "layer", "topk": 3, "draft_rounds": 1, "draft_chain": False, "calibrate": False, "sps_k": 2, "tree_nodes": 9,
         "tree_depth": 4, "tree_topk": 2, "pipeinfer_run": 3, "pipeinfer_min_prob": 0.25, "verify": "rejection",
         "node_budget": 17, "prefill_chunk": 64, "stage_hardware": "apart"}


def test_every_speculation_field_reaches_spec_options():
    assert set(OTHER) == {f.name for f in fields(Speculation)}, "a new field: give it a value in OTHER"
    assert all(OTHER[k] != getattr(Speculation(), k) for k in OTHER)
    assert {f.name for f in fields(Speculation)} <= {f.name for f in fields(CoordinatorConfig)}
    assert {f.name for f in fields(SpecOptions)} == {*OTHER, "draft"}
    draft = object()
    spec = CoordinatorConfig(stages=("h:1",), **OTHER).spec_options(draft)
    assert isinstance(spec, SpecOptions) and spec.draft is draft
    assert {k: getattr(spec, k) for k in OTHER} == OTHER


@pytest.mark.parametrize("command", ["run", "local"])
def test_speculation_flags_of_run_and_local_reach_spec_options(command):
    argv = [command, *(["prompt"] if command == "run" else [])]
    for name, value in OTHER.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    kwargs = spec_kwargs(build_parser().parse_args([*argv, "--draft", "ngram", "--draft-threads", "2"]))
    assert set(kwargs) == {f.name for f in options(SpecConfig)}
    cfg = CoordinatorConfig(stages=("h:1",), **kwargs)
    assert (cfg.draft, cfg.draft_threads) == ("ngram", 2)
    assert {k: getattr(cfg.spec_options(None), k) for k in OTHER} == OTHER


def test_coordinator_flags_cover_every_option():
    p = argparse.ArgumentParser()
    CoordinatorConfig.add_arguments(p)
    dests = {a.dest for a in p._actions}
    assert {f.name for f in options(CoordinatorConfig)} | {"num_stages"} <= dests
    assert {"tls_cert", "tls_key", "tls_ca"} == {f.name for f in options(TLSOptions)}


# (flag, environment variable, its value, the parsed default) as deployments set them today
COORDINATOR_ENV = [
    ("--stages", "SPECPIPE_STAGES", "a:1,b:2", "a:1,b:2"), ("--num-stages", "SPECPIPE_NUM_STAGES", "3", 3),
    ("--k8s-statefulset", "SPECPIPE_K8S_STATEFULSET", "ss", "ss"), ("--k8s-namespace", "POD_NAMESPACE", "ns", "ns"),
    ("--tls-cert", "SPECPIPE_TLS_CERT", "c.pem", "c.pem"), ("--tls-key", "SPECPIPE_TLS_KEY", "k.pem", "k.pem"),
    ("--tls-ca", "SPECPIPE_TLS_CA", "ca.pem", "ca.pem"),
    ("--api-tls-cert", "SPECPIPE_API_TLS_CERT", "a.pem", "a.pem"),
    ("--api-tls-key", "SPECPIPE_API_TLS_KEY", "b.pem", "b.pem"), ("--api-token", "SPECPIPE_API_TOKEN", "t", "t"),
    ("--http-port", "SPECPIPE_HTTP_PORT", "81", 81), ("--health-port", "SPECPIPE_HEALTH_PORT", "82", 82),
    ("--metrics-port", "SPECPIPE_METRICS_PORT", "83", 83), ("--model", "SPECPIPE_MODEL", "m", "m"),
    ("--generation-config", "SPECPIPE_GENERATION_CONFIG", "none", "none"),
    ("--host", "SPECPIPE_HOST", "0.0.0.0", "0.0.0.0"), ("--port", "SPECPIPE_PORT", "84", 84),
    ("--method", "SPECPIPE_METHOD", "pp", "pp"), ("--draft", "SPECPIPE_DRAFT", "ngram", "ngram"),
    ("--draft-model", "SPECPIPE_DRAFT_MODEL", "dm", "dm"), ("--draft-device", "SPECPIPE_DRAFT_DEVICE", "cuda", "cuda"),
    ("--draft-dtype", "SPECPIPE_DRAFT_DTYPE", "float16", "float16"), ("--width", "SPECPIPE_WIDTH", "5", 5),
    ("--tree-policy", "SPECPIPE_TREE_POLICY", "layer", "layer"),
    ("--verify", "SPECPIPE_VERIFY", "rejection", "rejection"),
    ("--stage-hardware", "SPECPIPE_STAGE_HARDWARE", "apart", "apart"), ("--node-budget", "SPECPIPE_NODE_BUDGET", "9", 9),
    ("--prefill-chunk", "SPECPIPE_PREFILL_CHUNK", "7", 7), ("--max-active", "SPECPIPE_MAX_ACTIVE", "3", 3),
    ("--max-queue", "SPECPIPE_MAX_QUEUE", "4", 4), ("--grace-s", "SPECPIPE_GRACE_S", "1.5", 1.5),
    ("--recovery-timeout-s", "SPECPIPE_RECOVERY_TIMEOUT_S", "2.5", 2.5),
    ("--api-max-message-mb", "SPECPIPE_API_MAX_MESSAGE_MB", "5", 5),
    ("--api-max-concurrent-rpcs", "SPECPIPE_API_MAX_CONCURRENT_RPCS", "6", 6),
    ("--http-timeout-s", "SPECPIPE_HTTP_TIMEOUT_S", "7.5", 7.5),
    ("--max-per-client", "SPECPIPE_MAX_PER_CLIENT", "8", 8),
    ("--batch-timeout-s", "SPECPIPE_BATCH_TIMEOUT_S", "9.5", 9.5),
    ("--drain-timeout-s", "SPECPIPE_DRAIN_TIMEOUT_S", "10.5", 10.5),
    ("--probe-interval-s", "SPECPIPE_PROBE_INTERVAL_S", "11.5", 11.5),
    ("--probe-timeout-s", "SPECPIPE_PROBE_TIMEOUT_S", "12.5", 12.5)]
STAGE_ENV = [
    ("--model", "SPECPIPE_MODEL", "m", "m"), ("--stage", "SPECPIPE_STAGE", "auto", "auto"),
    ("--num-stages", "SPECPIPE_NUM_STAGES", "4", 4), ("--layers", "SPECPIPE_LAYERS", "0:8", "0:8"),
    ("--host", "SPECPIPE_HOST", "0.0.0.0", "0.0.0.0"), ("--port", "SPECPIPE_PORT", "50061", 50061),
    ("--next-hop", "SPECPIPE_NEXT_HOP", "n:1", "n:1"), ("--dtype", "SPECPIPE_DTYPE", "bf16", "bf16"),
    ("--device", "SPECPIPE_DEVICE", "cuda:1", "cuda:1"), ("--threads", "SPECPIPE_THREADS", "2", 2),
    ("--stage-time-ms", "SPECPIPE_STAGE_TIME_MS", "3+1", "3+1"), ("--grace-s", "SPECPIPE_GRACE_S", "1.5", 1.5),
    ("--kv-limit-mb", "SPECPIPE_KV_LIMIT_MB", "13.5", 13.5), ("--health-port", "SPECPIPE_HEALTH_PORT", "82", 82),
    ("--metrics-port", "SPECPIPE_METRICS_PORT", "83", 83), ("--tls-cert", "SPECPIPE_TLS_CERT", "c.pem", "c.pem"),
    ("--tls-key", "SPECPIPE_TLS_KEY", "k.pem", "k.pem"), ("--tls-ca", "SPECPIPE_TLS_CA", "ca.pem", "ca.pem"),
    ("--tls-coordinator-name", "SPECPIPE_TLS_COORDINATOR_NAME", "cn", "cn"),
    ("--tls-peer-names", "SPECPIPE_TLS_PEER_NAMES", "p1,p2", "p1,p2"),
    ("--tls-peer-template", "SPECPIPE_TLS_PEER_TEMPLATE", "s-{index}", "s-{index}")]


def _coordinator() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    CoordinatorConfig.add_arguments(p)
    return p


def _stage() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    StageConfig.add_arguments(p)
    return p


@pytest.mark.parametrize("build, table", [(_coordinator, COORDINATOR_ENV), (_stage, STAGE_ENV)],
                         ids=["coordinator", "stage"])
def test_environment_variable_names_and_flags_are_unchanged(monkeypatch, build, table):
    for flag, _, raw, value in table:
        assert getattr(build().parse_args([flag, raw]), flag[2:].replace("-", "_")) == value, flag
    for _, env, raw, _ in table:
        monkeypatch.setenv(env, raw)
    defaults = build().parse_args([])
    for flag, env, _, value in table:
        assert getattr(defaults, flag[2:].replace("-", "_")) == value, env


def test_served_model_name_and_generate_environment_are_unchanged(monkeypatch):
    monkeypatch.setenv("SPECPIPE_SERVED_MODEL_NAME", "x, y")
    assert CoordinatorConfig.from_args(_coordinator().parse_args(["--stages", "h:1"])).served_model_name == ("x", "y")
    monkeypatch.setenv("SPECPIPE_API_TLS_CA", "ca.pem")
    monkeypatch.setenv("SPECPIPE_API_TOKEN", "t")
    args = _generate_parser().parse_args(["generate", "hi"])
    assert (args.tls_ca, args.token) == ("ca.pem", "t")


def test_from_args_builds_every_field_from_the_environment(monkeypatch):
    """SPECPIPE_STAGES as a '{i}' template with SPECPIPE_NUM_STAGES, the rest as the deployment's variables."""
    for _, env, raw, _ in COORDINATOR_ENV:
        if "TLS" not in env:
            monkeypatch.setenv(env, raw)
    monkeypatch.setenv("SPECPIPE_STAGES", "s-{i}:1")
    cfg = CoordinatorConfig.from_env()
    assert cfg.stages == ("s-0:1", "s-1:1", "s-2:1") and cfg.stage_template == "s-{i}:1"
    assert (cfg.k8s_namespace, cfg.width, cfg.tree_policy, cfg.probe_timeout_s) == ("ns", 5, "layer", 12.5)


@pytest.mark.parametrize("field, value, message", [
    ("stage_hardware", "gpu", "unknown stage hardware 'gpu'; choose from shared, apart"),
    ("tree_policy", "wide", "unknown tree policy 'wide'; choose from layer, best-first, hybrid"),
    ("verify", "exact", "unknown verifier 'exact'; choose from match, rejection"),
])
def test_a_closed_set_setting_outside_its_set_is_refused_naming_the_choices(field, value, message):
    with pytest.raises(ValueError, match=message):
        CoordinatorConfig(stages=("h:1",), **{field: value})
