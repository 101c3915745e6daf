"""Model drafts: a full copy of a small model (or of the target, int8-quantized) run through the same
StageRunner as the stages, so the draft's KV cache holds nodes and follows commits and prunes.

- `quant`: on a CPU the target with every Linear's weight in int8 and bfloat16 activations (int8.py: ~2x
  cheaper than the fp32 target there, 96% top-1 agreement with SmolLM2-135M); on a GPU a bfloat16 copy.
- `model`: a separate draft model folder (same tokenizer as the target, checked at start).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from common.batch import Control, MicroBatch, Segment
from services.model.shard import LlamaShard, load_causal_lm
from common.sampling import GREEDY, Sampling, gumbel, warp
from services.runner import StageRunner

from coordinator.core.drafts.base import DraftNode, DraftSource, Proposals
from coordinator.core.drafts.int8 import quantize_weights_int8
from coordinator.core.proposals import ProposalRows


class ModelDraft(DraftSource):
    chains = True       # a distinct top-k per node

    def __init__(self, model: nn.Module, name: str = "model", prefill_chunk: int = 256) -> None:
        super().__init__()
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        self.name, self.prefill_chunk = name, prefill_chunk     # prompt rows per prefill call
        self.runner = StageRunner(LlamaShard(model, 0, model.config.num_hidden_layers), stage_index=-1)
        self._batch = 0
        self.sampling: dict[str, tuple[Sampling, bool]] = {}       # request -> (sampling, keep_q)
        self._q: dict[tuple[str, int], torch.Tensor] = {}          # (request, node) -> [vocab] warped log q

    def begin(self, request_id: str, prompt_ids: list[int], sampling: Sampling = GREEDY,
              keep_q: bool = False) -> None:
        """Prefill all prompt tokens but the last; the scheduler expands the last one."""
        error = self.begin_many([(request_id, prompt_ids, sampling, keep_q)])[0]
        if error is not None:
            raise error

    def begin_many(self, jobs: list[tuple[str, list[int], Sampling, bool]],
                   rows: dict[str, tuple[int, int]] | None = None) -> list[Exception | None]:
        """Prefill the prompts of every request in `jobs` (each without its last token), in calls of at most
        `prefill_chunk` rows: a long prompt takes several, in order; short ones share one. A call that fails
        fails the requests in it (their later chunks are skipped), not the others. `rows` limits a request
        to the rows [a, b) of its prompt (see DraftSource.begin_many).

            prefill_chunk 6, prompts a: 9 ids (8 rows), b: 3 ids (2 rows) -> calls [a 0:6], [b 0:2, a 6:8]
            rows {"a": (6, 8)} (a's first 6 rows done before)                   -> calls [a 6:8, b 0:2]
        """
        pieces: list[list[tuple[str, int, int, list[int]]]] = []    # level k: every request's k-th chunk
        for request_id, prompt_ids, sampling, keep_q in jobs:
            first, last = (rows or {}).get(request_id, (0, len(prompt_ids) - 1))
            if first == 0:
                self.sampling[request_id] = (sampling, keep_q)
                self.runner.apply(Control(request_id, commit=list(range(len(prompt_ids)))))
            for k, a in enumerate(range(first, last, self.prefill_chunk)):
                if k == len(pieces):
                    pieces.append([])
                pieces[k].append((request_id, a, min(a + self.prefill_chunk, last), prompt_ids))
        failed: dict[str, Exception] = {}
        call: list[Segment] = []

        def run() -> None:
            try:
                out = self._step(call, want=False)
            except Exception as e:               # the call failed as a whole: every request in it
                failed.update({s.request_id: e for s in call})
            else:
                failed.update({s.request_id: RuntimeError(f"draft rejected nodes: {s.error}")
                               for s in out.segments if s.error})
            call.clear()
        for level in pieces:
            for request_id, a, b, prompt_ids in level:
                if request_id in failed:
                    continue
                if call and (sum(s.rows for s in call) + b - a > self.prefill_chunk
                             or any(s.request_id == request_id for s in call)):
                    run()
                    if request_id in failed:
                        continue
                call.append(Segment(request_id, list(range(a, b)), [i - 1 for i in range(a, b)], list(range(a, b)),
                                    prompt_ids[a:b], [False] * (b - a)))
        if call:
            run()
        return [failed.get(request_id) for request_id, *_ in jobs]

    def expand(self, request_id: str, nodes: Sequence[DraftNode], k: int) -> Proposals:
        result = self.expand_many([(request_id, nodes)], k)[0]
        if isinstance(result, Exception):
            raise result
        return result

    def expand_many(self, jobs: list[tuple[str, Sequence[DraftNode]]], k: int,
                    extra: list[list[list[int]]] | None = None) -> list[Proposals | Exception]:
        """One forward of the draft over the nodes of every request in `jobs`; each request's proposals as
        ProposalRows (one row per node, in the order given; a row the draft dropped is empty).

        extra (optional, for CombinedDraft): per job, per node, more tokens to score from the same log-prob
        rows; each one not among the node's k children and inside the draft's support is appended after
        them as (token, the draft's log-prob of it: the warped one when sampling), in the given order. The
        appended part is not sorted into the children: the caller merges."""
        wanted = {request_id: {n.node_id: toks for n, toks in zip(nodes, ex)}
                  for (request_id, nodes), ex in zip(jobs, extra)} if extra is not None else {}
        segments = [Segment(request_id, [n.node_id for n in nodes], [n.parent_id for n in nodes],
                            [n.position for n in nodes], [n.token for n in nodes], [True] * len(nodes))
                    for request_id, nodes in jobs if nodes]
        if not segments:
            return [ProposalRows.of([[] for _ in nodes]) for _, nodes in jobs]
        out = self._step(segments, want=True)
        started = time.perf_counter()            # the top-k on the draft's device counts as its compute
        by_request: dict[str, tuple[list[int], ProposalRows] | Exception] = {}
        row = 0
        for seg in out.segments:
            if seg.error:
                by_request[seg.request_id] = RuntimeError(f"draft rejected nodes: {seg.error}")
                continue
            n = seg.rows                     # every kept row asked for output
            rows, row = out.logprobs[row:row + n], row + n
            props, scores = self._propose(seg, rows, k)
            if seg.request_id in wanted:
                props = ProposalRows.of(self._append_extra(seg, scores, list(props), wanted[seg.request_id]))
            by_request[seg.request_id] = (seg.node_ids, props)
        self.compute_s += time.perf_counter() - started
        results: list[Proposals | Exception] = []
        for request_id, nodes in jobs:
            got = by_request.get(request_id, ([], ProposalRows.of([])))
            if isinstance(got, Exception):
                results.append(got)
                continue
            kept, props = got
            asked = [n.node_id for n in nodes]
            if kept != asked:                # rows the draft dropped (a pruned parent) propose nothing
                at = {nid: i for i, nid in enumerate(kept)}
                props = ProposalRows.of([props[at[nid]] if nid in at else [] for nid in asked])
            results.append(props)
        return results

    def _propose(self, seg: Segment, logprobs: torch.Tensor, k: int) -> tuple[ProposalRows, torch.Tensor]:
        """Children of each row: the top k by log-prob when greedy; when sampling, the top k of the warped
        log-probs plus noise (coupled with the target's for match, the draft's own for rejection), scored by
        the running minimum of their warped log-probs from the row's best (so scores never increase along
        a row); a row ends where the noisy key is -inf (outside the warped support). Returns the rows and
        the scores they were read from ([rows, vocab]: log-probs, or the warped ones when sampling)."""
        sampling, keep_q = self.sampling.get(seg.request_id, (GREEDY, False))
        k = min(k, logprobs.shape[-1])
        if sampling.greedy:
            top = logprobs.topk(k, dim=-1)
            return ProposalRows.topk(top.indices.cpu().numpy(), top.values.double().cpu().numpy()), logprobs
        q = warp(logprobs, sampling)
        positions = [p + 1 for p in seg.positions]
        keys = q + gumbel(sampling.seed, positions, q.shape[-1], q.device, salt=1 if keep_q else 0)
        order = keys.topk(k, dim=-1)
        firsts = q.max(dim=-1, keepdim=True).values
        scores = torch.cummin(torch.cat((firsts, q.gather(1, order.indices)[:, 1:]), dim=1), dim=1).values
        counts = (order.values != float("-inf")).sum(dim=1)
        if keep_q:
            for i, nid in enumerate(seg.node_ids):
                self._q[(seg.request_id, nid)] = q[i]
        return ProposalRows(order.indices.cpu().numpy().astype(np.int64), scores.double().cpu().numpy(),
                            counts.cpu().numpy().astype(np.int64), distinct=True), q

    @staticmethod
    def _append_extra(seg: Segment, scores: torch.Tensor, out: Proposals,
                      extra: dict[int, list[int]]) -> Proposals:
        """Append each extra token of a row that is not a child yet, scored by its row of `scores`."""
        vocab = scores.shape[-1]
        for i, nid in enumerate(seg.node_ids):
            have = {t for t, _ in out[i]}
            for tok in extra.get(nid, ()):
                if tok in have or not 0 <= tok < vocab:
                    continue
                score = float(scores[i, tok])
                if score != float("-inf"):       # outside the (warped) support: never a child
                    have.add(tok)
                    out[i].append((tok, score))
        return out

    def take_q(self, request_id: str, node_id: int) -> torch.Tensor | None:
        return self._q.pop((request_id, node_id), None)

    def _run(self, seg: Segment, want: bool) -> MicroBatch:
        out = self._step([seg], want)
        if out.segments and out.segments[0].error:
            raise RuntimeError(f"draft rejected nodes: {out.segments[0].error}")
        return out

    def _step(self, segments: list[Segment], want: bool) -> MicroBatch:
        started = time.perf_counter()
        self._batch += 1
        batch = MicroBatch(self._batch, segments, return_logprobs=want)
        self.calls += 1
        self.rows += batch.rows
        out = self.runner.step(batch)
        self.compute_s += time.perf_counter() - started
        return out

    def control(self, request_id: str, commit: list[int], tokens: list[int], prune: list[int]) -> None:
        """One check and one pass over the KV table (`StageRunner.apply`): all or nothing."""
        self.runner.apply(Control(request_id, commit=commit, prune=prune))

    def release(self, request_id: str) -> None:
        """Forget the request: its sampling state and kept q first (plain dicts: they cannot fail), then its
        KV (whose failure is raised, the rest already gone)."""
        self.sampling.pop(request_id, None)
        for key in [key for key in self._q if key[0] == request_id]:
            del self._q[key]
        self.runner.apply(Control(request_id, release=True))


QUANT_MAX_PARAMS = 3_000_000_000     # above this a copy of the target is no draft: use --draft model


def parameter_count(model_ref: str) -> int:
    """Parameters of a model from its config alone (built on the meta device: nothing is loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_ref))
    return sum(p.numel() for p in model.parameters())


