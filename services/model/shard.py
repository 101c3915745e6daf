"""One pipeline stage's share of a Llama-family decoder: layers [first, last), plus the embedding on the
first stage and the final norm + LM head on the last.

The weights and the small modules (projections, norms, MLP, rotary tables) are transformers' own; the
attention is ours: rows are tree nodes that attend, through a boolean mask, to KV slots of their request
(services.kv_cache), so one forward serves chains and trees alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.kv_cache import CacheGeometry, RequestKV


@dataclass
class AttendPlan:
    """Where one request's rows of a micro-batch live and what they see."""
    kv: RequestKV
    start: int                 # rows [start, end) of the micro-batch
    end: int
    slots: torch.Tensor        # [rows] int64: slot of each row in kv
    mask: torch.Tensor         # [rows, kv.high_water] bool


class LlamaShard(nn.Module):
    def __init__(self, model: nn.Module, first: int, last: int) -> None:
        super().__init__()
        config = model.config
        total = config.num_hidden_layers
        if not 0 <= first < last <= total:
            raise ValueError(f"layer range [{first}, {last}) is not inside the model's {total} layers")
        inner = model.model
        self.config = config
        self.first, self.last, self.total_layers = first, last, total
        self.is_first, self.is_last = first == 0, last == total
        self.embed_tokens = inner.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(inner.layers[first:last])
        self.norm = inner.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.rotary_emb = inner.rotary_emb
        attn = self.layers[0].self_attn
        self.head_dim: int = attn.head_dim
        self.num_heads: int = config.num_attention_heads
        self.kv_heads: int = config.num_key_value_heads
        self.scaling: float = attn.scaling
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def cache_geometry(self) -> CacheGeometry:
        return CacheGeometry(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[rows] int64 -> [rows, hidden]."""
        if self.embed_tokens is None:
            raise RuntimeError("only the first stage embeds tokens")
        return self.embed_tokens(token_ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> logits [rows, vocab], computed and returned in float32 whatever the model's
        dtype: bf16 logits would round near-equal scores to ties and flip greedy choices."""
        if self.lm_head is None:
            raise RuntimeError("only the last stage has the LM head")
        weight = self.lm_head.weight
        if not isinstance(weight, torch.Tensor):           # a quantized head (the int8 draft): its own kernel
            return self.lm_head(self.norm(hidden)).float()
        logits = logits_fp32(self.norm(hidden), weight)
        return logits if self.lm_head.bias is None else logits + self.lm_head.bias.float()

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, plans: list[AttendPlan]) -> torch.Tensor:
        """Run the local layers. hidden: [rows, hidden]; positions: [rows] int64. Writes each row's K/V into
        its slot, then attends per request under its mask. Returns [rows, hidden]."""
        rows = hidden.shape[0]
        cos, sin = self.rotary_emb(hidden, positions[None, :])        # [1, rows, head_dim]
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]             # [rows, 1, head_dim]
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(hidden)
            q = attn.q_proj(h).view(rows, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(rows, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(rows, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):                               # Qwen3-style per-head norms
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            out = torch.empty_like(q)
            for plan in plans:
                kc, vc = plan.kv.k[li], plan.kv.v[li]
                kc[plan.slots] = k[plan.start:plan.end]
                vc[plan.slots] = v[plan.start:plan.end]
                hw = plan.mask.shape[1]
                qs = q[plan.start:plan.end].transpose(0, 1)[None]      # [1, heads, r, d]
                ks = kc[:hw].transpose(0, 1)[None]                     # [1, kv_heads, hw, d]
                vs = vc[:hw].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=plan.mask[None, None],
                                                   scale=self.scaling, enable_gqa=True)
                out[plan.start:plan.end] = o[0].transpose(0, 1)
            hidden = hidden + attn.o_proj(out.reshape(rows, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden


HEAD_BLOCK = 4096     # vocabulary rows upcast at a time on the fallback path (bounds the fp32 copy)


def logits_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, hidden] @ weight [vocab, hidden].T in float32 -> [rows, vocab] float32. fp32 weights: one
    matmul. Half-precision on CUDA: the GEMM accumulates and writes fp32 (`out_dtype`). Elsewhere: the
    weight is upcast `HEAD_BLOCK` rows at a time, so no fp32 copy of a large head is ever held."""
    x = x.float() if weight.dtype == torch.float32 or not weight.is_cuda else x
    if weight.dtype == torch.float32:
        return x @ weight.t()
    if weight.is_cuda:
        return torch.mm(x.to(weight.dtype), weight.t(), out_dtype=torch.float32)
    return torch.cat([x @ weight[i:i + HEAD_BLOCK].float().t() for i in range(0, weight.shape[0], HEAD_BLOCK)],
                     dim=1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def load_causal_lm(model_ref: str, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """Load a Hugging Face causal LM (folder or hub id) in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_ref, dtype=dtype)
    if getattr(model.config, "model_type", "") not in SUPPORTED_TYPES:
        raise ValueError(f"model type {model.config.model_type!r} is not supported; "
                         f"supported: {', '.join(sorted(SUPPORTED_TYPES))}")
    return model.to(device).eval()


def load_shard(model_ref: str, first: int, last: int | None, dtype: torch.dtype,
               device: str | torch.device) -> LlamaShard:
    """Layers [first, last) of a model (last=None: to the end), reading only their tensors from the
    checkpoint's safetensors (a stage of a 70B model never holds the other stages' weights). A hub id is
    fetched by shard (services/model/hub.py: only the files that hold these layers). A local folder without
    safetensors is loaded whole, then sliced."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from services.model.hub import fetch_shard, layer_prefixes, local_files

    folder = Path(model_ref)
    if not folder.is_dir():
        folder, _ = fetch_shard(model_ref, first, last)
    elif not any(folder.glob("*.safetensors")):
        model = load_causal_lm(model_ref, dtype, device)
        shard = LlamaShard(model, first, model.config.num_hidden_layers if last is None else last)
        del model
        return shard
    config = AutoConfig.from_pretrained(folder)
    if getattr(config, "model_type", "") not in SUPPORTED_TYPES:
        raise ValueError(f"model type {config.model_type!r} is not supported; "
                         f"supported: {', '.join(sorted(SUPPORTED_TYPES))}")
    last = config.num_hidden_layers if last is None else last
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shard = LlamaShard(model, first, last)
    shard.to_empty(device=device).to(dtype)
    shard.rotary_emb = type(model.model.rotary_emb)(config).to(device)   # computed buffers, not weights
    wanted = layer_prefixes(shard.first, shard.last, config.num_hidden_layers,
                            bool(getattr(config, "tie_word_embeddings", False)))
    state = _read_tensors(local_files(folder, wanted), wanted)
    if shard.is_last and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]        # tied embeddings
    missing = [k for k in model.state_dict() if k.startswith(wanted) and k not in state]
    if missing:
        raise ValueError(f"{model_ref}: the checkpoint lacks {len(missing)} tensors of layers "
                         f"[{first}, {last}), e.g. {missing[0]}")
    if not shard.is_first:
        state.pop("model.embed_tokens.weight", None)          # read only for a tied LM head
    model.load_state_dict(state, strict=False)
    shard.eval()
    return shard


def _read_tensors(files, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for key in st.keys():
                if key.startswith(prefixes):
                    out[key] = st.get_tensor(key)
    return out


def even_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Layer ranges for num_stages stages, as even as possible, earlier stages taking the remainder.

    >>> even_split(30, 4)
    [(0, 8), (8, 16), (16, 23), (23, 30)]
    """
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


# Mistral's sliding window is not applied: outputs match only within the window.
SUPPORTED_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
