"""ModelConfig: the model's shape, parsed and validated from a Hugging Face Mixtral config.json."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amoe.config import DTYPE_NAMES
from amoe.errors import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("MixtralForCausalLM",)
SUPPORTED_MODEL_TYPES = ("mixtral",)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Mixtral-style MoE decoder; every field validated once in __post_init__."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_blocks: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    # Beyond the contract: HF allows several eos ids; all of them end a request.
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's dtype

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_blocks",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_experts",
            "top_k",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or null, got {self.sliding_window}")
        specials = [("bos_token_id", self.bos_token_id), ("eos_token_id", self.eos_token_id)]
        specials += [("eos_token_id", t) for t in self.eos_token_ids]
        for name, value in specials:
            if value is not None and (not isinstance(value, int) or not 0 <= value < self.vocab_size):
                raise ValueError(f"{name} {value!r} is outside the vocabulary [0, {self.vocab_size})")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every eos id of the model (the first is eos_token_id)."""
        if self.eos_token_ids:
            return self.eos_token_ids
        return () if self.eos_token_id is None else (self.eos_token_id,)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face Mixtral config dict; raises ValueError/KeyError/TypeError on bad input."""
        _check_architecture(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        eos = hf.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_blocks=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or _head_dim(hidden, heads),
            num_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=_rope_theta(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096 * 32),
            sliding_window=hf.get("sliding_window"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id", 1),
            eos_token_id=eos_ids[0] if eos_ids else None,
            eos_token_ids=eos_ids,
            dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch."),
        )


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
        config = ModelConfig.from_hf_dict(hf)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing key {exc.args[0]!r}") from None
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    logger.debug("[model] loaded %s: %s", path, config)
    return config


def _check_architecture(hf: dict[str, Any]) -> None:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if archs:
        unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
        if unsupported:
            raise ValueError(
                f"unsupported architecture {unsupported[0]!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
    elif model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def _head_dim(hidden: int, heads: int) -> int:
    if heads <= 0 or hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return hidden // heads


def _rope_theta(hf: dict[str, Any]) -> float:
    """transformers 5 keeps rope settings under rope_parameters; older files have rope_theta / rope_scaling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default' RoPE)")
    theta = params.get("rope_theta", hf.get("rope_theta", 1e6))
    return float(theta)
