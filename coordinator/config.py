"""CoordinatorConfig: the coordinator process's settings, from CLI flags or SPECPIPE_* environment.

Each setting is declared once, as a field made with `option` (common/options.py): its flag and environment
variable come from the field (`width` -> --width, SPECPIPE_WIDTH), and so do `from_args` and the schedulers'
SpecOptions (`config.spec_options(draft)`). The speculation fields are Speculation's
(coordinator/core/schedulers/registry.py), the internal hops' TLS files TLSOptions' (services/config.py).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.config import TLSOptions, tls_arguments
from common.options import add_flag, add_options, env_name, option, values
from common.tls import TLSFiles

from coordinator.core.schedulers.registry import Speculation
from coordinator.core.vocabulary import DRAFTS, STAGE_HARDWARE, TREE_POLICIES, VERIFIERS

DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class SpecConfig(Speculation):
    """The speculation options of `specpipe coordinator`, `local` and `run`: Speculation's settings and the
    draft source (listed first in --help)."""
    draft: str = option("quant", "draft source: int8 copy of the target (quant+ngram: plus prompt-lookup "
                                 "children), a draft model folder, prompt lookup, none", choices=DRAFTS)
    draft_model: str = option("", "HF folder of the draft model (with --draft model); same tokenizer as the target")
    draft_device: str = option("cpu")
    draft_dtype: str = option("auto", "dtype of the --draft model (auto: bfloat16 on CUDA, float32 on CPU)",
                              choices=DRAFT_DTYPES)
    draft_threads: int = option(1)       # torch threads of the coordinator (draft compute)


@dataclass(frozen=True)
class CoordinatorConfig(SpecConfig, TLSOptions):
    """The coordinator's settings; the options stand in the order of `specpipe coordinator --help`."""
    stages: tuple[str, ...] = option((), "comma-separated HOST:PORT of the stages, in pipeline order; or a "
                                         "template with '{i}' (e.g. the StatefulSet's headless DNS names "
                                         "REL-stage-{i}.REL-stage:50061) expanded for i in 0..--num-stages-1")
    k8s_statefulset: str = option("", "follow this stage StatefulSet: `kubectl scale` re-partitions the pipeline "
                                      "(needs a '{i}' template in --stages)")
    k8s_namespace: str = option("", "namespace of --k8s-statefulset (default: this pod's)", env="POD_NAMESPACE")
    api_tls_cert: str = option("", "certificate (PEM) of the public API; with --api-tls-key serves it over TLS")
    api_tls_key: str = option("")
    api_token: str = option("", "require 'authorization: Bearer TOKEN' on the public API (health checks exempt); "
                                "prefer the SPECPIPE_API_TOKEN environment variable")
    http_port: int = option(0, "serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on "
                               "this port, same host, TLS and token as the gRPC API (0 = off)")
    health_port: int = option(0, "also serve grpc.health.v1 alone in plaintext on this port (kubelet probes when "
                                 "the API requires TLS; 0 = off)")
    metrics_port: int = option(0, "serve Prometheus metrics on this port (0 = off)")
    model: str = option("default")       # for the tokenizer and chat template; same model as the stages
    served_model_name: tuple[str, ...] = option(
        (), "model id(s) the OpenAI API serves and lists, comma-separated or several (default: --model: a hub id "
            "as given, a folder's name, 'default'; env SPECPIPE_SERVED_MODEL_NAME)",
        env=None, action="extend", nargs="+", default=None, metavar="NAME")     # the env is read in from_args
    generation_config: str = option("auto", "OpenAI API sampling defaults (temperature, top_p, top_k, max_tokens) "
                                            "for fields a request leaves unset: auto (the model's "
                                            "generation_config.json), none (temperature 1, top_p 1), or a folder "
                                            "with a generation_config.json")
    host: str = option("127.0.0.1")
    port: int = option(50051)
    method: str = option("specpipe", "default method for requests that name none")
    max_active: int = option(64, "requests running at once; more wait in the admission queue")
    max_queue: int = option(256, "requests waiting for admission; more are refused with RESOURCE_EXHAUSTED")
    default_max_new_tokens: int = option(128)
    max_new_tokens_cap: int = option(4096)
    grace_s: float = option(10.0)
    recovery_timeout_s: float = option(120.0, "after a stage failure, wait this long for it (or its replacement) "
                                              "to come back and resume every stream; then end them with "
                                              "UNAVAILABLE (0: at once)")
    api_max_message_mb: int = option(4, "largest request message the public gRPC API accepts (stage hops keep "
                                        "--max-message-mb)")
    api_max_concurrent_rpcs: int = option(512, "Generate streams the public gRPC API serves at once, and requests "
                                               "the HTTP API serves at once; more are refused with "
                                               "RESOURCE_EXHAUSTED / 429 (health, and gRPC health Watch streams: "
                                               "--health-watch-per-client, --health-watch-max, are counted "
                                               "apart); the HTTP API holds twice this many connections at most")
    health_watch_per_client: int = option(8, "gRPC health Watch streams (public, no token) one client address may "
                                             "hold open, on the API and health ports together; one more is refused "
                                             "with RESOURCE_EXHAUSTED (Check always answers)")
    health_watch_max: int = option(128, "gRPC health Watch streams open at once from all clients; they come on top "
                                        "of --api-max-concurrent-rpcs, so they never shut out a Generate")
    http_timeout_s: float = option(30.0, "HTTP API: a request's headers and body must arrive within this")
    prework_limit: int = option(64, "requests being tokenised or parsed (chat templates, large JSON, /tokenize) at "
                                    "once, on threads of their own; more are refused with RESOURCE_EXHAUSTED / "
                                    "429 before their work (per client: --max-per-client)")
    stream_write_timeout_s: float = option(30.0, "a Generate stream (or an HTTP event stream) whose client takes "
                                                 "no message for this long (it stopped reading) ends "
                                                 "(DEADLINE_EXCEEDED) and its request is cancelled")
    max_per_client: int = option(0, "requests one client (its API token, else its address) may have running or "
                                    "queued; more are refused with RESOURCE_EXHAUSTED (0 = no limit)")
    batch_timeout_s: float = option(0.0, "a micro-batch that does not come back within this is a pipeline failure "
                                         "and is recovered (0: derived from the measured round trips, at least "
                                         "30 s)")
    drain_timeout_s: float = option(30.0, "a re-partition waits this long for running requests to end, then moves "
                                          "the rest onto the new pipeline (their streams go on)")
    probe_interval_s: float = option(2.0, "health-check every stage this often (0 = off)")
    probe_timeout_s: float = option(10.0, "a stage that does not answer a health check within this has failed")
    max_message_mb: int = 256            # stage hops' gRPC message limit (the public API: api_max_message_mb)
    connect_timeout_s: float = 120.0
    stage_template: str = ""             # '{i}' address template (DNS discovery, from --stages); needed to scale

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("the coordinator needs at least one stage address (--stages HOST:PORT,...)")
        for addr in self.stages:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"stage address {addr!r} is not HOST:PORT")
        if min(self.width, self.topk, self.draft_rounds) < 0:
            raise ValueError("width, topk and draft_rounds must be at least 1, or 0 (chosen by the cost rule)")
        if min(self.draft_threads, self.sps_k, self.tree_nodes, self.tree_depth, self.tree_topk,
               self.pipeinfer_run, self.node_budget, self.prefill_chunk, self.max_active) < 1:
            raise ValueError("draft_threads, sps_k, tree_nodes, tree_depth, tree_topk, pipeinfer_run, "
                             "node_budget, prefill_chunk and max_active must be at least 1")
        if self.k8s_statefulset and "{i}" not in self.stage_template:
            raise ValueError("--k8s-statefulset needs --stages as a '{i}' template (the stages' DNS names)")
        self.tls.require_mutual("the coordinator")
        TLSFiles(self.api_tls_cert, self.api_tls_key)
        if not 0 <= self.http_port <= 65535:
            raise ValueError("http_port must be in [0, 65535] (0 = no HTTP API)")
        if self.max_queue < 0:
            raise ValueError("max_queue must be 0 or more")
        if min(self.recovery_timeout_s, self.probe_interval_s) < 0 or self.probe_timeout_s <= 0:
            raise ValueError("recovery_timeout_s and probe_interval_s must be 0 or more, probe_timeout_s positive")
        if not 0.0 <= self.pipeinfer_min_prob < 1.0:
            raise ValueError("pipeinfer_min_prob must be in [0, 1)")
        if self.verify not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.verify!r}; choose from {', '.join(VERIFIERS)}")
        if self.tree_policy not in TREE_POLICIES:
            raise ValueError(f"unknown tree policy {self.tree_policy!r}; choose from {', '.join(TREE_POLICIES)}")
        if self.stage_hardware not in STAGE_HARDWARE:
            raise ValueError(f"unknown stage hardware {self.stage_hardware!r}; choose from {', '.join(STAGE_HARDWARE)}")
        if self.api_max_message_mb < 1 or self.api_max_concurrent_rpcs < 1 or self.http_timeout_s <= 0 or \
                self.stream_write_timeout_s <= 0:
            raise ValueError("api_max_message_mb and api_max_concurrent_rpcs must be at least 1, "
                             "http_timeout_s and stream_write_timeout_s positive")
        if self.prework_limit < 1:
            raise ValueError("prework_limit must be at least 1")
        if not 1 <= self.health_watch_per_client <= self.health_watch_max:
            raise ValueError("health Watch limits need 1 <= health_watch_per_client <= health_watch_max")
        if min(self.max_per_client, self.batch_timeout_s, self.drain_timeout_s) < 0:
            raise ValueError("max_per_client, batch_timeout_s and drain_timeout_s must be 0 or more")
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_cap:
            raise ValueError("default_max_new_tokens must be in [1, max_new_tokens_cap]")
        if any(not n or n != n.strip() or "," in n or len(n) > 256 for n in self.served_model_name):
            raise ValueError("served model names must be non-empty, without commas or surrounding spaces")
        if not self.generation_config:
            raise ValueError("generation_config must be auto, none or a folder")

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        add_options(p, cls, own=True, after={"stages": _num_stages_argument, "k8s_namespace": tls_arguments,
                                             "method": add_spec_arguments})

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "CoordinatorConfig":
        names = a.served_model_name if a.served_model_name is not None else \
            [os.environ.get(env_name("served_model_name"), "")]       # a flag replaces the environment's names
        return cls(**values(cls, a) | dict(stages=stage_addresses(a.stages, a.num_stages),
                                           stage_template=a.stages if "{i}" in a.stages else "",
                                           served_model_name=served_names(names)))

    @classmethod
    def from_env(cls) -> "CoordinatorConfig":
        p = argparse.ArgumentParser()
        cls.add_arguments(p)
        return cls.from_args(p.parse_args([]))


