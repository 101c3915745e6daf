"""Tiny random Llama models built in the test (never downloads), and transformers' own model for them.

    path = make_tiny_llama(tmp_path / "llama4")          # 4 layers, vocabulary 256, hidden 64
    hf = reference_model(path)                            # the ground truth, fp32
"""
from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama(path: Path, layers: int = 4, vocab: int = 256, seed: int = 0) -> Path:
    """A random-initialised Llama with peaked logits (init std 0.2, so greedy ties do not happen) and a
    byte-level tokenizer-free config; saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_theta=10000.0, initializer_range=0.2, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return path


def reference_model(path: Path):
    """transformers' own model (the ground truth), fp32."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
