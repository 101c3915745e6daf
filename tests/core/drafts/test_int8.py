"""Weight-only int8 (coordinator/core/drafts/int8.py): the `quant` draft's Linears on a CPU."""
from __future__ import annotations

import torch
from torch import nn

from coordinator.core.drafts.int8 import Int8WeightOnlyLinear, quantize_weights_int8


def test_the_docstrings_worked_example():
    lin = nn.Linear(3, 1, bias=False)                                  # 3 inputs: the widening path
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[0.5, -1.27, 0.01]]))
    q = Int8WeightOnlyLinear(lin)
    assert q.weight_q.tolist() == [[50, -127, 1]]
    assert abs(q.scales.float().item() - 0.01) < 1e-4                  # 1.27 / 127, in bf16
    y = q(torch.ones(1, 3))
    assert y.dtype == torch.bfloat16 and abs(y.float().item() - (-0.76)) < 0.01    # 0.01 * (50 - 127 + 1)


def test_outputs_follow_the_float_linear_on_any_leading_shape():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    q = Int8WeightOnlyLinear(lin)
    x = torch.randn(2, 3, 64)
    want, got = lin(x), q(x).float()
    assert got.shape == (2, 3, 48)
    assert (got - want).norm() / want.norm() < 0.02                    # int8 rounding + bf16 activations


def test_every_linear_is_replaced_and_a_tied_embedding_left_alone():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight                         # tied, as in SmolLM2

    model = Tiny()
    before = model.embed.weight.detach().clone()
    assert quantize_weights_int8(model) is model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8WeightOnlyLinear) for m in model.modules()) == 3
    assert torch.equal(model.embed.weight, before)
    assert model.head(torch.randn(4, 8)).shape == (4, 10)


def test_the_kernel_and_the_widening_path_compute_the_same_product():
    """in_features a multiple of 16 goes through torch's int8 kernel, other lengths (which that kernel reads
    past: garbage or a crash) through a widened weight; both against the float product of the int8 weight."""
    torch.manual_seed(1)
    for k in (8, 24, 40, 48, 64, 576):
        q = Int8WeightOnlyLinear(nn.Linear(k, 33))
        x = torch.randn(5, k)
        want = x.bfloat16().float() @ (q.weight_q.float() * q.scales.float()[:, None]).T + q.bias.float()
        got = q(x).float()
        assert torch.isfinite(got).all()
        assert (got - want).abs().max() / want.abs().max() < 0.02, k
