"""The runtime-facing model API: build a rank's layers from a checkpoint directory, loading only what it needs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from amoe.model.attention import AttnInput, AttnOutput, AttnPlan
from amoe.model.block import AttentionLayer, DecoderLayer
from amoe.model.checkpoint import load_attention_rank_weights, load_expert_weights
from amoe.model.head import Head
from amoe.model.moe import ExpertLayer
from amoe.model.ops import RotaryEmbedding
from amoe.model.spec import ModelConfig

__all__ = [
    "AttentionLayer",
    "AttentionRank",
    "AttnInput",
    "AttnOutput",
    "AttnPlan",
    "ExpertLayer",
    "Head",
    "build_attention_rank",
    "build_expert_layer_set",
    "build_expert_layers",
]


@dataclass
class AttentionRank:
    """An attention rank's model: every block's attention step (block 0 embeds) and the head."""

    layers: list[AttentionLayer]
    head: Head


def build_attention_rank(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> AttentionRank:
    """Load embedding, every layer's attention side (routers, dense MLPs), final norm and lm_head (onto `device`,
    one tensor at a time); no expert weights."""
    w = load_attention_rank_weights(model_dir, cfg, dtype, device)
    rope = RotaryEmbedding(cfg, w.embed.device)
    decoder = [DecoderLayer(layer, cfg, lw, rope) for layer, lw in enumerate(w.layers)]
    layers = [
        AttentionLayer(
            b, cfg, [decoder[i] for i in cfg.block_layers(b)], rope, embed=w.embed if b == 0 else None
        )
        for b in range(cfg.num_blocks)
    ]
    return AttentionRank(layers=layers, head=Head(cfg, w.final_norm, w.lm_head))


def build_expert_layers(
    model_dir: str | Path,
    cfg: ModelConfig,
    experts: list[int] | range,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> dict[tuple[int, int], ExpertLayer]:
    """Expert layers (block, expert) for the given experts of every block, on `device` (id num_experts: the
    shared expert, run as transformers runs an MLP)."""
    loaded = load_expert_weights(model_dir, cfg, experts, dtype=dtype, device=device)
    return {(b, e): ExpertLayer(b, e, w, fused=e < cfg.num_experts) for (b, e), w in loaded.items()}


def build_expert_layer_set(
    model_dir: str | Path,
    cfg: ModelConfig,
    layers: Iterable[tuple[int, int]],
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> dict[tuple[int, int], ExpertLayer]:
    """Expert layers for the given (block, expert) pairs only — a runtime's replicas, which need not cover every
    block — read block by block."""
    experts_of: dict[int, list[int]] = {}
    for b, e in sorted(set(layers)):
        experts_of.setdefault(b, []).append(e)
    out: dict[tuple[int, int], ExpertLayer] = {}
    for b, experts in experts_of.items():
        loaded = load_expert_weights(model_dir, cfg, experts, blocks=[b], dtype=dtype, device=device)
        out.update(
            {key: ExpertLayer(key[0], key[1], w, fused=key[1] < cfg.num_experts) for key, w in loaded.items()}
        )
    return out
