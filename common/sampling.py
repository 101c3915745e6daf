"""Sampling shared by the last stage and the coordinator (pure torch): warping and seeded Gumbel noise.

A request samples from the target's *warped* distribution: logits / temperature, then top-k, then top-p
(nucleus), then softmax. Temperature 0 is greedy.

The sampled token at sequence position `pos` is argmax(warped log-probs + g), where g is Gumbel noise
drawn from a generator seeded with (seed, pos) only (the Gumbel-max trick: an exact sample). Because the
noise depends on nothing else, the committed tokens are a deterministic function of (model, prompt,
sampling parameters, seed) — every method gives the same output for the same seed — and each committed
token is an exact sample given the prefix before it: the noise at `pos` is independent of the noise at
earlier positions, which alone decided that prefix. A draft that uses the same noise proposes the token
the target is most likely to draw (coupled sampling), which is what `match` verification exploits.

    s = Sampling(temperature=0.8, top_p=0.9, seed=7)
    token = sample(warp(logits, s), s, positions=[12])   # the token at position 12, same every time
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0     # 0: greedy
    top_p: float = 1.0           # (0, 1]: smallest set of tokens with at least this probability
    top_k: int = 0               # 0: no limit
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def check(self) -> None:
        """Raises ValueError for parameters no sampler accepts."""
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 <= self.seed < 1 << 64:
            raise ValueError("seed must fit in 64 bits")


GREEDY = Sampling()


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[rows, vocab] logits -> [rows, vocab] float32 log-probabilities of the warped distribution (-inf
    outside top-k / top-p). Greedy requests get plain log-softmax."""
    x = logits.float()
    if s.greedy:
        return torch.log_softmax(x, dim=-1)
    x = x / s.temperature
    if 0 < s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs          # mass of the tokens ranked above
        drop_sorted = before >= s.top_p                        # the top token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def _stream(seed: int, pos: int, salt: int) -> torch.Generator:
    key = (seed * 0x9E3779B97F4A7C15 + (pos + 1) * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB) & _MASK
    return torch.Generator().manual_seed(key)


def gumbel(seed: int, positions: list[int], vocab: int, device: torch.device | str = "cpu",
           salt: int = 0) -> torch.Tensor:
    """[rows, vocab] float32 Gumbel(0, 1) noise; row i depends only on (seed, positions[i], salt). Drawn on
    the CPU so that every device and process sees the same numbers."""
    rows: dict[int, torch.Tensor] = {}
    for pos in positions:
        if pos not in rows:
            u = torch.rand(vocab, generator=_stream(seed, pos, salt), dtype=torch.float64)
            rows[pos] = (-torch.log(-torch.log(u.clamp_min(1e-300)))).float()
    return torch.stack([rows[p] for p in positions]).to(device)


def uniform(seed: int, pos: int, n: int, salt: int) -> list[float]:
    """n uniforms in [0, 1) for verification decisions at a position (independent of `gumbel` with another
    salt)."""
    return torch.rand(n, generator=_stream(seed, pos, salt), dtype=torch.float64).tolist()


def sample(logprobs: torch.Tensor, s: Sampling, positions: list[int]) -> list[int]:
    """The token drawn at each row's position from warped log-probs [rows, vocab] (argmax when greedy)."""
    if s.greedy:
        return logprobs.argmax(dim=-1).tolist()
    g = gumbel(s.seed, positions, logprobs.shape[-1], logprobs.device)
    return (logprobs + g).argmax(dim=-1).tolist()
