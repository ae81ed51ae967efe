"""`--generation-config`: the sampling defaults a model's creator ships in generation_config.json, applied as vLLM
applies them (ModelConfig.get_diff_sampling_param in vllm/config/model.py).

- "auto" (the default): the model directory's generation_config.json;
- "vllm": none, every default is the engine's own (temperature 1, no filters, max_tokens 16 on completions);
- a directory: the generation_config.json in it.

Only six fields count, as in vLLM: repetition_penalty, temperature, top_k, top_p, min_p and max_new_tokens (which
becomes max_tokens). A request's own value wins over a default, except max_tokens, where the default is also a cap:
a request gets min(what it asked, the context's room, max_new_tokens), as vLLM's get_max_tokens does. Other keys
(do_sample, eos_token_id, ...) are not sampling defaults here: the eos ids come from the checkpoint's config.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from amoe.errors import ConfigError, RequestError

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
# transformers 5's GenerationConfig leaves these unset by default, so its diff against the defaults is every one the
# file sets: the same set as here.
_SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def sampling_defaults(model_dir: str | Path, setting: str = "auto") -> dict[str, Any]:
    """SamplingParams keyword defaults (max_tokens for max_new_tokens), {} when there are none; ConfigError for a
    missing directory, a file that is not a JSON object, or a value no request could have."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        path = Path(model_dir) / FILE
        if not path.is_file():
            return {}
    else:
        folder = Path(setting)
        if not folder.is_dir():
            raise ConfigError(f"--generation-config {setting}: not 'auto', 'vllm' or a directory")
        path = folder / FILE
        if not path.is_file():
            raise ConfigError(f"--generation-config {setting}: the directory has no {FILE}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    defaults = {key: raw[key] for key in _SAMPLING_KEYS if raw.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    _check(defaults, path)
    if defaults:
        logger.warning(
            "default sampling parameters come from %s (%s); requests that set their own keep them. "
            "Pass --generation-config vllm to use none.",
            path, ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())),
        )  # fmt: skip
    return defaults


def _check(defaults: dict[str, Any], path: Path) -> None:
    """Each default must be one a request could send: refuse it at start-up, not on every request."""
    from amoe.sampling_params import SamplingParams

    try:
        SamplingParams(**defaults)
    except (RequestError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
