"""Lossless sampling. Warping agrees with transformers' warpers; seeded draws are reproducible and exact;
recursive rejection sampling reproduces the target's distribution (and a deliberately wrong verifier is
caught by the same test); every method's `match` output equals plain seeded sampling from the target token
for token; `rejection` verification gives the target's distribution of the first two tokens."""
from __future__ import annotations

import random

import pytest
import torch

from coordinator.core.drafts.model import ModelDraft
from coordinator.core.schedulers.base import Request
from coordinator.core.schedulers.registry import SpecOptions, make_scheduler
from coordinator.core.verify import verify_children
from coordinator.engine.loops.inprocess import InProcessPipeline
from helpers.reference import reference_sample
from helpers.shard import make_runners
from services.model.shard import load_causal_lm
from common.sampling import Sampling, gumbel, sample, warp

ALPHA = 1e-3          # significance of every goodness-of-fit test below


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of observed counts against probabilities (cells with an
    expected count below 5 are pooled)."""
    n = float(counts.sum())
    expected = probs.double().flatten() * n
    observed = counts.double().flatten()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    stat = float(((observed - expected) ** 2 / expected.clamp_min(1e-12)).sum())
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# -- warping and seeded draws -----------------------------------------------------------------------
@pytest.mark.parametrize("s", [Sampling(0.7), Sampling(1.3, top_k=5), Sampling(1.0, top_p=0.8),
                               Sampling(0.9, top_p=0.5, top_k=20)])
def test_warp_agrees_with_transformers(s):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 3
    x = TemperatureLogitsWarper(s.temperature)(None, logits.clone())
    if s.top_k:
        x = TopKLogitsWarper(s.top_k)(None, x)
    if s.top_p < 1:
        x = TopPLogitsWarper(s.top_p)(None, x)
    torch.testing.assert_close(warp(logits, s), torch.log_softmax(x, dim=-1))


def test_seeded_draws_are_reproducible_and_exact():
    g1, g2 = gumbel(7, [3, 4, 3], 10), gumbel(7, [3], 10)
    assert torch.equal(g1[0], g1[2]) and torch.equal(g1[0], g2[0]) and not torch.equal(g1[0], g1[1])
    assert not torch.equal(gumbel(8, [3], 10)[0], g2[0])
    lp = torch.log_softmax(torch.tensor([[1.0, 0.0, -1.0, 0.5, -3.0]]), dim=-1)
    s = Sampling(1.0)
    counts = torch.zeros(5)
    for seed in range(1, 6001):
        counts[sample(lp, Sampling(1.0, seed=seed), [0])[0]] += 1
    assert sample(lp, Sampling(1.0, seed=9), [0]) == sample(lp, Sampling(1.0, seed=9), [0])
    assert chi_square_p(counts, lp.exp()[0]) > ALPHA
    assert s.greedy is False and Sampling().greedy


# -- recursive rejection sampling -------------------------------------------------------------------
def wrong_verify(p_lp, q_lp, children, u):
    """A classic bug: after a rejection, draw from p instead of the residual max(p - q, 0)."""
    p, q = p_lp.double().exp(), q_lp.double().exp()
    for j, x in enumerate(children):
        if u[j] * q[x] < p[x]:
            return j, x
    return None, int(torch.multinomial(p, 1, generator=torch.Generator().manual_seed(int(u[-1] * 2**31))))


def rejection_p_value(verifier, k: int, point_mass: bool = False, n: int = 8000) -> float:
    """Draw the children as the draft does (without replacement by Gumbel-top-k of q, or the k most likely
    as point masses), verify, and test the committed tokens against p."""
    gen, rng = torch.Generator().manual_seed(11), random.Random(5)
    vocab = 6
    p = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, dim=0)
    q = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, dim=0)
    counts = torch.zeros(vocab)
    for _ in range(n):
        if point_mass:
            children = q.argsort(descending=True)[:k].tolist()
        else:
            keys = q.log() - torch.log(-torch.log(torch.rand(vocab, generator=gen)))
            children = keys.argsort(descending=True)[:k].tolist()
        _, token = verifier(p.log(), None if point_mass else q.log(), children,
                            [rng.random() for _ in range(k + 1)])
        counts[token] += 1
    return chi_square_p(counts, p)


@pytest.mark.parametrize("k, point_mass", [(1, False), (3, False), (2, True)])
def test_rejection_sampling_keeps_the_target_distribution(k, point_mass):
    assert rejection_p_value(verify_children, k, point_mass) > ALPHA


def test_a_wrong_verifier_is_caught():
    assert rejection_p_value(wrong_verify, 1) < ALPHA


# -- every method, end to end -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """Target and a different draft over a vocabulary of 8 tokens, so distributions are easy to test."""
    from helpers.models import make_tiny_llama
    root = tmp_path_factory.mktemp("vocab8")
    return make_tiny_llama(root / "target", layers=4, vocab=8, seed=4), \
        make_tiny_llama(root / "draft", layers=2, vocab=8, seed=9)


METHODS = ["pp", "cb-pp", "specpipe", "sps", "tree", "pipeinfer"]


@pytest.mark.parametrize("method", METHODS)
def test_match_sampling_is_plain_seeded_sampling_for_every_method(tiny_model8, tiny_hf8, method):
    """With the same seed every method commits exactly the tokens plain sampling draws (so outputs are
    reproducible and exactly distributed), here over 6 requests of 12 tokens run together."""
    draft = ModelDraft(load_causal_lm(str(tiny_model8), torch.float32, "cpu"))
    sched = make_scheduler(method, 4, SpecOptions(draft, width=4, sps_k=3, tree_nodes=8, tree_depth=3))
    reqs = [Request(f"r{i}", [3 + i, 40, 7 * i + 1], 12, sampling=Sampling(0.9, top_p=0.95, top_k=40, seed=100 + i))
            for i in range(6)]
    out = InProcessPipeline(make_runners(tiny_model8, 4, layers=8)).run(sched, reqs)
    for r in reqs:
        assert out[r.request_id].tokens == reference_sample(tiny_hf8, r.prompt_ids, 12, r.sampling), r.request_id
    if method == "specpipe":
        hits = sum(out[r.request_id].stats.spec.hits for r in reqs)
        assert hits > 20, "a draft equal to the target is coupled with it: most proposals are hits"
        # the tree's calibration (on by default) learns from greedy verifications only: sampled requests keep the
        # draft's warped scores
        assert sched.calibration is not None and sched.calibration.seen.sum() == 0


def exact_first_two(model_path, prompt: list[int], s: Sampling) -> torch.Tensor:
    """P(t1, t2) [vocab, vocab] under the target's warped distribution."""
    from helpers.models import reference_model
    model = reference_model(model_path)
    with torch.no_grad():
        p1 = warp(model(torch.tensor([prompt])).logits[:, -1], s)[0].exp()
        seqs = torch.tensor([prompt + [t] for t in range(p1.shape[0])])
        p2 = warp(model(seqs).logits[:, -1], s).exp()
    return p1[:, None] * p2


