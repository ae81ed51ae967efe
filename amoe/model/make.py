"""Random-weight checkpoints in the Hugging Face layout of any family (weights, tokenizer, generation config),
and where the shipped default model is."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from amoe.errors import ConfigError, ModelLoadError
from amoe.model.presets import preset as preset_config

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# Package data, so that a fresh clone and an installed wheel both serve it without building anything.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "data" / "kjv-moe"


def make_model(
    preset: str, out_dir: str | Path, seed: int = 0, overrides: dict[str, Any] | None = None, shards: int = 1
) -> Path:
    """Write a random-weight model of a named preset to `out_dir`; the same preset and seed give the same bytes."""
    # Imported here, not at the top: the coordinator finds the default model without loading torch.
    from amoe.model.checkpoint import write_random_checkpoint
    from amoe.tokenizer import write_tokenizer

    hf_config = {**preset_config(preset), **(overrides or {})}
    out = Path(out_dir)
    _require_empty(out)
    vocab_size = hf_config["vocab_size"]
    # The tokenizer first: it validates vocab_size before the larger checkpoint is written.
    num_tokens = write_tokenizer(out, vocab_size, model_max_length=hf_config["max_position_embeddings"])
    if num_tokens > vocab_size:
        raise RuntimeError(f"tokenizer has {num_tokens} tokens, more than the model's {vocab_size}")
    if num_tokens < vocab_size:
        logger.warning(
            "tokenizer has %d tokens for %d model ids; the rest decode to nothing", num_tokens, vocab_size
        )
    write_random_checkpoint(hf_config, out, seed, shards=shards)
    _write_generation_config(out, hf_config)
    logger.info("wrote random-weight %s model (seed %d) to %s", preset, seed, out)
    return out


def default_model_path() -> Path:
    """The default model: a small Mixtral trained on the King James Bible, shipped with the package
    (`amoe default-model train` reproduces it)."""
    if not DEFAULT_MODEL_DIR.is_dir():
        raise ModelLoadError(f"{DEFAULT_MODEL_DIR}: the default model is missing from this installation")
    return DEFAULT_MODEL_DIR


def _require_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory; refusing to overwrite it")


def _write_generation_config(out: Path, hf_config: dict[str, Any]) -> None:
    config = {
        "_from_model_config": True,
        "bos_token_id": hf_config.get("bos_token_id"),
        "eos_token_id": hf_config.get("eos_token_id"),
    }
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
