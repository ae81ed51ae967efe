"""Each attention rank's own step times in a barrier mode at scale (amoe.perf.plan.simulate.lockstep_scale): from
its own requests of a trace (amoe.perf.plan.simulate.trace_loads), or without one every rank the same batch at the
mean context (the figures the simulation gave before traces); and the barrier's bookkeeping of who waited."""

from __future__ import annotations

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import GpuProfile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.traces import RequestTrace
from amoe.perf.plan.simulate.trace_loads import BLOCK_SIZE, TraceLoads


def head_times(model: ModelProfile, gpu: GpuProfile, rows: np.ndarray, host: HostOverhead) -> np.ndarray:
    """cost_model.head_time of each element's rows (one chunk a row: decode), element-wise; 0 without rows."""
    values, where = np.unique(rows, return_inverse=True)
    t = np.array([cm.head_time(model, gpu, float(x), float(x), host) if x > 0 else 0.0 for x in values])
    return t[where].reshape(np.shape(rows))


def kv_blocks(model: ModelProfile, gpu: GpuProfile, weight_bytes: float) -> int:
    """KV blocks (amoe.config's block size) an attention GPU holds beside `weight_bytes` of weights."""
    return cm.kv_capacity_tokens(gpu, model, weight_bytes) // BLOCK_SIZE


class RankSteps:
    """Every attention rank's attention step of each of its `groups` (micro-batches) in an iteration, [groups,
    ranks]: from its own requests of `trace` (`balanced`: every rank the mean of the ranks' loads, the same
    requests otherwise), or without a trace every rank `group_rows` rows at the mean context `ctx`."""

    def __init__(
        self, model: ModelProfile, gpu: GpuProfile, host: HostOverhead, ranks: int, groups: int,
        group_rows: float, ctx: float, trace: RequestTrace | None = None, seed: int = 0, balanced: bool = False,
        blocks: int = 0,
    ) -> None:  # fmt: skip
        self.model, self.gpu, self.host, self.groups, self.balanced = model, gpu, host, groups, balanced
        self.loads = None
        if trace is not None:
            self.loads = TraceLoads(trace, ranks, round(groups * group_rows), seed, blocks)
            return
        self.rows = np.full((groups, ranks), float(group_rows))
        t = cm.decode_attention_time(model, gpu, max(1, round(group_rows)), int(round(ctx)), host)
        self.attn = np.full((groups, ranks), t)

    @property
    def traced(self) -> bool:
        return self.loads is not None

    def step(self) -> tuple[np.ndarray, np.ndarray]:
        """[groups, ranks] rows and attention seconds of this iteration's steps."""
        if self.loads is None:
            return self.rows, self.attn
        rows, ctx = (a.T for a in self.loads.loads(self.groups))
        if self.balanced:
            rows, ctx = (np.broadcast_to(a.mean(1, keepdims=True), a.shape) for a in (rows, ctx))
        return rows, cm.attention_load_time(self.model, self.gpu, rows, ctx, ctx, self.host)

    def decode(self) -> None:
        """Every request decoded one token (those that end replaced): the next iteration's loads."""
        if self.loads is not None:
            self.loads.decode()


def waits(steps: np.ndarray) -> tuple[np.ndarray, float]:
    """A barrier after `steps` [..., ranks]: each barrier's length (its slowest step) and the seconds the others
    wait for it, summed over the ranks and barriers."""
    slowest = steps.max(-1)
    return slowest, float((slowest[..., None] - steps).sum())
