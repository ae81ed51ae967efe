"""The MoE all-to-all of the synchronous modes, on the C++ barrier exchange (cpp/exchange.h): the attention side
dispatches its routed rows to every expert device and combines their replies back into router order; an expert
device collects every source's rows, runs its hosted experts once each, and replies."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from amoe import core
from amoe.runtime.sync.batch import LayerBatch
from amoe.runtime.sync.stats import SyncStats

logger = logging.getLogger(__name__)


@dataclass
class Routed:
    """An attention step's rows on their way to the experts."""

    moe_input: torch.Tensor  # [N, H]
    topk_ids: torch.Tensor  # [N, K]
    topk_weights: torch.Tensor  # [N, K]
    request_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]

    @classmethod
    def empty(cls, hidden: int, top_k: int, dtype: torch.dtype = torch.float32) -> Routed:
        """What a device with no rows this iteration sends: nothing, but to every peer (the barrier needs it)."""
        none = torch.zeros(0, dtype=torch.int64)
        return cls(
            torch.zeros(0, hidden, dtype=dtype),
            torch.zeros(0, top_k, dtype=torch.int64),
            torch.zeros(0, top_k),
            none,
            none,
        )


def send_dispatch(
    ex: core.BarrierExchange,
    iteration: int,
    block: int,
    micro: int,
    routed: Routed,
    step_s: float = 0.0,
    slots=None,
) -> core.DispatchPlan:
    """Dispatch half of the all-to-all: one message (maybe zero rows) to every expert device, saying how long
    the attention step that made it took (`step_s`, what the expert side's barrier counts waits by); with `slots`
    (a SlotMap) each copy goes to a slot of its expert. The merge keeps reading the expert ids."""
    r = routed
    ids = slots.physical(block, r.topk_ids) if slots is not None else r.topk_ids
    return ex.dispatch(
        iteration, block, micro, r.moe_input, ids, r.topk_weights, r.request_ids, r.positions, step_s
    )


def serve_experts(
    ex: core.BarrierExchange, iteration: int, block: int, micro: int, sources: Sequence[int], executor,
    stats: SyncStats, kernel: Callable[[list[LayerBatch]], str] | None = None, own_s: float | None = None,
    slots=None,
) -> float:  # fmt: skip
    """An expert device's part of one all-to-all: wait for every source (the barrier), run, send back. If the input
    cannot run or an expert layer raises, every source still gets its reply (the barrier must complete), flagged
    failed, so the sources end the requests concerned instead of reading outputs that were never computed.
    `kernel(the experts' batches)` names the GEMM of an EP pipeline chunk (grouped | dense); None: the grouped
    step. `own_s`: this device's attention step before the barrier (EP), whose wait for the slowest source's is
    counted; None: it has none (an expert-only device). With `slots` (a SlotMap) the groups are slots, run as the
    experts they hold. Returns the expert step's busy seconds."""
    with stats.waiting():
        work = ex.collect(iteration, block, micro, list(sources))
    if own_s is not None:
        stats.waited_for_slower(own_s, ex.slowest_step_s, attention=True)
    if work.error:
        logger.error("[sync] runtime %d cannot run the experts of block %d: %s", ex.rank, block, work.error)
        ex.reply(work, [], failed=True)
        return 0.0
    experts = [g.expert if slots is None else slots.logical(block, g.expert) for g in work.groups]
    batches = [
        LayerBatch(
            kind="expert", block=block, index=e, request_ids=g.request_ids, positions=g.positions, x=g.x,
            weights=g.weights,
        )
        for g, e in zip(work.groups, experts)
    ]  # fmt: skip
    try:
        with stats.busy():
            if kernel is None:
                outs = executor.run_grouped(batches)  # every hosted expert of the block in one grouped step
            else:
                outs = executor.run_experts(batches, kernel(batches))
    except Exception:  # noqa: BLE001 - one bad batch fails its own requests, never the group
        logger.exception("[sync] experts of block %d failed (iteration %d, mb %d)", block, iteration, micro)
        ex.reply(work, [], failed=True)
        return stats.take_step()
    for g, e in zip(work.groups, experts):
        stats.count_expert_rows(block, e, g.num_rows)
    step_s = stats.take_step()
    ex.reply(work, outs, step_s=step_s)
    return step_s


def receive_combine(
    ex: core.BarrierExchange, plan: core.DispatchPlan, stats: SyncStats, own_s: float | None = None
) -> torch.Tensor | None:
    """Combine half: wait for every expert device (the barrier) → expert_out [N, K, H]; None if an expert device
    failed on these rows. `own_s`: this device's expert step before the barrier (EP), whose wait for the slowest
    expert device's is counted; None: it has none."""
    with stats.waiting():
        out = ex.combine(plan)
    if own_s is not None:
        stats.waited_for_slower(own_s, ex.slowest_step_s, attention=False)
    return out
