"""Shared fixtures: tiny random Llama models built in the test (never downloads; tests/helpers/models.py).
The tiers (`make test-fast`, `make test`): tests/helpers/tiers.py."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers.models import make_tiny_llama, reference_model
from helpers.reference import byte_tokenizer

# Each pytest-xdist worker takes its share of the cores: torch's OpenMP threads beyond the cores spin against
# each other's (a rejection-sampling test of tiny tensors took 61 s with 2 threads beside another 2-thread torch
# process on 2 cores, 27 s with 1; 15 s and 18 s alone).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("SPECPIPE_LOG_FORMAT", "console")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama4")


@pytest.fixture(scope="session")
def tiny_hf(tiny_model):
    return reference_model(tiny_model)


@pytest.fixture(scope="session")
def chat_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (same weights, so tiny_hf is its reference) plus the byte tokenizer."""
    path = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_model, path)
    byte_tokenizer().save_pretrained(path)
    return path


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
    """Stages and a coordinator on the tiny model, shared by a fuzz test module (tests/helpers/fuzz_harness.py)."""
    from helpers.fuzz_harness import Env
    e = Env(str(tiny_model))
    try:
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Certificates for the mutual-TLS tests: a CA, a stage's, the coordinator's, one with a name the stages
    do not know, and one with the coordinator's name from another CA; PEM paths."""
    from helpers.certs import make_ca, make_leaf, write
    from common.tls import COORDINATOR_NAME, STAGE_NAME
    from cryptography.hazmat.primitives import serialization
    tmp = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca("specpipe-ca"), make_ca("intruder-ca")
    (tmp / "ca.crt").write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    stage = write(tmp, "stage", *make_leaf(ca, STAGE_NAME))
    coord = write(tmp, "coordinator", *make_leaf(ca, COORDINATOR_NAME))
    other = write(tmp, "other", *make_leaf(ca, "someone-else"))       # right CA, no identity the stages know
    intruder = write(tmp, "intruder", *make_leaf(other_ca, COORDINATOR_NAME))     # the right name, wrong CA
    return {"ca": str(tmp / "ca.crt"), "stage": stage, "coordinator": coord, "other": other, "intruder": intruder}
