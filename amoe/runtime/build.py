"""What a runtime process builds from the config: the model shapes it serves, its placement, its communicator's link
delays (emulated runs), its KV capacity, and its executors — torch (real weights) or emulated
(`executor.kind = emulated`: no weights, a cost model).

Runtime-side only: the coordinator learns what it needs (KV blocks, max model length, vocabulary) from each
runtime's Hello, and never builds any of this.
"""

from __future__ import annotations

import logging
from pathlib import Path

from amoe.config import AmoeConfig
from amoe.device import torch_dtype
from amoe.emulation.executor import Emulation
from amoe.emulation.links import link_delays as emulated_link_delays
from amoe.emulation.links import runtime_nodes
from amoe.model.config import ModelConfig, load_model_config
from amoe.placement import Placement
from amoe.runtime.executors import AttentionExecutor, ExpertExecutor, TorchAttention
from amoe.runtime.requests import RankRequests

logger = logging.getLogger(__name__)


def emulation(config: AmoeConfig, model_dir: str | Path | None) -> Emulation | None:
    """The `Emulation` of the executor section, or None when layers run in torch."""
    ex = config.executor
    if ex.kind != "emulated":
        return None
    return Emulation(ex, None if ex.profile is not None else load_model_config(model_dir))


def runtime_model_config(em: Emulation | None, model_dir: str | Path | None) -> ModelConfig:
    """The shapes every runtime of this deployment uses (emulated: the profile's, with the wire width)."""
    return em.model_config if em is not None else load_model_config(model_dir)


def placement(config: AmoeConfig, num_experts: int) -> Placement:
    return Placement.of(config.parallel, num_experts)


def link_delays(config: AmoeConfig, em: Emulation, rank: int) -> tuple[list[float], list[float]]:
    """(latency_s, seconds_per_row) per source runtime for `rank`'s communicator: the emulated GPU's links, with
    runtimes placed on nodes of `executor.gpus_per_node` (emulated runs only)."""
    par, ex = config.parallel, config.executor
    num_expert = 0 if par.mode == "ep" else par.expert_ranks
    nodes = runtime_nodes(par.mode, par.attn_ranks, num_expert, ex.gpus_per_node)
    return emulated_link_delays(em.gpu, em.profile, nodes, rank, ex.time_scale)


def num_kv_blocks(config: AmoeConfig, em: Emulation | None, num_local_experts: int = 0) -> int:
    """KV blocks of one attention rank: `cache.num_kv_blocks`, or (emulated) what the GPU's memory holds beside the
    attention weights and, in EP, the experts sharing the GPU."""
    if em is None:
        return config.cache.num_kv_blocks
    return em.num_kv_blocks(config.cache.block_size, num_local_experts)


def max_model_len(config: AmoeConfig, cfg: ModelConfig, kv_blocks: int) -> int:
    """Tokens a request may reach: the model's limit, the configured one, and one rank's whole KV cache."""
    limit = config.model.max_model_len or cfg.max_position_embeddings
    return min(limit, cfg.max_position_embeddings, kv_blocks * config.cache.block_size)


def attention_executor(
    config: AmoeConfig, model_dir, cfg: ModelConfig, em: Emulation | None, num_local_experts: int = 0
) -> AttentionExecutor:
    """An attention rank: its requests over this rank's KV capacity, and torch or emulated compute."""
    blocks = num_kv_blocks(config, em, num_local_experts)
    requests = RankRequests(
        vocab_size=cfg.vocab_size,
        eos_token_ids=cfg.stop_token_ids,
        num_kv_blocks=blocks,
        block_size=config.cache.block_size,
        max_model_len=max_model_len(config, cfg, blocks),
        skip_prefill=em is not None and config.executor.decode_only,
    )
    if em is not None:
        return AttentionExecutor(requests, em.attention(), cfg)
    from amoe.model.layers import build_attention_rank

    model = build_attention_rank(model_dir, cfg, torch_dtype(config.model.dtype))
    return AttentionExecutor(requests, TorchAttention(model, cfg, blocks, config.cache.block_size), cfg)


def expert_executor(
    config: AmoeConfig, model_dir, cfg: ModelConfig, experts: list[int], em: Emulation | None
):
    """The executor of this runtime's experts (every block of each)."""
    if em is not None:
        return em.expert_executor()
    from amoe.model.layers import build_expert_layers

    return ExpertExecutor(build_expert_layers(model_dir, cfg, experts, torch_dtype(config.model.dtype)))
