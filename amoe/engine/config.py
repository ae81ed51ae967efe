"""Options of the single-process engine (a view of AmoeConfig's model and cache sections, plus batching)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from amoe.config import DTYPE_NAMES, AmoeConfig, CacheSection
from amoe.errors import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    """How LocalEngine holds the model and batches requests; validated once."""

    dtype: str | None = None  # None: the checkpoint's dtype
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # The cache's defaults are the config's (one default per setting).
    block_size: int = CacheSection.block_size
    num_kv_blocks: int = CacheSection.num_kv_blocks
    max_num_seqs: int = CacheSection.max_num_seqs
    max_num_batched_tokens: int = 8192
    seed: int = 0  # seeds the generators of requests that bring no seed

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_NAMES)}; got {self.dtype!r}")
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer; got {value!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len <= 0
        ):
            raise ConfigError(f"max_model_len must be a positive integer; got {self.max_model_len!r}")

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from keyword options, naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**options)

    @classmethod
    def from_amoe_config(cls, config: AmoeConfig, **overrides: Any) -> EngineConfig:
        """The engine view of a deployment config."""
        return cls.from_options(
            dtype=config.model.dtype,
            max_model_len=config.model.max_model_len,
            block_size=config.cache.block_size,
            num_kv_blocks=config.cache.num_kv_blocks,
            max_num_seqs=config.cache.max_num_seqs,
            **overrides,
        )
