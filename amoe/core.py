"""Thin typed layer over the C++ core (`amoe._core`): engine configs, placement, messages, communicators."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from amoe import _core

ATTN, EXPERT = 0, 1
POLICIES = ("defrag", "mtfs", "flfs")
PLANES = ("inline", "gloo", "nccl")  # tensor planes of ZmqCommunicator (docs/communicator.md)

Batch = _core.Batch
Communicator = _core.Communicator
Engine = _core.Engine
EngineConfig = _core.EngineConfig
LoopbackHub = _core.LoopbackHub
Message = _core.Message
Scheduler = _core.Scheduler
ZmqCommunicator = _core.ZmqCommunicator


@dataclass(frozen=True)
class Placement:
    """Which runtime serves each attention DP rank and each expert (the same expert id in every block)."""

    attn_runtime: tuple[int, ...]
    expert_runtime: tuple[int, ...]

    @classmethod
    def disaggregated(cls, num_attn_ranks: int, num_expert_ranks: int, num_experts: int) -> Placement:
        """Runtimes 0..A-1 run attention; the experts go round-robin over runtimes A..A+M-1 (paper §3.3)."""
        return cls(
            attn_runtime=tuple(range(num_attn_ranks)),
            expert_runtime=tuple(num_attn_ranks + e % num_expert_ranks for e in range(num_experts)),
        )

    @property
    def num_runtimes(self) -> int:
        return max(self.attn_runtime + self.expert_runtime) + 1

    def experts_of(self, runtime: int) -> list[int]:
        return [e for e, r in enumerate(self.expert_runtime) if r == runtime]

    def attn_rank_of(self, runtime: int) -> int | None:
        return self.attn_runtime.index(runtime) if runtime in self.attn_runtime else None


def engine_config(
    runtime: int,
    placement: Placement,
    *,
    num_blocks: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    policy: str = "defrag",
    lookahead: int = 3,
    decay: float = 0.5,
    attn_cap: int = 256,
    expert_cap: int = 512,
) -> EngineConfig:
    """The EngineConfig of one runtime in a placement; validated here so mistakes raise at build time."""
    if policy not in POLICIES:
        raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {POLICIES}")
    cfg = EngineConfig()
    cfg.runtime_id = runtime
    rank = placement.attn_rank_of(runtime)
    cfg.is_attention = rank is not None
    cfg.attn_rank = rank if rank is not None else 0
    cfg.experts = placement.experts_of(runtime)
    cfg.num_blocks, cfg.num_experts, cfg.top_k, cfg.hidden = num_blocks, num_experts, top_k, hidden
    cfg.expert_runtime = list(placement.expert_runtime)
    cfg.attn_runtime = list(placement.attn_runtime)
    cfg.policy, cfg.lookahead, cfg.decay = policy, lookahead, decay
    cfg.attn_cap, cfg.expert_cap = attn_cap, expert_cap
    cfg.validate()
    return cfg


_ROW_FIELDS = ("request_id", "kind", "block", "index", "position", "chunk_start", "chunk_len", "slot")


def make_message(data: torch.Tensor, **rows: Sequence[int] | Sequence[float] | torch.Tensor) -> Message:
    """A message from per-row arrays; expert_id defaults to -1, weight to 0, attn_rank to 0, chunk to 1 row."""
    n = data.shape[0]

    def col(name, default, dtype=torch.int64):
        value = rows.get(name)
        if value is None:
            if default is None:
                raise ValueError(f"make_message needs {name}")
            return torch.full((n,), default, dtype=dtype)
        return torch.as_tensor(value, dtype=dtype).reshape(n)

    position = col("position", None)
    return Message(
        request_id=col("request_id", None),
        kind=col("kind", None),
        block=col("block", None),
        index=col("index", None),
        position=position,
        chunk_start=col("chunk_start", None) if "chunk_start" in rows else position,
        chunk_len=col("chunk_len", 1),
        slot=col("slot", 0),
        expert_id=col("expert_id", -1),
        weight=col("weight", 0.0, torch.float32),
        attn_rank=col("attn_rank", 0),
        data=data,
    )


def submit(engine: Engine, batch: Batch, outputs) -> None:
    """Hands a layer's outputs back to the engine: expert `out [N, H]`; attention
    `(residual, moe_input, topk_ids, topk_weights)`; head: nothing (its tokens re-enter via add_tokens)."""
    if batch.kind == "expert":
        engine.submit_expert(batch, outputs)
    elif outputs is None:
        engine.submit_head(batch)
    else:
        engine.submit_attention(batch, *outputs)
