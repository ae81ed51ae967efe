"""Thin typed layer over the C++ core (`amoe._core`): engine configs, messages, communicators, and the hand-off
of a layer's outputs to the engine. The one module that loads the extension."""

from __future__ import annotations

from collections.abc import Sequence

# torch first: amoe._core links against libc10 and needs it loaded.
import torch

from amoe import _core
from amoe.config import CacheSection, SchedulerSection
from amoe.expert_map import ExpertMap
from amoe.placement import Placement

ATTN, EXPERT = 0, 1
PLANES = ("inline", "gloo", "nccl")  # tensor planes of ZmqCommunicator (docs/communicator.md)

Batch = _core.Batch
BarrierExchange = _core.BarrierExchange
Communicator = _core.Communicator
DispatchPlan = _core.DispatchPlan
Engine = _core.Engine
EngineConfig = _core.EngineConfig
LoopbackHub = _core.LoopbackHub
Message = _core.Message
Scheduler = _core.Scheduler
ZmqCommunicator = _core.ZmqCommunicator
group_by_destination = _core.group_by_destination


# The longest a runtime under waves holds for a returning wave (cpp/engine.cpp): a guard against a part that never
# returns (a lost row, a failed expert batch), far above a round trip (milliseconds), not a tuning knob.
MAX_WAVE_HOLD_S = 1.0


def engine_config(
    runtime: int,
    placement: Placement,
    *,
    num_blocks: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    scheduler: SchedulerSection | None = None,
    track_requests: bool = False,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    expert_map: ExpertMap | None = None,
) -> EngineConfig:
    """The EngineConfig of one runtime in a placement, scheduled as the config's scheduler section says (its
    defaults when None); validated here so mistakes raise at build time. `track_requests`: an attention
    runtime that holds request state drops rows of requests it does not hold (docs/engine.md). `time_scale`:
    the wall seconds per emulated second of an emulated executor, which stretch the waves policy's hold guard.
    `max_requests`: the most requests an attention runtime holds at once (the cache's max_num_seqs, its default
    when None); under the waves policy its W = ceil(max_requests / attn_batch_cap) waves (docs/scheduler.md
    "Wave size"), which an expert runtime's block 0 uses too (the meeting block). `expert_map`: the live
    placement's replicas (docs/rebalancing.md) an attention runtime routes by and an expert runtime hosts; None:
    each expert of every block on its home runtime."""
    sched = scheduler or SchedulerSection()
    cfg = EngineConfig()
    cfg.runtime_id = runtime
    rank = placement.attn_rank_of(runtime)
    cfg.is_attention = rank is not None
    cfg.attn_rank = rank if rank is not None else 0
    cfg.experts = placement.experts_of(runtime)
    cfg.num_blocks, cfg.num_experts, cfg.top_k, cfg.hidden = num_blocks, num_experts, top_k, hidden
    cfg.expert_runtime = list(placement.expert_runtime)
    cfg.attn_runtime = list(placement.attn_runtime)
    if expert_map is not None:
        cfg.replicas = [list(where) for row in expert_map.replicas for where in row]
        if not cfg.is_attention:
            cfg.hosted = sorted(b * num_experts + e for b, e in expert_map.hosted_by(runtime))
    cfg.policy, cfg.lookahead, cfg.decay = sched.policy, sched.lookahead, sched.decay
    cfg.attn_cap, cfg.expert_cap = sched.attn_batch_cap, sched.expert_batch_cap
    cfg.group_experts = int(sched.group_experts)
    # The guard is emulated time like every step: unscaled, a wave held at time scale 40 would be released after
    # 25 emulated ms, shorter than one ITL, and the guard would decide what the policy does.
    cfg.max_wave_hold_s = MAX_WAVE_HOLD_S * time_scale
    cfg.track_requests = track_requests and cfg.is_attention
    if sched.policy == "waves":  # attention: its waves; experts: block 0's meeting span
        requests = CacheSection().max_num_seqs if max_requests is None else max_requests
        cfg.num_waves = max(1, -(-requests // sched.attn_batch_cap))
        cfg.wave_group = sched.wave_group  # expert side: its groups of those waves (group cells)
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


def enter(engine: Engine, rows) -> None:
    """New rows for ATTN (0, rank): `rows` has per-row lists request_ids, token_ids, positions, chunk_starts and
    chunk_lens (amoe.runtime.requests.Rows)."""
    engine.add_tokens(
        torch.tensor(rows.request_ids, dtype=torch.int64),
        torch.tensor(rows.token_ids, dtype=torch.int64),
        torch.tensor(rows.positions, dtype=torch.int64),
        torch.tensor(rows.chunk_starts, dtype=torch.int64),
        torch.tensor(rows.chunk_lens, dtype=torch.int64),
    )


def submit(engine: Engine, batch: Batch, outputs) -> None:
    """Hands a layer's outputs on, like every layer: expert `out [N, H]`; attention `(residual, moe_input,
    topk_ids, topk_weights)`; head: its HeadOutput, whose continuing tokens re-enter ATTN (0, rank) and whose
    finished requests are no longer held. A batch that failed (a HeadOutput from a non-head layer) hands nothing
    on: its requests are forgotten, with whatever of them still waits here."""
    if isinstance(outputs, torch.Tensor):
        engine.submit_expert(batch, outputs)
    elif isinstance(outputs, tuple):
        engine.submit_attention(batch, *outputs)
    elif batch.kind == "head":
        rows = outputs.next
        engine.submit_head(
            batch,
            torch.tensor(rows.request_ids, dtype=torch.int64),
            torch.tensor(rows.token_ids, dtype=torch.int64),
            torch.tensor(rows.positions, dtype=torch.int64),
            torch.tensor(outputs.finished, dtype=torch.int64),
        )
    else:
        engine.forget(torch.tensor(outputs.finished, dtype=torch.int64), purge=True)