def served_names(values: list[str]) -> tuple[str, ...]:
    """--served-model-name values, each possibly comma-separated, in order, without repeats.

    >>> served_names(["a,b", "c", "a"])
    ('a', 'b', 'c')
    """
    names = (n.strip() for v in values for n in v.split(","))
    return tuple(dict.fromkeys(n for n in names if n))


def stage_addresses(spec: str, num_stages: int = 0) -> tuple[str, ...]:
    """Stage discovery: a static comma-separated list, or a template with '{i}' expanded num_stages times.

    >>> stage_addresses("sp-stage-{i}.sp-stage:50061", 2)
    ('sp-stage-0.sp-stage:50061', 'sp-stage-1.sp-stage:50061')
    """
    if "{i}" in spec:
        if num_stages < 1:
            raise ValueError("a '{i}' template in --stages needs --num-stages of at least 1")
        return tuple(spec.strip().replace("{i}", str(i)) for i in range(num_stages))
    return tuple(s.strip() for s in spec.split(",") if s.strip())


def _num_stages_argument(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--num-stages", 0, "with a '{i}' template in --stages: how many stages", type=int,
             env=env_name("num_stages"))


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    """Speculation options, shared by `specpipe coordinator`, `local` and `run`."""
    add_options(p, SpecConfig, own=True)         # the draft source
    add_options(p, Speculation)


def spec_kwargs(a: argparse.Namespace) -> dict:
    """The speculation options parsed by add_spec_arguments, as CoordinatorConfig keywords."""
    return values(SpecConfig, a)
