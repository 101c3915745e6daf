"""CoordinatorConfig: the coordinator process's settings, from CLI flags or SPECPIPE_* environment."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.config import add_tls_arguments
from services.tls import TLSFiles

from coordinator.core.schedulers.registry import SpecOptions
from coordinator.core.verify import VERIFIERS

_SPEC = SpecOptions()      # speculation defaults live in one place


@dataclass(frozen=True)
class CoordinatorConfig:
    stages: tuple[str, ...] = ()         # HOST:PORT of each stage, in pipeline order
    model: str = "default"               # for the tokenizer and chat template; same model as the stages
    host: str = "127.0.0.1"
    port: int = 50051
    method: str = "specpipe"             # default method
    draft: str = "quant"                 # draft source: quant | quant+ngram | model | ngram | none
    draft_model: str = ""                # HF folder of a separate draft model (draft = model)
    draft_device: str = "cpu"
    draft_dtype: str = "auto"            # of a separate draft model: auto = bfloat16 on CUDA, else float32
    draft_threads: int = 1               # torch threads of the coordinator (draft compute)
    width: int = _SPEC.width                           # nodes per tree layer / per step
    tree_policy: str = _SPEC.policy                    # layer | best-first | hybrid (measured best: see README)
    topk: int = _SPEC.topk                             # children proposed per node
    draft_rounds: int = _SPEC.draft_rounds             # specpipe: draft calls per step (run-ahead)
    sps_k: int = _SPEC.sps_k                           # sps: draft tokens per trip
    tree_nodes: int = _SPEC.tree_nodes                 # tree: nodes per trip
    tree_depth: int = _SPEC.tree_depth                 # tree: expansion rounds per trip
    tree_topk: int = _SPEC.tree_topk                   # tree: nodes expanded per round
    pipeinfer_run: int = _SPEC.pipeinfer_run           # pipeinfer: draft tokens per speculative run
    pipeinfer_min_prob: float = _SPEC.pipeinfer_min_prob  # pipeinfer: end runs where the draft is less sure
    node_budget: int = _SPEC.node_budget               # specpipe, cb-pp: rows per micro-batch, all requests
    prefill_chunk: int = _SPEC.prefill_chunk           # specpipe, cb-pp: prompt rows per micro-batch
    verify: str = _SPEC.verify                         # sampling verification: match | rejection
    max_active: int = 64                 # requests running at once
    max_queue: int = 256                 # requests waiting for admission; more are refused
    default_max_new_tokens: int = 128
    max_new_tokens_cap: int = 4096
    grace_s: float = 10.0
    max_message_mb: int = 256
    connect_timeout_s: float = 120.0
    recovery_timeout_s: float = 120.0    # how long a failed stage may take to come back (0 = fail at once)
    probe_interval_s: float = 2.0        # stage health checks (0 = off; broken streams are noticed anyway)
    probe_timeout_s: float = 10.0        # a stage that does not answer a check within this has failed
    metrics_port: int = 0                # Prometheus metrics (0 = off)
    health_port: int = 0                 # plaintext grpc.health.v1 only, for probes when the API uses TLS
    stage_template: str = ""             # '{i}' address template (DNS discovery); needed to scale
    k8s_statefulset: str = ""            # watch this StatefulSet and follow its replica count
    k8s_namespace: str = ""              # its namespace (default: the pod's own)
    tls_cert: str = ""                   # client certificate towards the stages (mutual TLS)
    tls_key: str = ""
    tls_ca: str = ""                     # CA the stages' certificates chain to
    api_tls_cert: str = ""               # TLS of the public API (plaintext without)
    api_tls_key: str = ""
    api_token: str = ""                  # bearer token the public API requires (none: open)
    http_port: int = 0                   # OpenAI-compatible HTTP API on host:http_port (0 = off)
    api_max_message_mb: int = 4          # largest request message on the public gRPC port (stage hops: max_message_mb)
    api_max_concurrent_rpcs: int = 512   # RPCs the public gRPC port serves at once; more are refused
    http_timeout_s: float = 30.0         # HTTP: headers and body must arrive within this
    max_per_client: int = 0              # running + queued requests per client (API token or peer; 0 = no limit)
    batch_timeout_s: float = 0.0         # a micro-batch not back within this is a pipeline failure (0 = derived)
    drain_timeout_s: float = 30.0        # a re-partition drains at most this long, then moves what still runs
    served_model_name: tuple[str, ...] = ()  # model ids the OpenAI API answers to (none: from --model)
    generation_config: str = "auto"      # OpenAI sampling defaults: auto (the model's) | none | FOLDER

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("the coordinator needs at least one stage address (--stages HOST:PORT,...)")
        for addr in self.stages:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"stage address {addr!r} is not HOST:PORT")
        if min(self.width, self.topk, self.draft_rounds, self.draft_threads, self.sps_k, self.tree_nodes,
               self.tree_depth, self.tree_topk,
               self.pipeinfer_run, self.node_budget, self.prefill_chunk, self.max_active) < 1:
            raise ValueError("width, topk, draft_rounds, draft_threads, sps_k, tree_nodes, tree_depth, tree_topk, "
                             "pipeinfer_run, "
                             "node_budget, prefill_chunk and max_active must be at least 1")
        if self.k8s_statefulset and "{i}" not in self.stage_template:
            raise ValueError("--k8s-statefulset needs --stages as a '{i}' template (the stages' DNS names)")
        TLSFiles(self.tls_cert, self.tls_key, self.tls_ca).require_mutual("the coordinator")
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
        if self.tree_policy not in ("layer", "best-first", "hybrid"):
            raise ValueError(f"unknown tree policy {self.tree_policy!r}; choose layer, best-first or hybrid")
        if self.api_max_message_mb < 1 or self.api_max_concurrent_rpcs < 1 or self.http_timeout_s <= 0:
            raise ValueError("api_max_message_mb and api_max_concurrent_rpcs must be at least 1, "
                             "http_timeout_s positive")
        if min(self.max_per_client, self.batch_timeout_s, self.drain_timeout_s) < 0:
            raise ValueError("max_per_client, batch_timeout_s and drain_timeout_s must be 0 or more")
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_cap:
            raise ValueError("default_max_new_tokens must be in [1, max_new_tokens_cap]")
        if any(not n or n != n.strip() or "," in n or len(n) > 256 for n in self.served_model_name):
            raise ValueError("served model names must be non-empty, without commas or surrounding spaces")
        if not self.generation_config:
            raise ValueError("generation_config must be auto, none or a folder")

    @property
    def tls(self) -> TLSFiles:
        return TLSFiles(self.tls_cert, self.tls_key, self.tls_ca)

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--stages", default=os.environ.get("SPECPIPE_STAGES", ""),
                       help="comma-separated HOST:PORT of the stages, in pipeline order; or a template with "
                            "'{i}' (e.g. the StatefulSet's headless DNS names REL-stage-{i}.REL-stage:50061) "
                            "expanded for i in 0..--num-stages-1")
        p.add_argument("--num-stages", type=int, default=int(os.environ.get("SPECPIPE_NUM_STAGES", "0")),
                       help="with a '{i}' template in --stages: how many stages")
        p.add_argument("--k8s-statefulset", default=os.environ.get("SPECPIPE_K8S_STATEFULSET", ""),
                       help="follow this stage StatefulSet: `kubectl scale` re-partitions the pipeline "
                            "(needs a '{i}' template in --stages)")
        p.add_argument("--k8s-namespace", default=os.environ.get("POD_NAMESPACE", ""),
                       help="namespace of --k8s-statefulset (default: this pod's)")
        add_tls_arguments(p)
        p.add_argument("--api-tls-cert", default=os.environ.get("SPECPIPE_API_TLS_CERT", ""),
                       help="certificate (PEM) of the public API; with --api-tls-key serves it over TLS")
        p.add_argument("--api-tls-key", default=os.environ.get("SPECPIPE_API_TLS_KEY", ""))
        p.add_argument("--api-token", default=os.environ.get("SPECPIPE_API_TOKEN", ""),
                       help="require 'authorization: Bearer TOKEN' on the public API (health checks exempt); "
                            "prefer the SPECPIPE_API_TOKEN environment variable")
        p.add_argument("--http-port", type=int, default=int(os.environ.get("SPECPIPE_HTTP_PORT", "0")),
                       help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on "
                            "this port, same host, TLS and token as the gRPC API (0 = off)")
        p.add_argument("--health-port", type=int, default=int(os.environ.get("SPECPIPE_HEALTH_PORT", "0")),
                       help="also serve grpc.health.v1 alone in plaintext on this port (kubelet probes when "
                            "the API requires TLS; 0 = off)")
        p.add_argument("--metrics-port", type=int, default=int(os.environ.get("SPECPIPE_METRICS_PORT", "0")),
                       help="serve Prometheus metrics on this port (0 = off)")
        p.add_argument("--model", default=os.environ.get("SPECPIPE_MODEL", cls.model))
        p.add_argument("--served-model-name", action="extend", nargs="+", default=None, metavar="NAME",
                       help="model id(s) the OpenAI API serves and lists, comma-separated or several "
                            "(default: --model: a hub id as given, a folder's name, 'default'; env "
                            "SPECPIPE_SERVED_MODEL_NAME)")
        p.add_argument("--generation-config",
                       default=os.environ.get("SPECPIPE_GENERATION_CONFIG", cls.generation_config),
                       help="OpenAI API sampling defaults (temperature, top_p, top_k, max_tokens) for "
                            "fields a request leaves unset: auto (the model's generation_config.json), "
                            "none (temperature 1, top_p 1), or a folder with a generation_config.json")
        p.add_argument("--host", default=os.environ.get("SPECPIPE_HOST", cls.host))
        p.add_argument("--port", type=int, default=int(os.environ.get("SPECPIPE_PORT", cls.port)))
        p.add_argument("--method", default=os.environ.get("SPECPIPE_METHOD", cls.method),
                       help="default method for requests that name none")
        add_spec_arguments(p)
        p.add_argument("--max-active", type=int, default=int(os.environ.get("SPECPIPE_MAX_ACTIVE", cls.max_active)),
                       help="requests running at once; more wait in the admission queue")
        p.add_argument("--max-queue", type=int, default=int(os.environ.get("SPECPIPE_MAX_QUEUE", cls.max_queue)),
                       help="requests waiting for admission; more are refused with RESOURCE_EXHAUSTED")
        p.add_argument("--default-max-new-tokens", type=int, default=cls.default_max_new_tokens)
        p.add_argument("--max-new-tokens-cap", type=int, default=cls.max_new_tokens_cap)
        p.add_argument("--grace-s", type=float, default=float(os.environ.get("SPECPIPE_GRACE_S", cls.grace_s)))
        p.add_argument("--recovery-timeout-s", type=float,
                       default=float(os.environ.get("SPECPIPE_RECOVERY_TIMEOUT_S", cls.recovery_timeout_s)),
                       help="after a stage failure, wait this long for it (or its replacement) to come back "
                            "and resume every stream; then end them with UNAVAILABLE (0: at once)")
        p.add_argument("--api-max-message-mb", type=int,
                       default=int(os.environ.get("SPECPIPE_API_MAX_MESSAGE_MB", cls.api_max_message_mb)),
                       help="largest request message the public gRPC API accepts (stage hops keep "
                            "--max-message-mb)")
        p.add_argument("--api-max-concurrent-rpcs", type=int,
                       default=int(os.environ.get("SPECPIPE_API_MAX_CONCURRENT_RPCS", cls.api_max_concurrent_rpcs)),
                       help="RPCs the public gRPC API serves at once; more are refused with RESOURCE_EXHAUSTED")
        p.add_argument("--http-timeout-s", type=float,
                       default=float(os.environ.get("SPECPIPE_HTTP_TIMEOUT_S", cls.http_timeout_s)),
                       help="HTTP API: a request's headers and body must arrive within this")
        p.add_argument("--max-per-client", type=int,
                       default=int(os.environ.get("SPECPIPE_MAX_PER_CLIENT", cls.max_per_client)),
                       help="requests one client (its API token, else its address) may have running or "
                            "queued; more are refused with RESOURCE_EXHAUSTED (0 = no limit)")
        p.add_argument("--batch-timeout-s", type=float,
                       default=float(os.environ.get("SPECPIPE_BATCH_TIMEOUT_S", cls.batch_timeout_s)),
                       help="a micro-batch that does not come back within this is a pipeline failure and is "
                            "recovered (0: derived from the measured round trips, at least 30 s)")
        p.add_argument("--drain-timeout-s", type=float,
                       default=float(os.environ.get("SPECPIPE_DRAIN_TIMEOUT_S", cls.drain_timeout_s)),
                       help="a re-partition waits this long for running requests to end, then moves the "
                            "rest onto the new pipeline (their streams go on)")
        p.add_argument("--probe-interval-s", type=float,
                       default=float(os.environ.get("SPECPIPE_PROBE_INTERVAL_S", cls.probe_interval_s)),
                       help="health-check every stage this often (0 = off)")
        p.add_argument("--probe-timeout-s", type=float,
                       default=float(os.environ.get("SPECPIPE_PROBE_TIMEOUT_S", cls.probe_timeout_s)),
                       help="a stage that does not answer a health check within this has failed")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "CoordinatorConfig":
        return cls(stages=stage_addresses(a.stages, a.num_stages), metrics_port=a.metrics_port,
                   health_port=a.health_port,
                   stage_template=a.stages if "{i}" in a.stages else "", k8s_statefulset=a.k8s_statefulset,
                   k8s_namespace=a.k8s_namespace, tls_cert=a.tls_cert, tls_key=a.tls_key, tls_ca=a.tls_ca,
                   api_tls_cert=a.api_tls_cert, api_tls_key=a.api_tls_key, api_token=a.api_token,
                   http_port=a.http_port, model=a.model, host=a.host, port=a.port, method=a.method,
                   default_max_new_tokens=a.default_max_new_tokens, max_new_tokens_cap=a.max_new_tokens_cap,
                   grace_s=a.grace_s, recovery_timeout_s=a.recovery_timeout_s, probe_interval_s=a.probe_interval_s,
                   probe_timeout_s=a.probe_timeout_s, max_active=a.max_active, max_queue=a.max_queue,
                   api_max_message_mb=a.api_max_message_mb, api_max_concurrent_rpcs=a.api_max_concurrent_rpcs,
                   http_timeout_s=a.http_timeout_s, max_per_client=a.max_per_client,
                   batch_timeout_s=a.batch_timeout_s, drain_timeout_s=a.drain_timeout_s,
                   served_model_name=served_names(a.served_model_name if a.served_model_name is not None
                                                  else [os.environ.get("SPECPIPE_SERVED_MODEL_NAME", "")]),
                   generation_config=a.generation_config, **spec_kwargs(a))

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


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    """Speculation options, shared by `specpipe coordinator`, `local` and `run`."""
    d = CoordinatorConfig
    p.add_argument("--draft", default=os.environ.get("SPECPIPE_DRAFT", d.draft),
                   choices=["quant", "quant+ngram", "model", "ngram", "none"],
                   help="draft source: int8 copy of the target (quant+ngram: plus prompt-lookup children), "
                        "a draft model folder, prompt lookup, none")
    p.add_argument("--draft-model", default=os.environ.get("SPECPIPE_DRAFT_MODEL", d.draft_model),
                   help="HF folder of the draft model (with --draft model); same tokenizer as the target")
    p.add_argument("--draft-device", default=os.environ.get("SPECPIPE_DRAFT_DEVICE", d.draft_device))
    p.add_argument("--draft-dtype", default=os.environ.get("SPECPIPE_DRAFT_DTYPE", d.draft_dtype),
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the --draft model (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--draft-threads", type=int, default=d.draft_threads)
    p.add_argument("--width", type=int, default=int(os.environ.get("SPECPIPE_WIDTH", d.width)),
                   help="tree nodes injected per step")
    p.add_argument("--tree-policy", default=os.environ.get("SPECPIPE_TREE_POLICY", d.tree_policy),
                   choices=["layer", "best-first", "hybrid"])
    p.add_argument("--topk", type=int, default=d.topk, help="children the draft proposes per node")
    p.add_argument("--draft-rounds", type=int, default=d.draft_rounds,
                   help="specpipe: draft calls per step; each expands the best not-yet-expanded nodes so a "
                        "micro-batch can span several tree layers (layer policy: 1)")
    p.add_argument("--sps-k", type=int, default=d.sps_k, help="sps: draft tokens per trip")
    p.add_argument("--tree-nodes", type=int, default=d.tree_nodes, help="tree: nodes per trip")
    p.add_argument("--tree-depth", type=int, default=d.tree_depth, help="tree: expansion rounds per trip")
    p.add_argument("--tree-topk", type=int, default=d.tree_topk, help="tree: nodes expanded per round")
    p.add_argument("--pipeinfer-run", type=int, default=d.pipeinfer_run, help="pipeinfer: draft tokens per run")
    p.add_argument("--pipeinfer-min-prob", type=float, default=d.pipeinfer_min_prob,
                   help="pipeinfer: end a run where the draft's probability falls below this")
    p.add_argument("--verify", default=os.environ.get("SPECPIPE_VERIFY", d.verify), choices=VERIFIERS,
                   help="sampling verification: match (the target's seeded sample decides; reproducible, "
                        "ships one token per row) or rejection (speculative sampling; ships distributions)")
    p.add_argument("--node-budget", type=int, default=int(os.environ.get("SPECPIPE_NODE_BUDGET", d.node_budget)),
                   help="specpipe, cb-pp: rows per micro-batch shared by all requests in it")
    p.add_argument("--prefill-chunk", type=int,
                   default=int(os.environ.get("SPECPIPE_PREFILL_CHUNK", d.prefill_chunk)),
                   help="specpipe, cb-pp: prompt rows per micro-batch, beside the node budget (a longer "
                        "prompt continues in the next micro-batch)")


def spec_kwargs(a: argparse.Namespace) -> dict:
    return dict(draft=a.draft, draft_model=a.draft_model, draft_device=a.draft_device, draft_dtype=a.draft_dtype,
                draft_threads=a.draft_threads, width=a.width, tree_policy=a.tree_policy, topk=a.topk,
                draft_rounds=a.draft_rounds,
                sps_k=a.sps_k, tree_nodes=a.tree_nodes, tree_depth=a.tree_depth, tree_topk=a.tree_topk,
                pipeinfer_run=a.pipeinfer_run,
                pipeinfer_min_prob=a.pipeinfer_min_prob, node_budget=a.node_budget, prefill_chunk=a.prefill_chunk,
                verify=a.verify)
