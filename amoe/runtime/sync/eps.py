"""EPS-MoE's expert pipeline for `--parallel ep` (arXiv 2410.12247, Algorithm 1): a block's routed copies are split
into PN chunks by expert group — chunk p holds the copies bound for the p-th group of every device's hosted experts
— and go through the barrier exchange one after another, chunk p's dispatch in flight while chunk p − 1 computes
and chunk p − 2's outputs come back. Every device must use the same PN in an exchange (the chunk is the tag's
micro-batch slot), so `auto` decides it from the iteration's total rows, which the BEGIN barrier gives every device
alike. Each chunk's expert GEMM is grouped or dense (`--ep-kernel`), chosen per chunk by its tokens per expert.

An expert still sees the rows it sees without a pipeline, in the same order (copies in row order), so the floats
— and greedy tokens — are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from amoe import core
from amoe.errors import ConfigError
from amoe.runtime.sync.moe import Routed, receive_combine, send_dispatch, serve_experts


@dataclass(frozen=True)
class ExpertPipeline:
    """ep's PN and expert kernel: fixed, or chosen by `choose_pipelines(total rows)` / `choose_kernel(rows per
    expert)` (the cost model's, amoe.perf.model.eps). kernel None: EP's grouped step as it ran before pipelines."""

    pipelines: int | None = 1  # None: auto
    kernel: str | None = None  # None | grouped | dense | auto
    max_pipelines: int = 1  # the fewest experts a device hosts
    choose_pipelines: Callable[[int], int] | None = None
    choose_kernel: Callable[[Sequence[int]], str] | None = None

    def __post_init__(self) -> None:
        if self.pipelines is not None and not 1 <= self.pipelines <= self.max_pipelines:
            raise ConfigError(
                f"--ep-pipelines must be in [1, {self.max_pipelines}] (the experts a device hosts); "
                f"got {self.pipelines}"
            )
        if self.pipelines is None and self.choose_pipelines is None:
            raise ConfigError("--ep-pipelines auto needs the cost model's choice")
        if self.kernel == "auto" and self.choose_kernel is None:
            raise ConfigError("--ep-kernel auto needs the cost model's choice")

    def pipelines_for(self, total_rows: int) -> int:
        """PN for an iteration of `total_rows` rows over all devices (the same on every device)."""
        if self.pipelines is not None:
            return self.pipelines
        return max(1, min(self.max_pipelines, int(self.choose_pipelines(total_rows))))

    def kernel_for(self, rows_per_expert: Sequence[int]) -> str | None:
        if self.kernel == "auto":
            return self.choose_kernel(rows_per_expert)
        return self.kernel


def fewest_hosted(expert_device: Sequence[int], hosts: Sequence[int]) -> int:
    """The fewest experts any expert device hosts: the largest PN every device can split into."""
    return min(sum(1 for d in expert_device if d == h) for h in hosts)


@functools.lru_cache(maxsize=64)
def expert_groups(expert_device: tuple[int, ...], pipelines: int) -> torch.Tensor:
    """group[e]: the chunk of expert e — device d's hosted experts, in id order, cut into `pipelines` contiguous
    groups of near-equal size (EPS-MoE's horizontal split: weights by expert). int64 [num_expert_ids]."""
    group = torch.zeros(len(expert_device), dtype=torch.int64)
    for d in set(expert_device):
        hosted = [e for e, h in enumerate(expert_device) if h == d]
        for i, e in enumerate(hosted):
            group[e] = i * pipelines // len(hosted)
    return group


@dataclass
class _Part:
    """Chunk p of a routed batch: one copy per row, with where each copy goes back in [N, K]."""

    routed: Routed
    rows: torch.Tensor  # [n_p] row of each copy
    slots: torch.Tensor  # [n_p] its top-k slot


def split_routed(routed: Routed, group: torch.Tensor, pipelines: int) -> list[_Part]:
    """The PN chunks of `routed`: chunk p carries the copies whose expert is in group p, in (row, slot) order, each
    as a row of its own with top-k 1 (so an expert receives its rows in the order it does without a pipeline)."""
    of = group[routed.topk_ids]  # [N, K] chunk of each copy
    parts = []
    for p in range(pipelines):
        rows, slots = (of == p).nonzero(as_tuple=True)  # row-major: ascending row, then slot
        part = Routed(
            routed.moe_input[rows],
            routed.topk_ids[rows, slots].unsqueeze(1),
            routed.topk_weights[rows, slots].unsqueeze(1),
            routed.request_ids[rows],
            routed.positions[rows],
        )
        parts.append(_Part(part, rows, slots))
    return parts


def pipelined_moe(
    device, ex: core.BarrierExchange, it: int, block: int, routed: Routed, pipeline: ExpertPipeline, pn: int
) -> torch.Tensor | None:
    """Algorithm 1 on the barrier exchange: dispatch(0); then for p = 1..PN: dispatch(p), experts(p − 1),
    combine(p − 2); then the last combine(s). → expert_out [N, K, H]; None if an expert device failed on a chunk.
    With PN 1: dispatch, experts, combine, as EP runs without a pipeline — the same copies in the same order, so
    without the split and the gather (only the expert kernel may differ: `--ep-kernel`)."""
    kernel = None
    if pipeline.kernel is not None:
        num_routed = device.cfg.num_experts

        def kernel(batches) -> str:  # by the routed experts' load: a shared expert runs as a GEMM of its own
            return pipeline.kernel_for([b.num_rows for b in batches if b.index < num_routed])

    if pn == 1:
        plan = send_dispatch(ex, it, block, 0, routed)
        serve_experts(ex, it, block, 0, device.attn_devices, device.experts, device.stats, kernel)
        return receive_combine(ex, plan, device.stats)
    parts = split_routed(routed, expert_groups(device.expert_device, pn), pn)
    plans: list = [None] * pn
    outs: list = [None] * pn
    plans[0] = send_dispatch(ex, it, block, 0, parts[0].routed)
    for p in range(1, pn + 1):
        if p < pn:
            plans[p] = send_dispatch(ex, it, block, p, parts[p].routed)
        serve_experts(ex, it, block, p - 1, device.attn_devices, device.experts, device.stats, kernel)
        if p >= 2:
            outs[p - 2] = receive_combine(ex, plans[p - 2], device.stats)
    outs[pn - 1] = receive_combine(ex, plans[pn - 1], device.stats)  # the loop combined chunks 0..PN-2
    if any(o is None for o in outs):
        return None
    n, k = routed.topk_ids.shape
    expert_out = routed.moe_input.new_empty(n, k, routed.moe_input.shape[1])  # [N, K, H]
    for part, out in zip(parts, outs):
        expert_out[part.rows, part.slots] = out[:, 0]  # every (row, slot) is in exactly one chunk
    return expert_out
