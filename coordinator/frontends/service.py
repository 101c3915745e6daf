"""The coordinator as a library: prompt -> validated request -> engine -> stream of text chunks.

Both the public gRPC API (coordinator/frontends/grpc_api.py) and `specpipe run` drive generation through
Coordinator.generate, so they behave the same.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import torch

from common.logs import get_logger
from common.process import after_load
from services.model.loader import resolve_model, stderr_log

from coordinator.config import CoordinatorConfig
from coordinator.core.admission import Admission, Overloaded
from coordinator.core.drafts.base import DraftSource
from coordinator.core.drafts.factory import build_draft
from coordinator.core.schedulers.registry import SpecOptions
from coordinator.core.stats import RequestStats
from coordinator.core.status import FinishReason, Status
from coordinator.core.text import PromptEncoder, TextStream
from coordinator.core.validate import Asked, InvalidRequest, Limits, check, check_prompt_size
from coordinator.core.vocabulary import METHODS
from coordinator.engine.engine import Engine
from coordinator.engine.live import Tokens
from coordinator.engine.pipeline import Pipelines
from coordinator.engine.recovery import Recovery
from coordinator.engine.scaling import release_held
from coordinator.engine.state import Unavailable
from coordinator.engine.transports.grpc import GrpcPipeline
from coordinator.frontends.prework import Prework
from coordinator.frontends.metrics import RequestMetrics, track
from coordinator.frontends.openai.defaults import GenerationDefaults, load_generation_defaults

log = get_logger(__name__)


@dataclass
class GenerateInput:
    prompt: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    raw: bool = False
    max_new_tokens: int | None = None
    method: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    request_id: str = ""          # chosen by the caller (the API binds it to its logs) or generated
    client: str = ""              # who asks (API token or peer), for --max-per-client ("": not counted)
    spec_overrides: dict | None = None   # SpecOptions fields to change for this request (benchmarks)


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None      # set on the last chunk only
    stats: RequestStats | None = None
    request_id: str = ""


class GenerationFailed(RuntimeError):
    def __init__(self, message: str, code: Status = Status.INTERNAL, retryable: bool = True) -> None:
        super().__init__(message)
        self.code = Status.of(code)
        self.retryable = retryable    # False: the same request will fail again (e.g. it can never fit)


@dataclass
class ModelParts:
    """What the coordinator loads from model folders alone, with no stage running: the tokenizer, the
    generation defaults and the draft. Loading takes seconds (the `quant` draft copies the whole target), so
    `specpipe run` and `local` load them while the stage processes start (`Coordinator.connect`)."""
    tokenizer: object | None
    eos_ids: frozenset[int]
    defaults: GenerationDefaults
    draft: DraftSource | None        # None for --draft none

    @classmethod
    def load(cls, config: CoordinatorConfig) -> ModelParts:
        """Blocking: run it in a thread. The cheap checks first (generation defaults, then the draft's folder
        and kind): a wrong --generation-config, --draft or --draft-model fails before seconds of loading."""
        defaults = load_generation_defaults(config.model, config.generation_config)
        torch.set_num_threads(config.draft_threads)
        draft = build_draft(config.draft, config.model, config.draft_model, config.draft_device, config.draft_dtype)
        tokenizer, eos_ids = load_tokenizer(config.model)
        return cls(tokenizer, eos_ids, defaults, draft)


class Coordinator:
    # the model's sampling defaults for the OpenAI API (generation_config.json; set by connect)
    generation_defaults: GenerationDefaults = GenerationDefaults()

    def __init__(self, config: CoordinatorConfig, pipeline: GrpcPipeline, engine: Engine,
                 encoder: PromptEncoder, eos_ids: frozenset[int], limits: Limits) -> None:
        self.config, self.engine = config, engine
        self.num_layers = pipeline.infos[0].num_layers_total
        self.encoder, self.eos_ids, self.limits = encoder, eos_ids, limits
        # tokenising, templates, JSON: bounded, on threads of their own (not the engine's executor)
        self.prework = Prework(limit=config.prework_limit, per_client=config.max_per_client,
                               held=engine.admission.held_by)
        # the one owner of the live pipeline; `open_pipeline` looked up at each call (tests replace it)
        self.pipelines: Pipelines[GrpcPipeline] = Pipelines(
            engine, pipeline, lambda addresses: self.open_pipeline(addresses), kv_slots, self.num_layers, config.tls)
        self.recovery: Recovery | None = None
        if config.recovery_timeout_s > 0:
            self.recovery = Recovery(self.pipelines, config.recovery_timeout_s)
            self.recovery.attach()
        track(engine)                       # the queue / active gauges read its admission state

    @property
    def pipeline(self) -> GrpcPipeline | None:
        """The open pipeline (None while it is replaced, or scaled to zero)."""
        return self.pipelines.current

    @property
    def draining(self) -> GrpcPipeline | None:
        """The pipeline a re-partition is draining (coordinator/engine/scaling.py)."""
        return self.pipelines.draining

    @property
    def closing(self) -> bool:
        return self.pipelines.closing

    def begin_close(self) -> None:
        """Stop being ready (a SIGTERM drain): health says NOT_SERVING and no re-partition starts; running
        requests go on."""
        self.pipelines.begin_close()

    @classmethod
    async def connect(cls, config: CoordinatorConfig, parts: ModelParts | None = None) -> Coordinator:
        """Open the pipeline and start the engine. `parts`: what `ModelParts.load(config)` read, when the
        caller loaded it beside the stages' start (`specpipe run` and `local` do); else it is loaded here."""
        # one coordinator owns a pipeline: what the stages hold now was left by a coordinator that died
        await release_held(list(config.stages), set(), config.tls, config.connect_timeout_s)
        pipeline = await _open(config, list(config.stages))
        info = pipeline.infos[0]
        if parts is None:
            try:
                parts = await asyncio.to_thread(ModelParts.load, config)
            except BaseException:
                await pipeline.close()           # (the stages release what this coordinator opened)
                raise
        tokenizer, eos_ids, defaults, draft = parts.tokenizer, parts.eos_ids, parts.defaults, parts.draft
        limits = Limits(info.vocab_size, info.max_position, config.default_max_new_tokens,
                        config.max_new_tokens_cap)
        spec = config.spec_options(draft)
        admission = Admission(config.max_active, config.max_queue, kv_slots(pipeline),
                              max_per_client=config.max_per_client)
        engine = Engine(pipeline, default_method=config.method, spec=spec, admission=admission,
                        batch_timeout_s=config.batch_timeout_s)
        await engine.start()
        frozen = after_load()         # in a program: the models' heap left out of every collection
        log.info("coordinator connected", stages=len(config.stages), vocab=info.vocab_size,
                 context=info.max_position, tokenizer=tokenizer is not None, kv_slots=admission.kv_slots,
                 frozen_objects=frozen)
        coordinator = cls(config, pipeline, engine, PromptEncoder(tokenizer), eos_ids, limits)
        coordinator.generation_defaults = defaults
        return coordinator

    async def warm_up(self, max_tokens: int, method: str = "", spec_overrides: dict | None = None) -> float:
        """Calibrate a method's cost rule (coordinator/core/sizing.py; default: the server's method and settings,
        else those a request with `spec_overrides` gets) before the first request: one generation of up to
        `max_tokens` tokens from a fixed prompt (never the user's), ended as soon as the rule has made its first
        decision (a trial of no speculation included). Returns the seconds it took (0: the method has no rule,
        `max_tokens` is 0, or the context has no room). Only what the rule learnt is kept: the request is
        cancelled and releases its KV like any other, and it is not counted in the request metrics.

        Why: a long-lived server learns over its first requests; a one-shot `specpipe run` would pay the whole
        exploration inside its one request (on a 2-core CPU whose draft is the whole target, ~1.5-1.9 s of
        speculating before no speculation was tried and kept: ~30 ms more between tokens than `pp`).
        """
        method = method or self.config.method
        spec = self._spec(spec_overrides)
        sizer = getattr(self.engine.scheduler(method, spec), "sizer", None)
        if sizer is None or max_tokens < 1:
            return 0.0
        started = time.perf_counter()
        try:
            prompt = self.encoder.encode(WARMUP_PROMPT, chat=False)
        except ValueError:                          # no tokenizer: any ids of the vocabulary will do
            prompt = [1 + i % (self.limits.vocab_size - 1) for i in range(24)]
        max_tokens = min(max_tokens, self.limits.max_position - len(prompt))
        if max_tokens < 1:
            return 0.0
        request_id, events = await self.engine.submit(prompt, max_new_tokens=max_tokens, method=method, spec=spec,
                                                      request_id=f"warm-up-{uuid.uuid4().hex[:8]}")
        try:
            while isinstance(await events.get(), Tokens):     # until it has finished, cancelled once decided
                if sizer.settled:
                    self.engine.cancel(request_id)
        finally:
            self.engine.cancel(request_id)
        seconds = time.perf_counter() - started
        log.info("cost rule warmed up", seconds=round(seconds, 2), choice=str(sizer.choice))
        return seconds

    async def close(self) -> None:
        self.begin_close()
        if self.recovery is not None:
            await self.recovery.close()
        await self.engine.close()
        await self.pipelines.close()
        self.prework.close()

    async def open_pipeline(self, addresses: list[str]) -> GrpcPipeline:
        return await _open(self.config, addresses)

    def prepare(self, inp: GenerateInput):
        """Validate and tokenize; raises InvalidRequest."""
        if inp.prompt and inp.prompt_token_ids:
            raise InvalidRequest("give prompt or prompt_token_ids, not both")
        check_prompt_size(inp.prompt, len(inp.prompt_token_ids), self.limits)
        if inp.prompt_token_ids:
            ids = list(inp.prompt_token_ids)
        elif inp.prompt:
            try:
                ids = self.encoder.encode(inp.prompt, chat=not inp.raw)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
        else:
            ids = []
        return check(ids, Asked(inp.max_new_tokens, inp.method, inp.temperature, inp.top_p, inp.top_k, inp.stop,
                                 inp.ignore_eos, inp.seed), self.limits, self.config.method, METHODS)

    def _spec(self, overrides: dict | None) -> SpecOptions | None:
        return replace(self.engine.spec, **overrides) if overrides else None

    async def generate(self, inp: GenerateInput) -> AsyncIterator[Chunk]:
        with RequestMetrics(inp.method or self.config.method) as metrics:   # outcome, latency, tokens
            async with aclosing(self._generate(inp, metrics)) as chunks:    # closed here, not by the GC
                async for chunk in chunks:
                    yield chunk

    async def _generate(self, inp: GenerateInput, metrics: RequestMetrics) -> AsyncIterator[Chunk]:
        try:                      # tokenising a long prompt is neither the loop's work nor the engine's threads';
            # token ids need checking only (linear, cheap): a flood of text work never refuses them
            params = await self.prework.run(inp.client, self.prepare, inp) if inp.prompt else self.prepare(inp)
        except Overloaded as e:
            raise GenerationFailed(str(e), Status.RESOURCE_EXHAUSTED) from None
        eos = frozenset() if params.ignore_eos else self.eos_ids
        try:
            request_id, events = await self.engine.submit(params.prompt_ids, params.max_new_tokens, params.method, eos,
                                                   request_id=inp.request_id, spec=self._spec(inp.spec_overrides),
                                                   sampling=params.sampling, client=inp.client)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        except Overloaded as e:
            raise GenerationFailed(str(e), Status.RESOURCE_EXHAUSTED, retryable=e.retryable) from None
        except Unavailable as e:
            raise GenerationFailed(str(e), Status.UNAVAILABLE) from None
        text = TextStream(self.encoder.decode, params.stop)
        done = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, Tokens):
                    if text.stopped:
                        continue
                    fed = text.feed(event.token_ids)
                    if fed.stopped:
                        self.engine.cancel(request_id, FinishReason.STOP)
                    kept = event.token_ids[:fed.kept]     # ids after the one completing a stop string are no output
                    metrics.tokens(len(kept))
                    yield Chunk(kept, fed.text, request_id=request_id)
                    continue
                fin = event
                done = True
                if fin.reason is FinishReason.ERROR:
                    raise GenerationFailed(fin.error, fin.error_code or Status.INTERNAL)
                reason = FinishReason.STOP if text.stopped else fin.reason
                stats = replace(fin.stats, prompt_tokens=len(params.prompt_ids))
                if text.stopped:                    # the engine also counted the ids after the stop string
                    stats.tokens = metrics.streamed
                if not params.sampling.greedy:
                    stats.seed = params.sampling.seed
                log.info("request finished", request_id=request_id, method=params.method, reason=reason,
                         tokens=stats.tokens, steps=stats.steps, tbt_ms=round(stats.tbt_ms, 2),
                         ttft_ms=round(stats.ttft_ms, 1))
                metrics.finished(reason, stats)
                yield Chunk([], text.flush(), reason, stats, request_id=request_id)
                return
        finally:
            if not done:
                self.engine.cancel(request_id)


