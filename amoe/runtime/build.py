"""What a runtime process builds from the config: the model shapes it serves, its placement by `parallel.mode`,
and its executors — torch (real weights) or emulated (`executor.kind = emulated`: no weights, a cost model).

Shared by the runtime processes (`amoe/runtime/worker.py`, `amoe/runtime/sync_runtime.py`) and the coordinator
(`amoe/backends/cluster.py`, `coordinator/cluster.py`), so both sides agree on shapes, roles and KV capacity.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amoe.config import AmoeConfig
from amoe.errors import ConfigError
from amoe.model.config import ModelConfig, load_model_config

logger = logging.getLogger(__name__)

# Width of the placeholder rows emulated runtimes exchange: costs always use the profile's real hidden size, so
# a narrow wire only saves the host's copies (16 floats = 64 bytes per row instead of 16 kB for Mixtral).
EMULATED_WIRE_HIDDEN = 16


def is_emulated(config: AmoeConfig) -> bool:
    return config.executor.kind == "emulated"


def needs_checkpoint(config: AmoeConfig) -> bool:
    """False when an emulated profile names the model: shapes come from the profile, no weights are read."""
    return not (is_emulated(config) and config.executor.profile is not None)


def emulation(config: AmoeConfig, model_dir: str | Path | None) -> Any:
    """The `Emulation` of the executor section (emulated runs only)."""
    from amoe.emulation.executor import Emulation, EmulationConfig

    ex = config.executor
    em_config = EmulationConfig(
        gpu=ex.gpu, model=ex.profile, top_k=ex.top_k, time_scale=ex.time_scale, routing=ex.routing,
        seed=ex.seed, host=ex.host_overhead, wire_hidden=EMULATED_WIRE_HIDDEN, decode_only=ex.decode_only,
    )  # fmt: skip
    checkpoint = None if ex.profile is not None else load_model_config(model_dir)
    return Emulation(em_config, checkpoint)


def runtime_model_config(config: AmoeConfig, model_dir: str | Path | None) -> ModelConfig:
    """The shapes every runtime of this deployment uses (emulated: the profile's, with the wire width)."""
    if is_emulated(config):
        return emulation(config, model_dir).model_config
    return load_model_config(model_dir)


@dataclass(frozen=True)
class Placement:
    """Which runtime does what, by `parallel.mode`: roles[i] is runtime i's ("attention" | "expert")."""

    mode: str
    roles: tuple[str, ...]
    attn: tuple[int, ...]  # runtimes that run attention (DP rank = position)
    hosts: tuple[int, ...]  # runtimes that host experts
    expert_device: tuple[int, ...]  # expert e lives on runtime expert_device[e]

    def experts_of(self, runtime: int) -> list[int]:
        return [e for e, d in enumerate(self.expert_device) if d == runtime]


def placement(config: AmoeConfig, num_experts: int) -> Placement:
    """aep / pingpong: A attention + M expert runtimes, expert e on A + e mod M; ep: N runtimes, each an
    attention rank and the experts e with e mod N == its rank (their role is "attention": they take requests)."""
    par = config.parallel
    a, m = par.attn_ranks, par.expert_ranks
    if par.mode == "ep":
        attn = tuple(range(a))
        return Placement("ep", ("attention",) * a, attn, attn, tuple(e % a for e in range(num_experts)))
    if m > num_experts:
        raise ConfigError(f"parallel.expert_ranks ({m}) exceeds the model's {num_experts} experts")
    hosts = tuple(range(a, a + m))
    expert_device = tuple(a + e % m for e in range(num_experts))
    return Placement(par.mode, ("attention",) * a + ("expert",) * m, tuple(range(a)), hosts, expert_device)


def link_delays(config: AmoeConfig, em: Any, rank: int) -> tuple[list[float], list[float]]:
    """(latency_s, seconds_per_row) per source runtime for `rank`'s communicator: the emulated GPU's links, with
    runtimes placed on nodes of `executor.gpus_per_node` (emulated runs only)."""
    from amoe.emulation.links import link_delays as delays
    from amoe.emulation.links import runtime_nodes

    par, ex = config.parallel, config.executor
    num_expert = 0 if par.mode == "ep" else par.expert_ranks
    nodes = runtime_nodes(par.mode, par.attn_ranks, num_expert, ex.gpus_per_node)
    return delays(em.gpu, em.profile, nodes, rank, ex.time_scale)


def kv_blocks(config: AmoeConfig, em: Any, num_local_experts: int = 0) -> int:
    """KV blocks of one attention rank: `cache.num_blocks`, or (emulated) what the GPU's memory holds beside the
    attention weights and, in EP, the experts sharing the GPU."""
    if em is None:
        return config.cache.num_blocks
    from amoe.emulation import cost_model

    weights = cost_model.attention_rank_weight_bytes(em.profile)
    if num_local_experts:
        weights += cost_model.expert_rank_weight_bytes(em.profile, num_local_experts)
    blocks = cost_model.kv_capacity_tokens(em.gpu, em.profile, weights) // config.cache.block_size
    if blocks < 1:
        raise ConfigError(f"{em.profile.name}'s weights leave no room for KV on a {em.gpu.name}")
    return int(blocks)


def max_model_len(config: AmoeConfig, cfg: ModelConfig, num_kv_blocks: int | None = None) -> int:
    """Tokens a request may reach: the model's limit, the configured one, and one rank's whole KV cache."""
    limit = config.model.max_model_len or cfg.max_position_embeddings
    blocks = config.cache.num_blocks if num_kv_blocks is None else num_kv_blocks
    return min(limit, cfg.max_position_embeddings, blocks * config.cache.block_size)


def deployment_max_model_len(config: AmoeConfig, model_dir: str | Path | None) -> int:
    """max_model_len as the coordinator sees it (before any runtime reports)."""
    cfg = runtime_model_config(config, model_dir)
    if not is_emulated(config):
        return max_model_len(config, cfg)
    em = emulation(config, model_dir)
    local = len(placement(config, cfg.num_experts).experts_of(0)) if config.parallel.mode == "ep" else 0
    return max_model_len(config, cfg, kv_blocks(config, em, local))


def attention_executor(config: AmoeConfig, model_dir, cfg: ModelConfig, engine: Any, em: Any, local: int = 0):
    """The attention rank's executor over `engine` (a core.Engine, or a TokenInbox in the synchronous modes)."""
    from amoe.runtime.executors import AttentionExecutor

    blocks = kv_blocks(config, em, local)
    limit = max_model_len(config, cfg, blocks)
    if em is not None:
        return em.attention_executor(
            engine, kv_blocks=blocks, block_size=config.cache.block_size, max_model_len=limit
        )
    from amoe.model.layers import build_attention_rank

    model = build_attention_rank(model_dir, cfg, torch_dtype(config))
    return AttentionExecutor(engine, model, cfg, blocks, config.cache.block_size, limit)


def expert_executor(config: AmoeConfig, model_dir, cfg: ModelConfig, experts: list[int], em: Any):
    """The executor of this runtime's experts (every block of each)."""
    if em is not None:
        return em.expert_executor()
    from amoe.model.layers import build_expert_layers
    from amoe.runtime.executors import ExpertExecutor

    return ExpertExecutor(build_expert_layers(model_dir, cfg, experts, torch_dtype(config)))


def torch_dtype(config: AmoeConfig) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        config.model.dtype
    ]
