"""EP's lock-step at scale (amoe.perf.plan.simulate.scale.ep): per iteration the head, then per block this
iteration's expert counts, each device's grouped GEMM over its expert copies and the barrier at the slowest
device, with or without two-batch overlap (amoe.perf.model.ep_scale.block_time) and multi-token prediction.
`variance`: each device's steps × its speed × a jitter per barrier (docs/emulation.md "Step-time variance at
scale"), the barrier at the slowest."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model import ep_scale as scale
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.variance import StepVariance
from amoe.perf.plan.bound_ep import ep_micro_batch
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate.result import Simulated


class BlockCounts(Protocol):
    """Rows per expert id of a block's tokens at a time (scale.Counts)."""

    def draw(self, block: int, tokens: int, now_s: float) -> np.ndarray: ...


class _Barriers:
    """One iteration's barriers: the head's and, per block and micro-batch, attention's and the experts'."""

    def __init__(
        self, mb: scale.MicroBatch, overlap: bool, variance: StepVariance, devices: int, blocks: int
    ):
        self.mb, self.overlap, self.variance, self.blocks = mb, overlap, variance, blocks
        self.halves, self.varied = (2 if overlap else 1), not variance.is_off
        self.attn = mb.stage_in + mb.stage_out
        if self.varied:
            self.speed = variance.speeds(0, devices)  # [devices]
            self.rng = variance.jitter_rng(devices)
            self.devices = devices

    def draw(self) -> np.ndarray | None:
        """One draw an iteration for every barrier's devices: the head, then per block and micro-batch the
        attention and the experts' barrier."""
        if not self.varied:
            return None
        return self.variance.draw(self.rng, (1 + 2 * self.blocks * self.halves) * self.devices).reshape(
            -1, self.devices
        )

    def head(self, head_s: float, jit: np.ndarray | None) -> float:
        return head_s if jit is None else float((head_s * self.speed * jit[0]).max())

    def block(self, per_device: np.ndarray, blk: int, jit: np.ndarray | None) -> tuple[float, float]:
        """(the block's time, its devices' mean expert time) for this iteration's [devices] grouped steps."""
        if jit is None:
            return scale.block_time(replace(self.mb, experts=float(per_device.max())), self.overlap), float(
                per_device.mean()
            )
        j = jit[1:].reshape(self.blocks, self.halves, 2, self.devices)[blk]
        a = (self.attn * self.speed * j[:, 0]).max(1)  # [halves] each micro-batch's slowest attention
        held = per_device * self.speed * j[:, 1]  # [halves, devices] each one's grouped GEMM
        slowest, mb = held.max(1), self.mb
        if self.overlap:  # each micro-batch's stages in the nominal proportion of its attention
            share = mb.stage_in / self.attn
            t = scale.overlapped_block(a * share, a * (1 - share), slowest, mb.dispatch, mb.combine)
        else:
            t = float(a[0] + slowest[0]) + mb.dispatch + mb.combine
        return t, float(held.mean(1).sum()) / self.halves


def simulate_ep(
    model: ModelProfile, dep: Deployment, ctx: float, host: HostOverhead, concurrency: int, duration_s: float,
    counts: BlockCounts, steps: list[Callable[[np.ndarray], np.ndarray]], variance: StepVariance,
) -> Simulated:  # fmt: skip
    """At least 8 iterations and `duration_s` emulated seconds of EP's lock-step; `steps[blk]`: the block's
    GroupedSteps, `counts`: scale.Counts."""
    gpu = gpu_profile(dep.attn_gpu)
    n, overlap, queries = dep.num_attn, dep.two_batch_overlap, 1 + dep.draft_tokens
    b = max(1, min(dep.attn_cap, -(-concurrency // n)))
    rows = b * queries / (2 if overlap else 1)  # one micro-batch's rows per device
    mb = ep_micro_batch(model, gpu, max(queries, round(rows)), int(round(ctx)), dep, host, queries)
    head = cm.head_time(model, gpu, b * queries, b * queries, host)
    barriers = _Barriers(mb, overlap, variance, n, model.num_blocks)
    mtp = 1 + dep.draft_tokens / model.layers  # the MTP module: one more layer a draft token
    elapsed, iterations, busy = 0.0, 0, 0.0
    while elapsed < duration_s or iterations < 8:
        jit = barriers.draw()
        layers = 0.0
        for blk in range(model.num_blocks):
            t, held = barriers.block(steps[blk](counts.draw(blk, int(round(n * rows)), elapsed)), blk, jit)
            layers, busy = layers + t, busy + held
        elapsed += barriers.head(head, jit) + layers * mtp
        iterations += 1
    tps = n * b * dep.tokens_per_request_step * iterations / elapsed
    return Simulated(
        tps, elapsed / iterations / dep.tokens_per_request_step, n * b, float(b),
        float(n * b * queries * model.experts_per_token / model.num_expert_ids), 1.0,
        min(1.0, busy * (2 if overlap else 1) / elapsed),
    )  # fmt: skip
