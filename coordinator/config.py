"""CoordinatorConfig: the coordinator process's settings, from CLI flags or SPECPIPE_* environment."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CoordinatorConfig:
    stages: tuple[str, ...] = ()         # HOST:PORT of each stage, in pipeline order
    model: str = "default"               # for the tokenizer and chat template; same model as the stages
    host: str = "127.0.0.1"
    port: int = 50051
    method: str = "pp"                   # default method
    default_max_new_tokens: int = 128
    max_new_tokens_cap: int = 4096
    grace_s: float = 10.0
    max_message_mb: int = 256
    connect_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("the coordinator needs at least one stage address (--stages HOST:PORT,...)")
        for addr in self.stages:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"stage address {addr!r} is not HOST:PORT")
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_cap:
            raise ValueError("default_max_new_tokens must be in [1, max_new_tokens_cap]")

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        p.add_argument("--stages", default=os.environ.get("SPECPIPE_STAGES", ""),
                       help="comma-separated HOST:PORT of the stages, in pipeline order")
        p.add_argument("--model", default=os.environ.get("SPECPIPE_MODEL", cls.model))
        p.add_argument("--host", default=os.environ.get("SPECPIPE_HOST", cls.host))
        p.add_argument("--port", type=int, default=int(os.environ.get("SPECPIPE_PORT", cls.port)))
        p.add_argument("--method", default=os.environ.get("SPECPIPE_METHOD", cls.method),
                       help="default method for requests that name none")
        p.add_argument("--default-max-new-tokens", type=int, default=cls.default_max_new_tokens)
        p.add_argument("--max-new-tokens-cap", type=int, default=cls.max_new_tokens_cap)
        p.add_argument("--grace-s", type=float, default=float(os.environ.get("SPECPIPE_GRACE_S", cls.grace_s)))

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "CoordinatorConfig":
        stages = tuple(s.strip() for s in a.stages.split(",") if s.strip())
        return cls(stages=stages, model=a.model, host=a.host, port=a.port, method=a.method,
                   default_max_new_tokens=a.default_max_new_tokens, max_new_tokens_cap=a.max_new_tokens_cap,
                   grace_s=a.grace_s)

    @classmethod
    def from_env(cls) -> "CoordinatorConfig":
        p = argparse.ArgumentParser()
        cls.add_arguments(p)
        return cls.from_args(p.parse_args([]))