def first_two_counts(method: str, small_vocab, s: Sampling, n: int) -> torch.Tensor:
    target, draft_path = small_vocab
    draft = ModelDraft(load_causal_lm(str(draft_path), torch.float32, "cpu"))
    sched = make_scheduler(method, 2, SpecOptions(draft, width=3, topk=3, sps_k=2, tree_nodes=6, tree_depth=2,
                                                  node_budget=1 << 16, verify="rejection"))
    prompt = [1, 5, 2]
    reqs = [Request(f"r{i}", prompt, 2, sampling=Sampling(s.temperature, s.top_p, s.top_k, seed=i + 1))
            for i in range(n)]
    out = InProcessPipeline(make_runners(target, 2, layers=4)).run(sched, reqs)
    counts = torch.zeros(8, 8)
    for r in reqs:
        t1, t2 = out[r.request_id].tokens
        counts[t1, t2] += 1
    return counts


@pytest.mark.parametrize("method", ["specpipe", *(pytest.param(m, marks=pytest.mark.slow) for m in ["sps", "tree"])])
def test_rejection_verification_gives_the_target_distribution(small_vocab, method):
    s = Sampling(1.0)
    probs = exact_first_two(small_vocab[0], [1, 5, 2], s)
    assert float((probs > 0.01).sum()) >= 8, "the test needs a spread-out target"
    # the trip methods run one request per micro-batch (1500 cost sps 44 s, tree 54 s): fewer samples, a test
    # of the same size (ALPHA) with less power; specpipe batches them all and keeps 1500
    assert chi_square_p(first_two_counts(method, small_vocab, s, 1500 if method == "specpipe" else 600),
                        probs) > ALPHA


def test_a_wrong_verifier_is_caught_end_to_end(small_vocab, monkeypatch):
    import coordinator.core.schedulers.specpipe as sp
    monkeypatch.setattr(sp, "verify_children", wrong_verify)
    s = Sampling(1.0)
    probs = exact_first_two(small_vocab[0], [1, 5, 2], s)
    assert chi_square_p(first_two_counts("specpipe", small_vocab, s, 1500), probs) < ALPHA


# -- properties of the verifier (hypothesis) --------------------------------------------------------
from hypothesis import given, settings, strategies as st  # noqa: E402


@st.composite
def verifier_case(draw):
    vocab = draw(st.integers(2, 12))
    def dist(allow_zero: bool):
        w = draw(st.lists(st.floats(0.0 if allow_zero else 0.01, 1.0), min_size=vocab, max_size=vocab))
        t = torch.tensor(w, dtype=torch.float64)
        if float(t.sum()) <= 0:
            t[0] = 1.0
        return torch.log(t / t.sum())
    p, q = dist(True), (dist(True) if draw(st.booleans()) else None)
    k = draw(st.integers(0, vocab))
    children = draw(st.permutations(range(vocab)))[:k]
    u = draw(st.lists(st.floats(0.0, 0.999999), min_size=k + 1, max_size=k + 1))
    return p, q, children, u


@settings(max_examples=300, deadline=None)
@given(verifier_case())
def test_verifier_commits_a_token_the_target_can_produce(case):
    p, q, children, u = case
    j, token = verify_children(p, q, children, u)
    assert 0 <= token < p.shape[0] and p[token] > float("-inf"), "never a token outside the target's support"
    if j is not None:
        assert children[j] == token and (q is None or q[token] > float("-inf"))
    else:
        verified = children if q is None else \
            children[:next((i for i, c in enumerate(children) if q[c] == float("-inf")), len(children))]
        assert token not in verified, "a rejected child keeps no mass in the residual"
