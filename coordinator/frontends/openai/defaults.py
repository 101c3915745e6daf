"""The model's own sampling defaults, from its generation_config.json, for the fields an OpenAI request
leaves unset (as vLLM's `--generation-config auto`): temperature, top_p, top_k, and max_new_tokens (the
default max_tokens). Only the keys the file has count; values this server cannot use are logged and
ignored, as are sampling settings it does not implement (repetition_penalty, min_p):

    >>> parse_generation_defaults({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": 2})
    GenerationDefaults(temperature=0.6, top_p=0.9, top_k=None, max_tokens=None)

`--generation-config` chooses the source: `auto` (the model's, the default), `none` (the API's own
defaults: temperature 1, top_p 1, no top_k), or a folder holding a generation_config.json.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.logs import get_logger

log = get_logger(__name__)
FILE = "generation_config.json"
# sampling settings a generation_config.json may hold that this server does not implement -> neutral value
NOT_IMPLEMENTED = {"repetition_penalty": 1.0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                   "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "num_beams": 1, "min_new_tokens": 0}


@dataclass(frozen=True)
class GenerationDefaults:
    """None: the file does not set it (the API's default applies)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None

    def present(self) -> dict[str, float | int]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse_generation_defaults(raw: dict[str, Any]) -> GenerationDefaults:
    """The usable sampling defaults of a generation_config.json's contents (pure)."""
    def number(name: str, ok: Any) -> float | None:
        v = raw.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
            log.warning("generation_config.json: unusable value ignored", field=name, value=v)
            return None
        return v

    for name, neutral in NOT_IMPLEMENTED.items():
        if raw.get(name) not in (None, neutral):
            log.warning("generation_config.json: setting not implemented, ignored", field=name, value=raw[name])
    top_k = number("top_k", lambda v: v == int(v) and v >= 0)
    max_tokens = number("max_new_tokens", lambda v: v == int(v) and v >= 1)
    temperature, top_p = number("temperature", lambda v: v >= 0), number("top_p", lambda v: 0 < v <= 1)
    return GenerationDefaults(temperature=None if temperature is None else float(temperature),
                              top_p=None if top_p is None else float(top_p),
                              top_k=None if top_k is None else int(top_k),
                              max_tokens=None if max_tokens is None else int(max_tokens))


def load_generation_defaults(model: str, setting: str = "auto") -> GenerationDefaults:
    """`setting`: auto (the model's generation_config.json, if it has one), none, or a folder holding one.
    Raises ValueError for a folder without the file."""
    if setting == "none":
        return GenerationDefaults()
    if setting == "auto":
        from transformers.utils import cached_file

        from services.model.loader import resolve_model, stderr_log
        ref = resolve_model(model, log=stderr_log)
        try:
            path = cached_file(ref, FILE, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
        except OSError:
            path = None
        if not path:
            return GenerationDefaults()
    else:
        path = str(Path(setting).expanduser() / FILE)
        if not Path(path).is_file():
            raise ValueError(f"--generation-config {setting}: no {FILE} there")
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        log.warning("generation_config.json unreadable: API defaults apply", path=path, error=str(e))
        return GenerationDefaults()
    defaults = parse_generation_defaults(raw if isinstance(raw, dict) else {})
    if defaults.present():
        log.info("sampling defaults from generation_config.json", **defaults.present())
    return defaults
