"""Schedulers are sans-IO state machines (docs/architecture.md, "Steps and statistics").

A scheduler is fed events — a request arrived (`add`), a micro-batch came back from the last stage
(`on_result`), a request was cancelled (`cancel`) — and hands back actions (`poll`): inject a micro-batch
into stage 0, broadcast a control message to every stage, emit committed tokens, finish a request. It never
sleeps, reads a clock or touches a socket, so the same scheduler runs in-process, over gRPC, or under a
simulated clock.

Steps are counted on a logical pipeline clock: a micro-batch injected at step t comes back at step t + S;
injections happen at most one per step. A request's `steps` run from its first injection to its last
result, so plain pipelining of one request needs S steps per token and the ideal SpecPipe needs one.
`decode_tokens_per_step` counts from the first committed token to the last (the first trip excluded): the
quantity time between tokens follows.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from common.batch import Control, MicroBatch, Segment
from common.sampling import GREEDY, Sampling

from coordinator.core.results import Sent, check
from coordinator.core.stats import RequestStats, SpecCounters
from coordinator.core.status import FinishReason, Status


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    sampling: Sampling = GREEDY


@dataclass
class Inject:
    batch: MicroBatch


@dataclass
class Broadcast:
    control: Control


@dataclass
class Emit:
    request_id: str
    token_ids: list[int]


@dataclass
class Finish:
    """A request ended: what a scheduler hands the engine, and (its id the client's, its stats the whole
    request's) the engine's last event on the request's queue (coordinator/engine/live.py)."""
    request_id: str
    reason: FinishReason
    stats: RequestStats
    error: str = ""
    error_code: Status = Status.OK      # with reason ERROR: the gRPC status the request fails with

    def __post_init__(self) -> None:    # plain strings and numbers become members (ValueError if not one)
        self.reason = FinishReason(self.reason)
        self.error_code = Status.of(self.error_code)


Action = Inject | Broadcast | Emit | Finish


@dataclass
class RequestState:
    request: Request
    next_node: int = 0
    committed: list[int] = field(default_factory=list)      # node ids of the committed chain
    generated: list[int] = field(default_factory=list)      # generated token ids
    in_flight: int = 0                                      # micro-batches of this request in the pipeline
    first_step: int | None = None
    last_step: int = 0
    first_commit_step: int | None = None                    # step of the first committed token
    last_commit_step: int = 0
    stats: RequestStats = field(default_factory=RequestStats)   # its counters (steps and tokens at the end)

    @property
    def root_parent(self) -> int:
        """Parent of the last committed node (-1 when it is a one-token prompt)."""
        return self.committed[-2] if len(self.committed) > 1 else -1

    def new_node(self, count: int = 1) -> int:
        """`count` fresh consecutive node ids; returns the first."""
        self.next_node += count
        return self.next_node - count

    @property
    def spec(self) -> SpecCounters:
        """The speculative methods' counters (created on first use)."""
        if self.stats.spec is None:
            self.stats.spec = SpecCounters()
        return self.stats.spec


class Scheduler(ABC):
    name = "base"
    # deferred draft work: False -> `work()` in line; True -> `draft_job()` hands out jobs that run beside the
    # scheduler and come back through `draft_done(job, results)`, or `draft_next(job, results)`, which makes
    # the next job in the same call (coordinator/core/drafts/job.py)
    drafts_beside = False

    def __init__(self, num_stages: int) -> None:
        if num_stages < 1:
            raise ValueError("num_stages must be at least 1")
        self.num_stages = num_stages
        self.requests: dict[str, RequestState] = {}
        self._actions: list[Action] = []
        self._next_batch = 0
        self._batches: dict[int, tuple[int, list[str], Sent]] = {}   # batch id -> (inject step, request ids,
        #                                                               what it carried)
        self.stray_results = 0       # results for no batch in flight (dropped)
        self.invalid_results = 0     # results that could not answer their batch (its requests failed)
        self.last_fault = ""         # why the last of them could not
        self._clock = 0              # logical step of the latest event
        self._result_batch = -1      # id of the micro-batch being handled by on_result
        self._last_inject = -1

    # -- events -------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} is already running")
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        state = RequestState(request)
        self.requests[request.request_id] = state
        self._start(state)

    def on_result(self, batch: MicroBatch) -> None:
        """A micro-batch came back. It is checked against what was sent (coordinator/core/results.py) before
        anything of it is applied: a result for no batch in flight is dropped (`stray_results`); a result
        that cannot answer its batch fails the batch's requests (INTERNAL, the stage's fault) and changes
        nothing else."""
        entry = self._batches.pop(batch.batch_id, None)
        if entry is None:
            self.stray_results += 1
            return
        inject_step, request_ids, sent = entry
        fault = check(sent, batch)
        if fault:
            self.invalid_results += 1
            self.last_fault = fault
            batch = MicroBatch(batch.batch_id, [Segment.failed(
                s.request_id, f"the last stage answered micro-batch {batch.batch_id} wrongly: {fault}",
                Status.INTERNAL, -1) for s in sent.segments])
        self._result_batch = batch.batch_id
        self._clock = max(self._clock, inject_step + self.num_stages)
        share = 1 / len(request_ids) if request_ids else 0.0
        for request_id in request_ids:
            state = self.requests.get(request_id)
            if state is not None:
                state.in_flight -= 1
                state.last_step = self._clock
                # a micro-batch shared by n requests counts 1/n to each, so sums over requests are totals
                s = state.stats
                s.batches += share
                s.result_bytes += batch.wire_bytes * share
                for t in batch.trace:
                    c = s.stage(t.stage)
                    c.rows_computed += t.rows_computed * share
                    c.rows_dropped += (t.rows_in - t.rows_computed) * share
                    c.compute_ms += t.compute_ms * share
                    c.wait_ms += t.wait_ms * share
        offset = 0
        for seg in batch.segments:
            n_out = sum(seg.want_output)
            outputs = batch.argmax[offset:offset + n_out]
            logprobs = batch.logprobs[offset:offset + n_out] if batch.logprobs is not None else None
            offset += n_out
            state = self.requests.get(seg.request_id)
            if state is None:
                continue
            if seg.error:
                where = f"stage {seg.error_stage}: " if seg.error_stage >= 0 else ""   # -1: the coordinator's
                self._finish(state, FinishReason.ERROR, error=where + seg.error,
                             error_code=seg.error_code or Status.INTERNAL)
                continue
            self._on_segment(state, seg, outputs, logprobs)

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        state = self.requests.get(request_id)
        if state is not None:
            self._finish(state, reason)

    def charge_control(self, ms: float) -> None:
        """The coordinator's own time of the last call (measured by the caller: coordinator/engine/meter.py),
        shared by the requests running (`control_ms` in their stats)."""
        if ms > 0 and self.requests:
            share = ms / len(self.requests)
            for state in self.requests.values():
                state.stats.control_ms += share

    @property
    def has_work(self) -> bool:
        """True when the scheduler has deferred compute (e.g. draft expansions) for `work()`."""
        return False

    def work(self) -> None:
        """Do deferred compute. Callers (the engine, the in-process and simulated pipelines) call it after
        draining actions, while `has_work`, so that micro-batches already decided leave before the draft runs."""

    def poll(self) -> list[Action]:
        actions, self._actions = self._actions, []
        return actions

    @property
    def in_flight(self) -> int:
        return len(self._batches)

    @property
    def kv_rows_per_batch(self) -> int:
        """Most uncommitted rows of one request per micro-batch (for KV admission)."""
        return 1

    # -- for subclasses -----------------------------------------------------------------------------
    @abstractmethod
    def _start(self, state: RequestState) -> None:
        """A request arrived: broadcast its commits and inject its first micro-batch(es)."""

    @abstractmethod
    def _on_segment(self, state: RequestState, seg: Segment, outputs: list[int],
                    logprobs: torch.Tensor | None) -> None:
        """The last stage returned `seg` (rows that survived), the target's token of each output row
        (greedy, or drawn with the request's sampling) and, when the micro-batch asked, the rows' warped
        log-probabilities [output_rows, vocab]."""

    def _wants_logprobs(self, segments: list[Segment]) -> bool:
        """The last stage must ship the rows' distributions (rejection verification)."""
        return False

    def _inject(self, segments: list[Segment], return_logprobs: bool = False) -> int:
        return_logprobs = return_logprobs or self._wants_logprobs(segments)
        batch_id = self._next_batch
        self._next_batch += 1
        step = max(self._clock, self._last_inject + 1)
        self._last_inject = step
        request_ids = [s.request_id for s in segments]
        for seg in segments:
            seg.sampling = self.requests[seg.request_id].request.sampling
        batch = MicroBatch(batch_id, segments, return_logprobs=return_logprobs)
        self._batches[batch_id] = (step, request_ids, Sent.of(batch))
        for request_id in request_ids:
            state = self.requests[request_id]
            state.in_flight += 1
            if state.first_step is None:
                state.first_step = step
        self._actions.append(Inject(batch))
        return batch_id

    def _broadcast(self, control: Control) -> None:
        self._actions.append(Broadcast(control))

    def _commit(self, state: RequestState, node_ids: list[int], tokens: list[int],
                prune: list[int] | tuple[int, ...] = ()) -> bool:
        """Commit generated tokens (their nodes), emit them, broadcast the commit (with any prunes), and
        finish the request when it is done. Returns True while the request goes on."""
        limit = state.request.max_new_tokens - len(state.generated)
        node_ids, tokens = node_ids[:limit], tokens[:limit]
        for i, t in enumerate(tokens):
            if t in state.request.eos_ids:
                node_ids, tokens = node_ids[:i + 1], tokens[:i + 1]
                break
        state.committed.extend(node_ids)
        state.generated.extend(tokens)
        if tokens:
            if state.first_commit_step is None:
                state.first_commit_step = self._clock
            state.last_commit_step = self._clock
            self._actions.append(Emit(state.request.request_id, tokens))
        if tokens and tokens[-1] in state.request.eos_ids:
            self._finish(state, FinishReason.EOS)
            return False
        if len(state.generated) >= state.request.max_new_tokens:
            self._finish(state, FinishReason.LENGTH)
            return False
        self._broadcast(Control(state.request.request_id, commit=node_ids, prune=list(prune)))
        return True

    def _commit_next(self, state: RequestState, outputs: list[int]) -> Segment | None:
        """Plain decoding (pp, cb-pp): commit the target's token after the committed chain; returns the row
        that carries it into the pipeline next, or None when the request finished (or got no output)."""
        if not outputs:
            return None
        token, parent = outputs[-1], state.committed[-1]
        node, position = state.new_node(), len(state.committed)
        if not self._commit(state, [node], [token]):
            return None
        return Segment(state.request.request_id, [node], [parent], [position], [token], [True])

    def _finish(self, state: RequestState, reason: FinishReason, error: str = "", error_code: int = 0) -> None:
        request_id = state.request.request_id
        del self.requests[request_id]
        self._broadcast(Control(request_id, release=True))
        self._actions.append(Finish(request_id, reason, self.stats(state), error, error_code))

    def stats(self, state: RequestState) -> RequestStats:
        """The request's stats as it ends: its counters, with its steps and tokens."""
        s = state.stats
        s.steps = state.last_step - (state.first_step or 0)
        s.tokens = len(state.generated)
        # from the first committed token to the last: what time between tokens follows
        s.decode_steps = state.last_commit_step - (state.first_commit_step or 0)
        return s
