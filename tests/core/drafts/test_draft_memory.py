"""A draft that fits (issue 17): `quant` refuses a target too large to copy into the coordinator, pointing at
`--draft model`; a separate draft model loads in the dtype asked for (auto: bf16 on CUDA, fp32 on CPU)."""
from __future__ import annotations

import pytest
import torch

from coordinator.core.drafts.factory import build_draft
from coordinator.core.drafts.int8 import Int8WeightOnlyLinear
from coordinator.core.drafts.model import parameter_count, quantized_copy


def test_the_parameter_count_comes_from_the_config_alone(tiny_model, tiny_hf):
    assert parameter_count(str(tiny_model)) == sum(p.numel() for p in tiny_hf.parameters())


def test_quant_refuses_a_target_above_the_limit_with_a_way_out(tiny_model):
    n = parameter_count(str(tiny_model))
    with pytest.raises(ValueError, match=r"above the limit of .* use --draft model --draft-model"):
        quantized_copy(str(tiny_model), "cpu", max_params=n - 1)
    model = quantized_copy(str(tiny_model), "cpu", max_params=n)        # at the limit: built (int8 on CPU)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert any(isinstance(m, Int8WeightOnlyLinear) for m in model.modules())


@pytest.mark.parametrize("dtype, want", [("auto", torch.float32), ("bfloat16", torch.bfloat16)])
def test_a_draft_model_loads_in_the_dtype_asked_for(tiny_model, tiny_draft_model, dtype, want):
    draft = build_draft("model", str(tiny_model), str(tiny_draft_model), device="cpu", dtype=dtype)
    assert {p.dtype for p in draft.runner.shard.parameters()} == {want}
