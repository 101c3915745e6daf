"""StageRunner: one micro-batch in, one micro-batch out (torch only, no gRPC).

Per step: admit each row against the request's NodeTable (dropping rows that are dead), allocate KV slots,
build the tree masks, run the shard's layers over the surviving rows, and — on the last stage — turn the
hidden states of the rows that want output into the target's token, greedy or sampled (and log-probabilities
when asked). A micro-batch always comes out, possibly with fewer rows, so the coordinator hears back about
every micro-batch it injected.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from common.batch import Control, MicroBatch, Segment, StageTrace
from services.kv_cache import KVCache
from services.model.shard import AttendPlan, LlamaShard
from services.nodes import ProtocolError
from common.sampling import sample, warp


class BatchError(ValueError):
    """The micro-batch as a whole is malformed (hidden tensor of the wrong dtype or shape)."""


@dataclass
class RunnerCounters:
    batches: int = 0
    rows_computed: int = 0
    rows_dropped: int = 0


class StageRunner:
    def __init__(self, shard: LlamaShard, stage_index: int = 0, kv_limit_bytes: int = 0) -> None:
        self.shard = shard
        self.stage_index = stage_index
        self.cache = KVCache(shard.cache_geometry(), limit_bytes=kv_limit_bytes)
        self.counters = RunnerCounters()

    # -- control plane ------------------------------------------------------------------------------
    def apply(self, msg: Control) -> None:
        """Apply commit, then prune, then release. Raises ProtocolError for impossible requests (then the
        request's state is as before the message)."""
        if not msg.request_id:
            raise ProtocolError("control message without request id")
        if msg.release:
            self.cache.release(msg.request_id)
            return
        kv = self.cache.get(msg.request_id, create=True)
        if kv is None:
            return   # already released: late control messages are harmless
        doomed = kv.table.check_control(msg.commit, msg.prune)      # all or nothing
        if msg.commit:
            kv.commit(msg.commit)
        if msg.prune:
            kv.prune(msg.prune, doomed)

    # -- data plane ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, batch: MicroBatch) -> MicroBatch:
        started = time.perf_counter()
        shard = self.shard
        rows_in = batch.rows
        self._check_hidden(batch, rows_in)
        out_segments: list[Segment] = []
        keep_rows: list[int] = []
        plans: list[AttendPlan] = []
        offset = 0
        repeated = {request_id: n for request_id, n in Counter(s.request_id for s in batch.segments).items() if n > 1}
        for seg in batch.segments:
            seg_offset, offset = offset, offset + seg.rows
            if seg.error:
                out_segments.append(seg)
                continue
            try:
                if seg.request_id in repeated:
                    raise ProtocolError(f"request {seg.request_id} has {repeated[seg.request_id]} segments in "
                                        "one micro-batch; its rows belong in one segment")
                kept_seg, kept_idx, slots, kv = self._admit(seg)
            except ProtocolError as e:
                self.cache.release(seg.request_id)
                out_segments.append(Segment.failed(seg.request_id, str(e), e.code, self.stage_index))
                continue
            if kept_idx:
                start = len(keep_rows)
                keep_rows.extend(seg_offset + i for i in kept_idx)
                plans.append(AttendPlan(kv, start, len(keep_rows),
                                        torch.tensor(slots, dtype=torch.int64, device=shard.device),
                                        kv.attention_mask(kept_seg.node_ids)))
            out_segments.append(kept_seg)

        computed = len(keep_rows)
        hidden_out: torch.Tensor | None = None
        argmax: list[int] = []
        logprobs: torch.Tensor | None = None
        if computed:
            positions = torch.tensor([p for s in out_segments for p in s.positions], dtype=torch.int64,
                                     device=shard.device)
            keep = torch.tensor(keep_rows, dtype=torch.int64, device=shard.device)
            if shard.is_first:
                tokens = torch.tensor([t for s in out_segments for t in s.token_ids], dtype=torch.int64,
                                      device=shard.device)
                hidden = shard.embed(tokens)
            else:
                hidden = batch.hidden.to(shard.device)[keep]
            hidden = shard(hidden, positions, plans)
            if shard.is_last:
                want = torch.tensor([w for s in out_segments for w in s.want_output], dtype=torch.bool,
                                    device=shard.device)
                if bool(want.any()):
                    argmax, logprobs = self._outputs(out_segments, shard.head(hidden[want]),
                                                     batch.return_logprobs)
            else:
                hidden_out = hidden
        elif not shard.is_last:
            hidden_out = torch.empty((0, shard.hidden_size), dtype=shard.dtype, device=shard.device)

        self.counters.batches += 1
        self.counters.rows_computed += computed
        self.counters.rows_dropped += rows_in - computed
        trace = batch.trace + [StageTrace(self.stage_index, rows_in, computed,
                                          (time.perf_counter() - started) * 1e3)]
        return MicroBatch(batch.batch_id, out_segments, hidden_out, argmax, logprobs,
                          batch.return_logprobs, trace)

    @staticmethod
    def _outputs(segments: list[Segment], logits: torch.Tensor,
                 return_logprobs: bool) -> tuple[list[int], torch.Tensor | None]:
        """The target's token for every output row — greedy, or drawn from the segment's warped
        distribution with the noise of the position it will take — and the (warped) log-probabilities
        when asked. logits: [output_rows, vocab]."""
        tokens: list[int] = []
        parts: list[torch.Tensor] = []
        offset = 0
        for seg in segments:
            n = sum(seg.want_output)
            if not n:
                continue
            rows, offset = logits[offset:offset + n], offset + n
            if seg.sampling.greedy and not return_logprobs:
                tokens += rows.argmax(dim=-1).tolist()
                continue
            lp = warp(rows, seg.sampling)
            tokens += sample(lp, seg.sampling, [p + 1 for p, w in zip(seg.positions, seg.want_output) if w])
            parts.append(lp)
        return tokens, (torch.cat(parts) if return_logprobs and parts else None)

    def _check_hidden(self, batch: MicroBatch, rows: int) -> None:
        shard = self.shard
        if shard.is_first:
            return
        h = batch.hidden
        if h is None and rows == 0:
            return
        if h is None:
            raise BatchError(f"stage {self.stage_index} needs hidden states, the micro-batch has none")
        if h.dtype != shard.dtype:
            raise BatchError(f"hidden states are {h.dtype}, this stage computes in {shard.dtype}")
        if tuple(h.shape) != (rows, shard.hidden_size):
            raise BatchError(f"hidden states have shape {list(h.shape)}, expected [{rows}, {shard.hidden_size}]")

    def _admit(self, seg: Segment):
        n = seg.rows
        if not seg.request_id:
            raise ProtocolError("segment without request id")
        if not (len(seg.parent_ids) == len(seg.positions) == len(seg.token_ids) == len(seg.want_output) == n):
            raise ProtocolError(f"segment of request {seg.request_id} has fields of different lengths")
        limit = self.shard.config.max_position_embeddings
        for p in seg.positions:
            if not 0 <= p < limit:
                raise ProtocolError(f"position {p} is outside [0, {limit})")
        if self.shard.is_first:
            vocab = self.shard.vocab_size
            for t in seg.token_ids:
                if not 0 <= t < vocab:
                    raise ProtocolError(f"token id {t} is outside the vocabulary [0, {vocab})")
        try:
            seg.sampling.check()
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        kv = self.cache.get(seg.request_id, create=True)
        if kv is None:   # late rows of an ended request; the coordinator ignores this if it is gone too
            raise ProtocolError(f"request {seg.request_id} was already released on stage {self.stage_index}")
        kept_idx: list[int] = []
        slots: list[int] = []
        for i in range(n):
            slot = kv.admit(seg.node_ids[i], seg.parent_ids[i], seg.positions[i])
            if slot is not None:
                kept_idx.append(i)
                slots.append(slot)
        return seg.select(kept_idx), kept_idx, slots, kv
