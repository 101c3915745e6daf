"""StageConfig: everything one stage process needs, from CLI flags or environment (SPECPIPE_* vars); TLSOptions,
the internal hops' TLS files it shares with the coordinator."""
from __future__ import annotations

import argparse
import re
import socket
from dataclasses import dataclass

import torch

from common.options import add_flag, add_options, env_name, option, values
from common.tls import COORDINATOR_NAME, STAGE_NAME, PeerNames, TLSFiles

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
MiB = 1024 * 1024


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}") from None


def parse_stage_time(spec: str) -> tuple[float, float]:
    """'A' or 'A+B' -> (A ms per step, B ms per row).

    >>> parse_stage_time("120+0.5")
    (120.0, 0.5)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:\+\s*(\d+(?:\.\d+)?))?\s*", spec or "0")
    if not m:
        raise ValueError(f"stage time {spec!r} is not of the form A or A+B (milliseconds)")
    return float(m.group(1)), float(m.group(2) or 0.0)


DRAFT_TIME_SHARE = 0.3   # the simulated draft's default cost: this share of the stage-time model


def parse_draft_time(spec: str | None, stage_time: tuple[float, float]) -> tuple[float, float] | tuple[str, float]:
    """The simulated clock's draft-time model (`--draft-time-ms`):

    - '' or None (the default): DRAFT_TIME_SHARE x the stage-time model, as (A ms per draft call, B ms per row);
    - 'A' or 'A+B': each draft model call costs A ms plus B ms per row it computes -> (A, B);
    - 'measured': the draft's measured CPU time -> ('measured', 1.0).

    >>> parse_draft_time("", (120.0, 0.25))
    (36.0, 0.075)
    >>> parse_draft_time("5+0.5", (120.0, 0.0))
    (5.0, 0.5)
    """
    text = (spec or "").strip()
    if not text:
        return round(DRAFT_TIME_SHARE * stage_time[0], 9), round(DRAFT_TIME_SHARE * stage_time[1], 9)
    if text.lower() == "measured":
        return "measured", 1.0
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(?:\+\s*(\d+(?:\.\d+)?))?", text)
    if not m:
        raise ValueError(f"draft time {spec!r} is not of the form A or A+B (ms per draft call + ms per row it "
                         "computes, e.g. 36+0.075) or 'measured'")
    return float(m.group(1)), float(m.group(2) or 0.0)


def describe_draft_time(spec: str | None, model: tuple[float, float] | tuple[str, float]) -> str:
    """One line for results.json: how the simulated clock charged the draft."""
    if model[0] == "measured":
        return "measured CPU" if model[1] == 1.0 else f"measured CPU x {model[1]:g}"
    origin = f"{DRAFT_TIME_SHARE:g} x stage time" if not (spec or "").strip() else f"--draft-time-ms {spec.strip()}"
    return f"modelled {model[0]:g} ms per draft call + {model[1]:g} ms per row ({origin})"


def check_device(device: str) -> str:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
    torch.device(device)   # raises on nonsense
    return device


@dataclass(frozen=True, kw_only=True)
class TLSOptions:
    """Mutual TLS on the internal hops (PEM files), for the stage and the coordinator alike."""
    tls_cert: str = option("", "this service's certificate (PEM); with --tls-key turns TLS on")
    tls_key: str = option("", "its private key (PEM)")
    tls_ca: str = option("", "CA bundle peers must chain to; a stage needs it with --tls-cert and refuses clients "
                             "without a certificate from it")

    @property
    def tls(self) -> TLSFiles:
        return TLSFiles(self.tls_cert, self.tls_key, self.tls_ca)


@dataclass(frozen=True)
class StageConfig(TLSOptions):
    """One stage's settings; each `option` is also a flag and a SPECPIPE_* variable (common/options.py), in
    the order of `specpipe stage --help`."""
    model: str = option("default", "Hugging Face folder or hub id; 'default' = embedded SmolLM2-135M-Instruct")
    stage: int = option(0, "this stage's index, or 'auto': the ordinal at the end of the host name (a "
                           "StatefulSet pod NAME-3 is stage 3)", type=str)
    num_stages: int = option(1)
    host: str = option("127.0.0.1")
    port: int = option(0)               # 0: pick a free port (printed and written to port_file)
    port_file: str = option("", argparse.SUPPRESS, env=None)     # write the bound port here once serving
    parent_pid: int = option(0, "drain and exit, as on SIGTERM, once the process with this pid is no longer "
                                "this one's parent (it died); 0 = never. `specpipe local`, `run` and `bench` "
                                "set it for the stages they start", env=None)
    next_hop: str = option("", "HOST:PORT of the next stage (empty on the last stage); '{next}' in it is replaced "
                               "by this stage's index + 1, and ignored on the last stage")
    dtype: str = option("float32", choices=sorted(DTYPES))
    device: str = option("cpu")
    threads: int = option(1)            # torch intra-op threads
    stage_time_ms: str = option("0", "emulated stage time: at least A ms per step plus B ms per row ('A' or 'A+B')")
    grace_s: float = option(10.0)       # drain time on SIGTERM
    kv_limit_mb: float = option(0.0, "K/V cache memory for all requests together (0 = no limit); a request that "
                                     "would pass it fails with RESOURCE_EXHAUSTED, and the coordinator admits "
                                     "requests only while their reserved KV fits")
    health_port: int = option(0, "also serve grpc.health.v1 alone in plaintext on this port (kubelet probes when "
                                 "the main port requires TLS; 0 = off)")
    metrics_port: int = option(0, "serve Prometheus metrics on this port, on --host (0 = off)")
    # with TLS on, which peers a stage serves, by the names in their certificates (common name or SAN)
    tls_coordinator_name: str = option(COORDINATOR_NAME, "the coordinator's certificate name: the only peer "
                                       f"allowed Configure, Results and Control (default {COORDINATOR_NAME})")
    tls_peer_names: tuple[str, ...] = option((STAGE_NAME,), "comma-separated certificate names of the stages "
                                             f"allowed Forward besides the coordinator (default {STAGE_NAME}); "
                                             "unused with --tls-peer-template")
    tls_peer_template: str = option("", "one certificate per stage: the stages' certificate name with {index} for "
                                        "the index, e.g. specpipe-stage-{index}; stage i then accepts Forward only "
                                        "from the name of index i-1 (stage 0 only from the coordinator), following "
                                        "the index Configure gives it")
    first_layer: int = -1               # -1: even split of the model's layers over num_stages (flag --layers A:B)
    last_layer: int = -1                # exclusive; -1: even split
    max_message_mb: int = 256           # gRPC send/receive limit

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError("num_stages must be at least 1")
        if not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage {self.stage} is outside [0, {self.num_stages})")
        if (self.first_layer < 0) != (self.last_layer < 0):
            raise ValueError("give both first_layer and last_layer, or neither")
        if self.threads < 1:
            raise ValueError("threads must be at least 1")
        if self.kv_limit_mb < 0:
            raise ValueError("kv_limit_mb must be 0 (no limit) or more")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port {self.metrics_port} is not a port (0 = off)")
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port {self.health_port} is not a port (0 = off)")
        self.tls.require_mutual(f"stage {self.stage}")     # missing files, a lone cert, a cert without a CA
        names = PeerNames.parse(self.tls_coordinator_name, self.tls_peer_names, self.tls_peer_template,
                                self.stage)                                      # raises for a bad name
        object.__setattr__(self, "tls_peer_names", names.peers)       # "a,b" or a list -> ("a", "b")
        object.__setattr__(self, "tls_peer_template", names.predecessor)
        parse_dtype(self.dtype)
        parse_stage_time(self.stage_time_ms)
        check_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def peer_names(self) -> PeerNames | None:
        """Who may call which RPC (common/tls.py), or None with TLS off (no identities to check). With
        `tls_peer_template` it depends on `stage`: rebuild it when Configure moves the stage."""
        if not self.tls.enabled:
            return None
        return PeerNames(self.tls_coordinator_name, self.tls_peer_names, self.tls_peer_template, self.stage)

    @property
    def stage_time(self) -> tuple[float, float]:
        return parse_stage_time(self.stage_time_ms)

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        add_options(p, cls, own=True, after={"num_stages": _layers_argument, "metrics_port": tls_arguments})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "StageConfig":
        first, last = -1, -1
        if args.layers:
            try:
                first, last = (int(x) for x in args.layers.split(":"))
            except ValueError:
                raise ValueError(f"--layers {args.layers!r} is not of the form A:B") from None
        stage = stage_index(args.stage)
        # a pod added by `kubectl scale` starts with the chart's old depth: it takes the last place until
        # the coordinator re-partitions the pipeline (Stage/Configure)
        num_stages = max(args.num_stages, stage + 1) if args.stage == "auto" else args.num_stages
        next_hop = args.next_hop
        if "{next}" in next_hop:
            next_hop = next_hop.replace("{next}", str(stage + 1)) if stage + 1 < num_stages else ""
        return cls(**values(cls, args) | dict(
            stage=stage, num_stages=num_stages, first_layer=first, last_layer=last, next_hop=next_hop,
            tls_coordinator_name=args.tls_coordinator_name.strip(),
            tls_peer_names=tuple(args.tls_peer_names.split(",")), tls_peer_template=args.tls_peer_template.strip()))

    @classmethod
    def from_env(cls) -> "StageConfig":
        p = argparse.ArgumentParser()
        cls.add_arguments(p)
        return cls.from_args(p.parse_args([]))


def tls_arguments(p: argparse.ArgumentParser) -> None:
    """--tls-cert, --tls-key, --tls-ca (SPECPIPE_TLS_*), for the stage and the coordinator."""
    add_options(p, TLSOptions)


def _layers_argument(p: argparse.ArgumentParser) -> None:
    """--layers A:B, read into first_layer and last_layer by StageConfig.from_args."""
    add_flag(p, "--layers", "", "layer range A:B held by this stage (default: even split)", env=env_name("layers"))


def stage_index(value: str, hostname: str | None = None) -> int:
    """'3' -> 3; 'auto' -> the ordinal that ends the host name (Kubernetes StatefulSet pods).

    >>> stage_index("auto", hostname="specpipe-stage-12")
    12
    """
    if value != "auto":
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"--stage {value!r} is neither an index nor 'auto'") from None
    host = hostname if hostname is not None else socket.gethostname()
    m = re.search(r"-(\d+)$", host)
    if not m:
        raise ValueError(f"--stage auto: the host name {host!r} does not end with -<ordinal>")
    return int(m.group(1))

