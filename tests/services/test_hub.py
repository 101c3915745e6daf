"""Models from the hub by shard (services/model/hub.py), offline: the file selection from a checkpoint's
index, and a stage loading its layers from a hub cache that holds only the files of those layers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from services.model.hub import INDEX, files_for, layer_prefixes
from services.model.shard import load_shard

INDEX_80 = {"weight_map": {
    **{f"model.layers.{i}.{w}": f"model-{i // 8 + 1:05d}-of-00010.safetensors"
       for i in range(80) for w in ("self_attn.q_proj.weight", "mlp.up_proj.weight")},
    "model.embed_tokens.weight": "model-00001-of-00010.safetensors",
    "model.norm.weight": "model-00010-of-00010.safetensors",
    "lm_head.weight": "model-00010-of-00010.safetensors",
}}


def test_layer_prefixes_name_the_embedding_first_and_the_head_last():
    assert layer_prefixes(0, 2, 4, tied=False) == ("model.layers.0.", "model.layers.1.", "model.embed_tokens.")
    assert layer_prefixes(2, 4, 4, tied=False) == ("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.")
    assert layer_prefixes(3, 4, 4, tied=True)[-1] == "model.embed_tokens."        # the head reads the embedding
    assert "model.layers.1." not in layer_prefixes(0, 1, 4, tied=False)           # prefixes never over-match


def test_a_middle_stage_needs_only_the_files_of_its_layers():
    assert files_for(INDEX_80, layer_prefixes(30, 40, 80, tied=False)) == [
        "model-00004-of-00010.safetensors", "model-00005-of-00010.safetensors"]
    assert files_for(INDEX_80, layer_prefixes(0, 10, 80, tied=False)) == [
        "model-00001-of-00010.safetensors", "model-00002-of-00010.safetensors"]
    assert files_for(INDEX_80, layer_prefixes(75, 80, 80, tied=False)) == ["model-00010-of-00010.safetensors"]
    with pytest.raises(ValueError, match="no weight_map"):
        files_for({}, ("model.layers.0.",))


def sharded_copy(src: Path, dst: Path) -> Path:
    """The tiny model saved in many small safetensors files with an index, as big checkpoints are."""
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(dst, max_shard_size="60KB")
    return dst


def hub_snapshot(cache: Path, repo: str, folder: Path, keep: list[str]) -> Path:
    """A hub cache (HF_HUB_CACHE layout: models--org--name/{refs/main, snapshots/<sha>/...}) holding only
    the config, the index and the files in `keep`; the index and generation config are recorded as they are."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / sha
    snap.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(sha)
    for name in ["config.json", "generation_config.json", INDEX, *keep]:
        if (folder / name).exists():
            shutil.copy(folder / name, snap / name)
    return snap


def test_a_stage_loads_its_layers_from_a_hub_cache_holding_only_their_files(tiny_model8, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants
    full = sharded_copy(tiny_model8, tmp_path / "sharded")
    index = json.loads((full / INDEX).read_text())
    all_files = sorted(set(index["weight_map"].values()))
    need = files_for(index, layer_prefixes(3, 5, 8, tied=False))
    assert len(all_files) >= 6 and 0 < len(need) < len(all_files) // 2, (need, all_files)
    cache = tmp_path / "hub"
    hub_snapshot(cache, "test-org/tiny8", full, need)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    requested: list[str] = []
    import huggingface_hub
    real = huggingface_hub.hf_hub_download

    def recording(repo_id: str, filename: str, **kw):
        requested.append(filename)
        return real(repo_id, filename, cache_dir=str(cache), **kw)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", recording)

    shard = load_shard("test-org/tiny8", 3, 5, torch.float32, "cpu")       # a hub id, not a folder
    want = load_shard(str(tiny_model8), 3, 5, torch.float32, "cpu")
    assert set(requested) - {"config.json", "generation_config.json", INDEX} == set(need)
    got, ref = shard.state_dict(), want.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    from huggingface_hub.errors import LocalEntryNotFoundError
    with pytest.raises(LocalEntryNotFoundError):      # other layers' files are not in the cache (offline)
        load_shard("test-org/tiny8", 0, 2, torch.float32, "cpu")
