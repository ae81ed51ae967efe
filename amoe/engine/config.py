"""Options of the single-process engine (a view of AmoeConfig's model and cache sections, plus batching)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from amoe.config import DEVICE_KINDS, DTYPE_NAMES, AmoeConfig, CacheSection, DeviceSection, OffloadSection
from amoe.errors import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    """How LocalEngine holds the model and batches requests; validated once."""

    dtype: str | None = None  # None or "auto": by device (amoe.device.model_dtype)
    device: str = field(default_factory=lambda: DeviceSection().kind)  # auto | cpu | cuda
    memory_utilization: float = (
        DeviceSection.memory_utilization
    )  # sizes the KV cache when num_kv_blocks is None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # The cache's defaults are the config's (one default per setting).
    block_size: int = CacheSection.block_size
    num_kv_blocks: int | None = CacheSection.num_kv_blocks  # None: from memory_utilization
    max_num_seqs: int = CacheSection.max_num_seqs
    max_num_batched_tokens: int = 8192
    seed: int = 0  # seeds the generators of requests that bring no seed
    # Expert offloading (docs/offload.md), as config.OffloadSection: budget "512MiB" keeps at most that much of the
    # weights resident (dense part + expert slots); record writes the routing of finished sequences.
    offload_budget: str | None = OffloadSection.budget
    offload_policy: str = OffloadSection.policy
    offload_eamc: str | None = OffloadSection.eamc
    offload_record: str | None = OffloadSection.record
    offload_prefetch: bool = OffloadSection.prefetch

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in ("auto", *DTYPE_NAMES):
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPE_NAMES)}; got {self.dtype!r}")
        if self.device not in DEVICE_KINDS:
            raise ConfigError(f"device must be one of {', '.join(DEVICE_KINDS)}; got {self.device!r}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ConfigError(f"memory_utilization must be in (0, 1]; got {self.memory_utilization!r}")
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if name == "num_kv_blocks" and value is None:
                continue
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer; got {value!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len <= 0
        ):
            raise ConfigError(f"max_model_len must be a positive integer; got {self.max_model_len!r}")
        self.offload  # noqa: B018 - validates the offload options now

    @property
    def offload(self) -> OffloadSection:
        return OffloadSection(
            budget=self.offload_budget, policy=self.offload_policy, eamc=self.offload_eamc,
            record=self.offload_record, prefetch=self.offload_prefetch,
        )  # fmt: skip

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
            device=config.device.kind,
            memory_utilization=config.device.memory_utilization,
            max_model_len=config.model.max_model_len,
            block_size=config.cache.block_size,
            num_kv_blocks=config.cache.num_kv_blocks,
            max_num_seqs=config.cache.max_num_seqs,
            seed=config.server.seed,
            **{
                f"offload_{f.name}": getattr(config.offload, f.name)
                for f in dataclasses.fields(OffloadSection)
            },
            **overrides,
        )
