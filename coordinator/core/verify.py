"""Lossless verification of a node's children when sampling (pure torch; docs/architecture.md, "The methods").

Two verifiers keep the target's distribution exactly:

- `match` (sample-then-match, default): the last stage draws the target's token at the node with the
  request's seeded noise (common/sampling.py); a child carrying that token is a hit, otherwise that token
  is the bonus. The committed token is always the target's own sample, so any set of children is exact;
  the draft proposes with the *same* noise so that its first child is the token the target most likely
  draws. Output is a function of the seed alone (the same for every method). PipeInfer works this way.

- `rejection` (recursive rejection sampling, `verify_children`): the draft's children of a node are a
  sample without replacement from its warped distribution q (Gumbel-top-k with the draft's own noise);
  the last stage ships the target's warped distribution p. Child j (in draft order) is accepted with
  probability min(1, p_j(x_j) / q_j(x_j)); on rejection p_{j+1} = normalise(max(p_j - q_j, 0)) and q_{j+1}
  is q_j without x_j; when every child is rejected the bonus is drawn from the last residual. With one
  child this is speculative sampling for chains (Leviathan et al., Chen et al.); with several, recursive
  rejection sampling over siblings (SpecInfer's multi-step speculative sampling for draws without
  replacement, Jeon et al. 2024). A child without q (a deterministic proposal, e.g. prompt lookup) counts
  as a point mass: accepted with probability p_j(x), after which p_{j+1} is p_j without x — EAGLE's rule.
  Verifying only the first m children (those in flight) is exact for every m.

Worked example (vocab 3, p = [0.5, 0.3, 0.2], q = [0.2, 0.6, 0.2], one child x drawn from q):
    x = 1: accepted with min(1, 0.3 / 0.6) = 0.5, else the bonus comes from max(p - q, 0) = [0.3, 0, 0]: 0
    x = 0 or x = 2: p >= q there, always accepted
    P(0) = 0.2 + 0.6 * 0.5 = 0.5, P(1) = 0.6 * 0.5 = 0.3, P(2) = 0.2: exactly p.
"""
from __future__ import annotations

import torch


def verify_children(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor | None, children: list[int],
                    u: list[float]) -> tuple[int | None, int]:
    """p_logprobs: [vocab] the target's warped log-probs at the node; q_logprobs: [vocab] the draft's, or
    None (children are point masses); children: tokens in the order the draft drew them; u: at least
    len(children) + 1 uniforms in [0, 1). Returns (index of the accepted child or None, committed token)."""
    if len(u) < len(children) + 1:
        raise ValueError("verify_children needs one uniform per child plus one for the bonus")
    p = p_logprobs.double().exp()
    q = q_logprobs.double().exp() if q_logprobs is not None else None
    for j, x in enumerate(children):
        qx = float(q[x]) if q is not None else 1.0
        if qx <= 0:
            break                                           # not a draw from q: the draws end here
        if u[j] * qx < float(p[x]):                         # u < min(1, p(x) / q(x))
            return j, x
        if q is not None:
            residual = (p - q).clamp_min(0.0)
            q = q.clone()
            q[x] = 0.0                                      # the next draw is without replacement
        else:
            residual = p.clone()
            residual[x] = 0.0
        total = float(residual.sum())
        if total > 0:                                       # 0 only by rounding when p == q
            p = residual / total
        if q is not None:
            q_total = float(q.sum())
            if q_total <= 0:
                break
            q = q / q_total
    return None, _draw(p, u[len(children)])


def _draw(p: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from probabilities p [vocab] with one uniform."""
    cdf = torch.cumsum(p, dim=0)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)[0])
    idx = min(idx, p.shape[0] - 1)
    while p[idx] <= 0 and idx > 0:                          # rounding at the top end of the CDF
        idx -= 1
    return idx
