"""`--parallel ep`: synchronous expert parallelism, what SGLang / vLLM EP do (the AMoE paper's baseline, §5).

N devices; device d is attention DP rank d and hosts experts {e : e mod N == d}. An iteration carries one batch
per device through every block: attention → router → all-to-all dispatch → barrier → experts → all-to-all
combine → barrier → merge; then the head samples. New requests join only at iteration boundaries. Under skewed
routing every device waits at the combine barrier for the device of the hottest expert: that wait is
`stats()["wait_s"]`, the stall of AMoE Figure 4b.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from amoe import core
from amoe.device import Device
from amoe.runtime.requests import HeadOutput
from amoe.runtime.sync.batch import Chunk, LayerBatch, attention_batch
from amoe.runtime.sync.device import SyncDevice
from amoe.runtime.sync.eps import ExpertPipeline, pipelined_moe
from amoe.runtime.sync.exchange import barrier_exchange
from amoe.runtime.sync.iterate import serve_iterations
from amoe.runtime.sync.moe import Routed, receive_combine, send_dispatch, serve_experts


@torch.inference_mode()
def run_ep_loop(
    device: SyncDevice,
    comm: core.Communicator,
    stop: threading.Event,
    publish: Callable[[HeadOutput], None],
    *,
    timeout_s: float = 10.0,
    poll_s: float = 0.005,
    pipeline: ExpertPipeline | None = None,
) -> None:
    """Serve as one EP device until any device's `stop` is set. Raises EngineDeadError when a peer is silent
    for `timeout_s` at a barrier. `pipeline`: EPS-MoE's expert pipeline (amoe.runtime.sync.eps); None: none."""
    ex = barrier_exchange(device, comm, timeout_s)

    def iteration(it: int, chunks: list[Chunk]) -> list[HeadOutput]:
        return _iteration(device, ex, it, chunks, pipeline)

    serve_iterations(device, ex, stop, iteration, publish, poll_s)


def _iteration(
    device: SyncDevice,
    ex: core.BarrierExchange,
    it: int,
    chunks: list[Chunk],
    pipeline: ExpertPipeline | None,
) -> list[HeadOutput]:
    """One batch through every block, a barrier all-to-all on each side of every expert layer, then the head.
    A batch whose layer fails ends there; the device still takes part in every all-to-all, without rows."""
    batch = attention_batch(chunks, device.attn_rank) if chunks else None
    carried = ()  # (residual, expert_out, expert_ids) of the previous block
    pn = pipeline.pipelines_for(device.iteration_rows) if pipeline is not None else 0  # one PN for all blocks
    for block in range(device.cfg.num_blocks):
        step = batch.at_block(block, *carried) if block and batch else batch
        device.stats.take_step()  # the attention step's busy seconds are counted from here
        residual, routed = _attend(device, step)
        if pipeline is not None:
            expert_out = pipelined_moe(device, ex, it, block, routed, pipeline, pn)
        else:
            expert_out = _moe(device, ex, it, block, routed, device.stats.take_step())
        if step is not None and (residual is None or expert_out is None):
            if expert_out is None:
                device.fail(step, f"an expert layer of block {block} failed on another device")
            batch = None
        carried = (residual, expert_out, routed.topk_ids)
    device.stats.take_step()  # the head's busy seconds are what the next BEGIN barrier compares
    outputs = [device.head(batch.at_block(device.cfg.num_blocks, *carried))] if batch is not None else []
    return outputs + device.take_failures()


def _attend(device: SyncDevice, step: LayerBatch | None) -> tuple[torch.Tensor | None, Routed]:
    out = device.attend(step) if step is not None else None
    if out is None:  # nothing here this iteration, or its layer failed: still a party to every all-to-all
        return None, Routed.empty(device.cfg.hidden_size, device.cfg.experts_per_token)
    residual, moe_input, ids, weights = out
    return residual, Routed(Device.host(moe_input), ids, weights, step.request_ids, step.positions)


def _moe(
    device: SyncDevice, ex: core.BarrierExchange, it: int, block: int, routed: Routed, attn_s: float
) -> torch.Tensor | None:
    """Dispatch to every device, barrier, run the hosted experts, combine back, barrier; None if an expert device
    failed on these rows. `attn_s`: the attention step's busy seconds, which each barrier's wait for a slower
    peer is counted against (and the expert step's at the combine)."""
    plan = send_dispatch(ex, it, block, 0, routed, attn_s, device.slots)
    stats = device.stats
    expert_s = serve_experts(
        ex, it, block, 0, device.attn_devices, device.experts, stats, own_s=attn_s, slots=device.slots
    )
    return receive_combine(ex, plan, stats, own_s=expert_s)