def quantized_copy(model_ref: str, device: str = "cpu", max_params: int = QUANT_MAX_PARAMS) -> nn.Module:
    """The target with int8 weights and bf16 activations in every Linear (CPU; int8.py), or a bf16 copy on
    CUDA. Refused for a target above `max_params`: the copy would hold a second target in the coordinator's
    memory (a bf16 load, before quantization on a CPU) — a separate small draft model is the way."""
    n = parameter_count(model_ref)
    if n > max_params:
        raise ValueError(f"--draft quant copies the target ({n / 1e9:.1f} B parameters; about "
                         f"{n * 2 / 2 ** 30:.0f} GiB while loading) into "
                         f"the coordinator, above the limit of {max_params / 1e9:.1f} B: use --draft model "
                         "--draft-model <a small model with the same tokenizer> (or --draft ngram)")
    if str(device).startswith("cuda"):
        return load_causal_lm(model_ref, torch.bfloat16, device)
    return quantize_weights_int8(load_causal_lm(model_ref, torch.bfloat16, "cpu"), torch.bfloat16)


def check_same_tokenizer(target_ref: str, draft_ref: str) -> None:
    """A separate draft must share the target's vocabulary token for token."""
    from transformers import AutoConfig, AutoTokenizer
    tv, dv = AutoConfig.from_pretrained(target_ref).vocab_size, AutoConfig.from_pretrained(draft_ref).vocab_size
    if tv != dv:
        raise ValueError(f"draft model {draft_ref} has a vocabulary of {dv} tokens, the target {tv}: "
                         "a draft must use the target's tokenizer")
    try:
        tt, dt = AutoTokenizer.from_pretrained(target_ref), AutoTokenizer.from_pretrained(draft_ref)
    except (OSError, ValueError, TypeError):
        return   # folders without tokenizers (test models): the vocabulary size is all we can check
    if tt.get_vocab() != dt.get_vocab():
        raise ValueError(f"draft model {draft_ref} uses a different tokenizer from the target")
