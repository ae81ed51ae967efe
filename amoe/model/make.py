"""Random-weight checkpoints in the Hugging Face layout of any family (weights, tokenizer, generation config)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from amoe import envs
from amoe.errors import ConfigError
from amoe.model.presets import preset as preset_config

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
DEMO_PRESET = "tiny"
# Bump the suffix whenever make_model's output changes, so that caches made by older versions are not reused.
DEMO_MODEL_NAME = "tiny-v2"

_announced = False


def make_model(
    preset: str, out_dir: str | Path, seed: int = 0, overrides: dict[str, Any] | None = None, shards: int = 1
) -> Path:
    """Write a random-weight model of a named preset to `out_dir`; the same preset and seed give the same bytes."""
    # Imported here, not at the top: the coordinator finds an existing demo model without loading torch.
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
    """The tiny random-weight demo model, created under the user cache directory on first use."""
    path = envs.AMOE_CACHE_DIR / "models" / DEMO_MODEL_NAME
    if not path.is_dir():
        _build_atomically(path)
    _announce(path)
    return path


def _build_atomically(path: Path) -> None:
    """Build in a private temp dir, then rename: readers never see a half-written model, racing builders agree."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        logger.info("creating the demo model in %s (first use only)", path)
        make_model(DEMO_PRESET, tmp, seed=0)
        try:
            os.rename(tmp, path)  # atomic; fails if another process renamed its (identical) copy first
        except OSError:
            if not path.is_dir():
                raise
            logger.debug("another process created %s first; using its copy", path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _announce(path: Path) -> None:
    global _announced
    if not _announced:
        _announced = True
        logger.warning("using the random-weight demo model %s: its output is meaningless text", path)


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
