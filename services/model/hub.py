"""Models from the Hugging Face hub, by shard: a stage downloads only the safetensors files that hold its
layers, as the checkpoint's index (`model.safetensors.index.json`) maps them, into the hub cache
(`HF_HUB_CACHE` / `HF_HOME`; in the chart a cache volume that can be a PVC, so a restart downloads nothing).

Worked example — an 80-layer checkpoint in 30 files, stage 3 of 8 holding layers [30, 40):

    files_for(index, layer_prefixes(30, 40, 80, tied=False))
    -> ['model-00011-of-00030.safetensors', ..., 'model-00015-of-00030.safetensors']     # 5 of 30

`huggingface_hub` does the downloading (resumable, file-locked, offline with `HF_HUB_OFFLINE=1`).
"""
from __future__ import annotations

import json
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
META = ("config.json", "generation_config.json")


def layer_prefixes(first: int, last: int, num_layers: int, tied: bool) -> tuple[str, ...]:
    """Tensor name prefixes of layers [first, last) of a Llama-style checkpoint: the embedding on the first
    stage, the final norm and the LM head on the last (the embedding too when the head is tied to it)."""
    prefixes = [f"model.layers.{i}." for i in range(first, last)]
    if first == 0:
        prefixes.append("model.embed_tokens.")
    if last == num_layers:
        prefixes += ["model.norm.", "lm_head."]
        if tied:
            prefixes.append("model.embed_tokens.")
    return tuple(dict.fromkeys(prefixes))


def files_for(index: dict, prefixes: tuple[str, ...]) -> list[str]:
    """The checkpoint files holding any tensor under `prefixes`, in name order."""
    weight_map: dict[str, str] = index.get("weight_map", {})
    if not weight_map:
        raise ValueError(f"{INDEX} has no weight_map")
    return sorted({f for name, f in weight_map.items() if name.startswith(prefixes)})


def fetch_shard(repo_id: str, first: int, last: int | None, revision: str | None = None,
                token: str | None = None) -> tuple[Path, list[str]]:
    """Download the config and the files that hold layers [first, last) (last None: to the end); returns the
    local snapshot folder and the safetensors files of this shard."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError
    from transformers import AutoConfig

    config_path = Path(hf_hub_download(repo_id, "config.json", revision=revision, token=token))
    folder = config_path.parent
    for name in META[1:]:
        try:
            hf_hub_download(repo_id, name, revision=revision, token=token)
        except EntryNotFoundError:
            pass
    config = AutoConfig.from_pretrained(folder)
    num_layers = config.num_hidden_layers
    prefixes = layer_prefixes(first, num_layers if last is None else last, num_layers,
                              bool(getattr(config, "tie_word_embeddings", False)))
    try:
        index_path = Path(hf_hub_download(repo_id, INDEX, revision=revision, token=token))
        files = files_for(json.loads(index_path.read_text()), prefixes)
    except EntryNotFoundError:
        files = [SINGLE]                                   # a checkpoint in one file
    for name in files:
        hf_hub_download(repo_id, name, revision=revision, token=token)
    return folder, files


def local_files(folder: Path, prefixes: tuple[str, ...]) -> list[Path]:
    """The safetensors files of a local folder that hold `prefixes` (all of them when it has no index)."""
    index = folder / INDEX
    if index.exists():
        return [folder / f for f in files_for(json.loads(index.read_text()), prefixes)]
    return sorted(folder.glob("*.safetensors"))
