"""Shared fixtures: tiny random Llama models built in the test (never downloads)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("SPECPIPE_LOG_FORMAT", "console")


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama4")


def reference_model(path: Path):
    """transformers' own model (the ground truth), fp32."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_hf(tiny_model):
    return reference_model(tiny_model)


@pytest.fixture(scope="session")
def tiny_model8(tmp_path_factory) -> Path:
    """8 layers, so that pipelines of up to 8 stages can be built."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny8") / "llama8", layers=8, seed=1)


@pytest.fixture(scope="session")
def tiny_hf8(tiny_model8):
    return reference_model(tiny_model8)


@pytest.fixture(scope="session")
def tiny_draft_model(tmp_path_factory) -> Path:
    """A separate small model with the same vocabulary (a stand-in for a real draft model folder)."""
    return make_tiny_llama(tmp_path_factory.mktemp("draft") / "draft2", layers=2, seed=7)


@pytest.fixture(scope="module")
def fuzz_env(tiny_model):
    """Stages and a coordinator on the tiny model, shared by a fuzz test module (tests/fuzz_harness.py)."""
    from fuzz_harness import Env
    e = Env(str(tiny_model))
    try:
        yield e
    finally:
        e.close()