WARMUP_PROMPT = ("A river starts as rain in the mountains, runs down through valleys and towns, and reaches the sea, "
                 "where it")


async def _open(config: CoordinatorConfig, addresses: list[str]) -> GrpcPipeline:
    pipeline = GrpcPipeline(addresses, config.max_message_mb * 1024 * 1024, config.connect_timeout_s, config.tls,
                            config.probe_interval_s, config.probe_timeout_s)
    await pipeline.start()
    return pipeline


def kv_slots(pipeline: GrpcPipeline) -> int | None:
    """KV slots per request budget: the smallest stage limit (None when no stage has one)."""
    slots = [i.kv_limit_bytes // i.kv_bytes_per_slot for i in pipeline.infos
             if i.kv_limit_bytes and i.kv_bytes_per_slot]
    return min(slots) if slots else None


def load_tokenizer(model: str) -> tuple[object | None, frozenset[int]]:
    """The model's tokenizer (None when the folder has none) and its end-of-sequence ids."""
    from transformers import AutoTokenizer, GenerationConfig

    ref = resolve_model(model, log=stderr_log)
    try:
        tok = AutoTokenizer.from_pretrained(ref)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no tokenizer: text prompts will be refused", model=ref, error=str(e).splitlines()[0])
        tok = None
    eos: set[int] = set()
    if tok is not None and tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    try:
        gen = GenerationConfig.from_pretrained(ref)
        ids = gen.eos_token_id
        eos.update([ids] if isinstance(ids, int) else list(ids or []))
    except (OSError, ValueError):
        pass
    return tok, frozenset(eos)
