"""Weight-only int8 for the `quant` draft on a CPU: each Linear's weight rounded to int8 with one scale per
output channel, the activations kept in bfloat16, multiplied by torch's own int8-weight kernel
(`aten._weight_int8pack_mm`, the kernel gpt-fast's int8 mode uses).

Why not torch's dynamic quantization (`quantize_dynamic`, the `quant` draft before 2026-12-07): it rounds the
activations to int8 too, one scale per tensor, and a small LLM's hidden states carry a few outlier channels
that take that whole range, so the draft no longer agrees with the target. Measured on SmolLM2-135M (the
default model), the target's greedy continuations of 12 shipped prompts teacher-forced through each copy, 390
positions, one thread of this 2-core machine:

    copy                          top-1 agreement   top-4 coverage   one row (KV of 120 positions)
    fp32 target                        1.000            1.000            41 ms
    dynamic int8 (weights + acts)      0.454            0.772            17.5 ms
    weight-only int8, bf16 acts        0.962            1.000            19-24 ms
    bfloat16 copy                      0.974            1.000            30.5 ms

Worked example: a weight row [0.5, -1.27, 0.01] has scale 1.27 / 127 = 0.01 and int8 row [50, -127, 1];
x @ row = 0.01 * (x @ [50, -127, 1]).

Where the CPU lacks bfloat16 arithmetic (AVX512-BF16 or AMX) the kernel widens to float32 internally and the
draft is slower; the cost rule measures the draft and sizes speculation to what it costs.
"""
from __future__ import annotations

import torch
from torch import nn


KERNEL_K_MULTIPLE = 16   # torch 2.13's CPU kernel reads past rows of other lengths (garbage or a crash, probed)


class Int8WeightOnlyLinear(nn.Module):
    """A Linear whose weight is int8 with a per-output-channel scale: y = (x @ weight_q.T) * scales + bias."""
    weight = None      # not a tensor: LlamaShard.head then calls the module itself (its own kernel)

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        w = linear.weight.detach().float()                              # [out, in]
        scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight_q", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(dtype))                # [out]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))  # [out]
        self.in_features, self.out_features, self.dtype = linear.in_features, linear.out_features, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out] in self.dtype."""
        flat = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        if self.in_features % KERNEL_K_MULTIPLE == 0:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_q, self.scales)
        else:                                       # the same product, the weight widened on every call
            y = (flat @ self.weight_q.to(self.dtype).T) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}"


def quantize_weights_int8(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace every nn.Linear of `model` (in place) by an Int8WeightOnlyLinear; returns `model`. A tied LM
    head gets its own int8 copy; the embedding it shared stays as it was."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8WeightOnlyLinear(child, dtype))
    return model
