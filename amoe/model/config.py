"""Reading a checkpoint's config.json into a ModelConfig (amoe.model.spec), with the family module its
`architectures` names (amoe.model.families); every problem is one line naming the file."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from amoe.errors import ModelLoadError
from amoe.model.families import family_of
from amoe.model.spec import MlaShape, ModelConfig, RouterSpec, Yarn

__all__ = ["MlaShape", "ModelConfig", "RouterSpec", "Yarn", "load_model_config", "model_config_from_hf"]

logger = logging.getLogger(__name__)


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Parse a Hugging Face config dict with its family's module; raises ValueError/KeyError/TypeError."""
    return family_of(hf).config(hf)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate <model_dir>/config.json; every problem is one ModelLoadError line naming the file."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing (a Hugging Face model directory needs config.json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: unreadable: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    try:
        config = model_config_from_hf(hf)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing key {exc.args[0]!r}") from None
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    logger.debug("[model] loaded %s: %s", path, config)
    return config
