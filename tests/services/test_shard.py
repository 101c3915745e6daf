"""Our shard forward against transformers' own forward (tiny random Llama, fp32)."""
from __future__ import annotations

import pytest
import torch

from helpers.shard import ATOL, chain, make_runners, through
from common.batch import Control, MicroBatch, Segment
from services.model.shard import even_split, load_shard


def test_even_split():
    assert even_split(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert even_split(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        even_split(4, 5)


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_chained_shards_match_transformers(tiny_model, tiny_hf, num_stages):
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (17,))
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf(ids[None]).logits[0].float(), -1)
    runners = make_runners(tiny_model, num_stages)
    out = through(runners, MicroBatch(1, [chain("r", ids.tolist())], return_logprobs=True))
    assert out.logprobs.shape == ref.shape
    assert (out.logprobs - ref).abs().max().item() < ATOL
    assert out.argmax == ref.argmax(-1).tolist()


def test_cached_decoding_equals_full_recomputation(tiny_model, tiny_hf):
    """Prefill 6 tokens, then feed 10 more one at a time through the KV cache (committing as we go):
    each step's log-probs equal those of one full forward over the whole sequence."""
    torch.manual_seed(2)
    ids = torch.randint(3, 256, (16,)).tolist()
    with torch.no_grad():
        full = torch.log_softmax(tiny_hf(torch.tensor([ids])).logits[0].float(), -1)
    runners = make_runners(tiny_model, 2)
    out = through(runners, MicroBatch(0, [chain("r", ids[:6], want_all=False)], return_logprobs=True))
    got = [out.logprobs[-1]]
    for r in runners:
        r.apply(Control("r", commit=list(range(6))))
    for i in range(6, 16):
        seg = Segment("r", [i], [i - 1], [i], [ids[i]], [True])
        for r in runners:
            r.apply(Control("r", commit=[i]))
        got.append(through(runners, MicroBatch(i, [seg], return_logprobs=True)).logprobs[0])
    got = torch.stack(got[:-1])          # outputs for positions 5..14
    assert (got - full[5:15]).abs().max().item() < ATOL


def test_two_requests_in_one_micro_batch_do_not_mix(tiny_model, tiny_hf):
    torch.manual_seed(3)
    a, b = torch.randint(3, 256, (7,)).tolist(), torch.randint(3, 256, (5,)).tolist()
    runners = make_runners(tiny_model, 2)
    out = through(runners, MicroBatch(1, [chain("a", a), chain("b", b)], return_logprobs=True))
    with torch.no_grad():
        ra = torch.log_softmax(tiny_hf(torch.tensor([a])).logits[0], -1)
        rb = torch.log_softmax(tiny_hf(torch.tensor([b])).logits[0], -1)
    assert (out.logprobs - torch.cat([ra, rb])).abs().max().item() < ATOL


def test_tree_rows_see_only_their_root_path(tiny_model, tiny_hf):
    """Two branches below a committed prefix: each node's output equals the causal forward of its path."""
    torch.manual_seed(4)
    prefix = torch.randint(3, 256, (5,)).tolist()
    x, y, z = 11, 22, 33
    runners = make_runners(tiny_model, 2)
    for r in runners:
        r.apply(Control("r", commit=list(range(5))))
    through(runners, MicroBatch(0, [chain("r", prefix, want_all=False)]))
    # node 5 = x and node 6 = y are siblings below node 4; node 7 = z is a child of 6
    tree = Segment("r", [5, 6, 7], [4, 4, 6], [5, 5, 6], [x, y, z], [True, True, True])
    out = through(runners, MicroBatch(1, [tree], return_logprobs=True))
    with torch.no_grad():
        px = torch.log_softmax(tiny_hf(torch.tensor([prefix + [x]])).logits[0, -1], -1)
        pyz = torch.log_softmax(tiny_hf(torch.tensor([prefix + [y, z]])).logits[0, -2:], -1)
    assert (out.logprobs - torch.cat([px[None], pyz])).abs().max().item() < ATOL


def test_a_stage_reads_only_its_own_layers(tiny_model8, monkeypatch):
    """A middle stage of 8 layers reads layers 2..4 and nothing else (no embedding, no LM head)."""
    import services.model.shard as shard_mod
    seen: list[str] = []
    real = shard_mod._read_tensors

    def recording(files, prefixes):
        out = real(files, prefixes)
        seen.extend(out)
        return out
    monkeypatch.setattr(shard_mod, "_read_tensors", recording)
    shard = load_shard(str(tiny_model8), 2, 5, torch.float32, "cpu")
    assert seen and {k.split(".")[2] for k in seen} == {"2", "3", "4"}
    assert all(k.startswith("model.layers.") for k in seen)
    assert not any(p.is_meta for p in shard.parameters()) and shard.embed_tokens is None and shard.lm_head is None
    with pytest.raises(ValueError, match="layer range"):
        load_shard(str(tiny_model8), 5, 9, torch.float32, "cpu")


def test_the_lm_head_computes_logits_in_fp32_for_a_bf16_model(monkeypatch):
    """bf16 logits round near-equal scores to ties; the head upcasts (in blocks of the vocabulary on CPU)."""
    import services.model.shard as shard_mod
    monkeypatch.setattr(shard_mod, "HEAD_BLOCK", 3)                # 10 vocabulary rows: blocks of 3, 3, 3, 1
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(10, 16, generator=g).to(torch.bfloat16)
    got = shard_mod.logits_fp32(x, w)
    want = x.float() @ w.float().t()
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, (x @ w.t()).float())               # what bf16 output would have rounded
    assert torch.equal(shard_mod.logits_fp32(x.float(), w.float()), want)
