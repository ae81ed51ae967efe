"""`--parallel pingpong`: MegaScale-Infer's disaggregated ping-pong pipeline (§4), in lock-step.

A attention devices and E expert devices. Each attention device splits its iteration's batch into m micro-batches
of whole chunks. For every block, micro-batch i goes attention → all expert devices (M2N: an expert device waits
for micro-batch i from every attention device, its barrier per (micro-batch, block)) → back (N2M: the attention
device waits for every expert device). The attention side computes micro-batch i+1 while the experts run i, so
with T_a ≈ T_e both pools stay busy and one iteration takes `t_total(...)` (the paper's Eq. 5).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from amoe import core
from amoe.device import Device
from amoe.runtime.requests import HeadOutput
from amoe.runtime.sync.batch import Chunk, LayerBatch, attention_batch, split_micro_batches
from amoe.runtime.sync.device import SyncDevice
from amoe.runtime.sync.exchange import barrier_exchange
from amoe.runtime.sync.iterate import serve_iterations
from amoe.runtime.sync.moe import Routed, receive_combine, send_dispatch, serve_experts


def t_total(t_a: float, t_e: float, t_c: float, m: int, num_blocks: int) -> float:
    """MegaScale-Infer Eq. 5: (T_a + T_e + 2 T_c) + T_f (m L − 1), T_f = max(T_a, T_e); valid when
    m T_f ≥ 2 (T_f + T_c). For m = 1 there is no overlap: L (T_a + T_e + 2 T_c)."""
    if m == 1:
        return num_blocks * (t_a + t_e + 2 * t_c)
    return (t_a + t_e + 2 * t_c) + max(t_a, t_e) * (m * num_blocks - 1)


@torch.inference_mode()
def run_pingpong_loop(
    device: SyncDevice,
    comm: core.Communicator,
    stop: threading.Event,
    publish: Callable[[HeadOutput], None],
    *,
    micro_batches: int = 2,
    timeout_s: float = 10.0,
    poll_s: float = 0.005,
) -> None:
    """Serve as one attention or expert device until any device's `stop` is set; EngineDeadError when a peer is
    silent for `timeout_s` at a barrier. Every device of a deployment must use the same `micro_batches`."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1; got {micro_batches}")
    ex = barrier_exchange(device, comm, timeout_s)
    role = _attention_iteration if device.attention is not None else _expert_iteration

    def iteration(it: int, chunks: list[Chunk]) -> list[HeadOutput]:
        return role(device, ex, it, chunks, micro_batches)

    serve_iterations(device, ex, stop, iteration, publish, poll_s)


class _MicroBatch:
    """One micro-batch on the attention side: its chunks and what its last step left for the next."""

    def __init__(self, chunks: list[Chunk], rank: int) -> None:
        self.batch = attention_batch(chunks, rank) if chunks else None
        self.residual = self.plan = self.routed = None


def _attention_iteration(
    device: SyncDevice, ex: core.BarrierExchange, it: int, chunks: list[Chunk], m: int
) -> list[HeadOutput]:
    """Block 0 of every micro-batch, then for each block: wait for micro-batch i's experts, run its next
    attention (or head) and send it on, while the experts work on micro-batch i+1."""
    mbs = [_MicroBatch(c, device.attn_rank) for c in split_micro_batches(chunks, m)]
    outputs = []
    for i, mb in enumerate(mbs):
        _attend_and_send(device, ex, mb, mb.batch, it, 0, i)
    last = device.cfg.num_blocks
    for block in range(1, last + 1):
        for i, mb in enumerate(mbs):
            step = _collect(device, ex, mb, block)
            if block < last:
                _attend_and_send(device, ex, mb, step, it, block, i)
            elif step is not None:
                outputs.append(device.head(step))
    return outputs + device.take_failures()


def _collect(device: SyncDevice, ex: core.BarrierExchange, mb: _MicroBatch, block: int) -> LayerBatch | None:
    """Wait for the micro-batch's expert outputs (N2M barrier) → its input to attention(block) or the head; None
    when it has no rows (any more: a failed micro-batch ends its requests and goes on empty)."""
    expert_out = receive_combine(ex, mb.plan, device.stats)
    if mb.batch is None:
        return None
    if expert_out is None:
        device.fail(mb.batch, f"an expert layer of block {block - 1} failed on an expert device")
        mb.batch = None
        return None
    return mb.batch.at_block(block, mb.residual, expert_out, mb.routed.topk_ids)


def _attend_and_send(
    device: SyncDevice,
    ex: core.BarrierExchange,
    mb: _MicroBatch,
    step: LayerBatch | None,
    it: int,
    block: int,
    micro: int,
) -> None:
    out = device.attend(step) if step is not None else None
    if out is None:  # an empty (or just failed) micro-batch still sends every expert device its (empty) part
        mb.residual, mb.routed = None, Routed.empty(device.cfg.hidden_size, device.cfg.experts_per_token)
        mb.batch = None  # a failed one has ended its requests: it goes on without rows
    else:
        mb.residual, moe_input, ids, weights = out
        mb.routed = Routed(Device.host(moe_input), ids, weights, step.request_ids, step.positions)
    mb.plan = send_dispatch(ex, it, block, micro, mb.routed, slots=device.slots)


def _expert_iteration(
    device: SyncDevice, ex: core.BarrierExchange, it: int, chunks: list[Chunk], m: int
) -> list[HeadOutput]:
    """Lock-step: (block, micro-batch) in the order the attention side sends them; no head runs here."""
    for block in range(device.cfg.num_blocks):
        for i in range(m):
            serve_experts(
                ex, it, block, i, device.attn_devices, device.experts, device.stats, slots=device.slots
            )
    return []
