"""An EP block as the bounds, the simulation and the runtime price it, pipelined or not (EPS-MoE's expert pipeline,
amoe.perf.model.eps), and the choosers the runtime's `auto` asks for its pipeline number and kernel
(amoe.runtime.sync.eps.ExpertPipeline). Times in seconds; memoised pure functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from amoe.perf.model.eps import EpLayer, PipelineChunk, a2a_time, pipeline_time
from amoe.perf.model.gpus import GpuProfile
from amoe.perf.model.kernels import best_kernel, curves_for, experts_time, fitted
from amoe.perf.model.models import ModelProfile

if TYPE_CHECKING:
    from amoe.perf.model.hosts import HostOverhead

# ---- the runtime's `auto` (amoe.runtime.sync.eps.ExpertPipeline)

# The CPU one device of amoe's EP runtime spends on one more pipeline chunk of a block: the split of its copies,
# one message per peer each way, the expert step's bookkeeping, the gather — a fixed part and a part per token the
# device brings (the split scans every copy once per chunk). Measured with bench/eps_chunk_cost.py (8 devices in one
# process, CPU time; 2026-11-26 on this project's 2-core host): 146 µs per chunk at 1,024 tokens per device, 326 µs
# at 4,096. Unlike the GPU's holds it is real time, which the emulated runtime's clock divides by the time scale.
CHUNK_HOST_CPU_S = 86e-6
CHUNK_HOST_CPU_PER_TOKEN_S = 59e-9


def chunk_host_s(tokens_per_device: float, contention: float = 1.0, time_scale: float = 1.0) -> float:
    """Seconds (of the runtime's clock) one more chunk costs a device's host: CHUNK_HOST_CPU_S and its per-token part,
    times `contention` (how many devices' host work shares one core: devices over cores, at least 1), over the
    emulated clock's `time_scale` (1 for real GPUs)."""
    cpu = CHUNK_HOST_CPU_S + CHUNK_HOST_CPU_PER_TOKEN_S * tokens_per_device
    return cpu * max(1.0, contention) / time_scale


# Blocks of a routing's inclusion `auto` prices for every PN (evenly spaced, first and last included): the hot
# experts differ from block to block, and the choice must not cost what the bound of every fixed PN costs.
CHOOSER_BLOCKS = 8
# The PNs whose price on those blocks is within this fraction of the best are priced again on every distinct block
# and the choice made there: 8 of 48 skewed blocks misjudge a close call by a few % (Qwen3-30B-A3B on 8 h800s,
# skew-exp:0.4, cap 1,024: PN 1 picked, PN 2 best by 2.5 %), and a close call is cheap to settle (a few PNs).
CHOOSER_REFINE = 0.05


def pipeline_chooser(
    model: ModelProfile,
    gpu: GpuProfile,
    devices: int,
    max_pipelines: int,
    host=None,
    chunk_host=None,
    inclusion=None,
):
    """total rows of an iteration over all devices → the PN with which an EP block (ep_block_moe_time, the bounds'
    and the simulation's model, with the host's step per chunk) is fastest; memoised, an iteration's rows repeat.
    `inclusion` (q [blocks, expert ids], bounds.routing_inclusion): the routing's rows per expert, priced on
    CHOOSER_BLOCKS of its distinct blocks for every PN, then on all of them for the PNs within CHOOSER_REFINE of
    the best, experts placed e mod devices as EP places them — a skewed routing makes each chunk wait for its own
    slowest device, which uniform rows hide; None: uniform routing over the routed experts.
    `chunk_host(tokens per device)`: the runtime's own host seconds per chunk (`chunk_host_s`), paid in series
    with the block; None: none (the bounds' choice). PNs whose floor (their collectives' fixed costs, their host
    steps, their chunks' host cost) is above the close calls' margin are not priced: the same choice, in a few ms
    of CPU per new total instead of ~60 (every device's process asks it)."""
    from amoe.perf.model.cost_model import NO_HOST

    if inclusion is None:
        ids = model.num_experts
        q = np.full((1, ids), model.top_k / model.num_experts)
    else:
        q = np.asarray(inclusion, dtype=float)
        ids = q.shape[1]
    distinct, counts = np.unique(q, axis=0, return_counts=True)  # uniform routing: one block
    experts = tuple(tuple(e for e in range(ids) if e % devices == d) for d in range(devices))
    host = host or NO_HOST
    pricing = _PnPricing(
        model, gpu, host, devices, max_pipelines, chunk_host, experts,
        sampled=q[np.unique(np.linspace(0, len(q) - 1, min(len(q), CHOOSER_BLOCKS)).round().astype(int))],
        distinct=distinct, counts=counts, fewest=min((len(es) for es in experts if es), default=1),
        a2a_fixed_s=curves_for(gpu).a2a_fixed_s,
        # every expert gets rows: each chunk pays a host step on the compute stream
        step_s=host.expert_step_s if bool((q > 0).all()) else 0.0,
    )  # fmt: skip
    return functools.lru_cache(maxsize=4096)(pricing.choose)


@dataclass(frozen=True, eq=False)
class _PnPricing:
    """What pipeline_chooser prices an iteration's PN on: the model and GPU, the experts of each device, the blocks'
    routing (sampled, and every distinct block with how often it occurs), the host's step and chunk costs."""

    model: ModelProfile
    gpu: GpuProfile
    host: HostOverhead
    devices: int
    max_pipelines: int
    chunk_host: Callable[[float], float] | None
    experts: tuple[tuple[int, ...], ...]
    sampled: np.ndarray  # [sampled blocks, expert ids]
    distinct: np.ndarray  # [distinct blocks, expert ids]
    counts: np.ndarray  # [distinct blocks] how many blocks each stands for
    fewest: int
    a2a_fixed_s: float
    step_s: float

    def floor(self, n: int, per_chunk: float) -> float:
        """No block with n chunks is faster than its communication stream's 2 n collectives (each pays the fixed
        cost) or, when every expert gets rows, its compute stream's n host steps: PNs above it are not priced."""
        m = min(n, self.fewest)  # the block caps its chunks at the fewest hosted experts
        return max(2 * m * self.a2a_fixed_s, m * self.step_s) + n * per_chunk

    def choose(self, total_rows: int) -> int:
        total = max(1, total_rows)
        tokens = total / self.devices
        per_chunk = self.chunk_host(tokens) if self.chunk_host is not None else 0.0

        def block_rows(shares: np.ndarray) -> list[tuple]:
            return [tuple(tuple(float(total * s[e]) for e in es) for es in self.experts) for s in shares]

        def mean_block(n: int, rows: list[tuple], weights) -> float:
            t = sum(
                w
                * _ep_block_moe_time(
                    self.model, self.gpu, self.host, r, self.experts, float(tokens), n, "auto"
                )
                for r, w in zip(rows, weights)
            )
            return t / sum(weights) + n * per_chunk

        rows = block_rows(self.sampled)
        times: dict[int, float] = {}
        for n in range(1, self.max_pipelines + 1):
            # floor(n) grows with n: once it is above the close calls' margin, no larger PN is picked or refined
            if times and self.floor(n, per_chunk) > min(times.values()) * (1 + CHOOSER_REFINE):
                break
            times[n] = mean_block(n, rows, [1] * len(self.sampled))
        best = min(times.values())
        close = [n for n in times if times[n] <= best * (1 + CHOOSER_REFINE)]
        if len(close) > 1 and len(self.distinct) > len(
            self.sampled
        ):  # a close call: settle it on every block
            every = block_rows(self.distinct)
            times = {n: mean_block(n, every, self.counts) for n in close}
        return min(times, key=lambda n: (times[n], n))


def kernel_chooser(model: ModelProfile, gpu: GpuProfile):
    """rows per expert of a chunk → grouped or dense, whichever the curves price lower."""
    curves = curves_for(gpu)

    def choose(rows: Sequence[int]) -> str:
        return best_kernel(gpu, curves, rows, model.hidden_size, model.expert_intermediate)

    return choose


# ---- an EP block of the bounds and the simulation (bounds._ep, simulate._simulate_ep)


def ep_block_moe_time(
    model: ModelProfile,
    gpu: GpuProfile,
    host,
    rows: Sequence[Sequence[float]],
    experts: Sequence[Sequence[int]],
    tokens_per_device: float,
    pipelines: int,
    kernel: str,
) -> float:
    """Dispatch, experts and combine of one EP block, pipelined: device d's local experts experts[d] have rows[d]
    tokens each; each of the PN chunks (the p-th group of every device's experts, as amoe.runtime.sync.eps splits
    them) waits at its combine for the slowest device's compute, and pays one host step per device. kernel
    "auto": per chunk and device, by load; "": the grouped step. The fitted per-layer b of Table II (the fixed
    overhead of the paper's collectives) is left out: the all-to-all's fixed cost per collective prices amoe's.
    Memoised: the bounds ask for the same block at every layer under uniform routing and for every PN searched."""
    return _ep_block_moe_time(
        model, gpu, host, tuple(tuple(float(r) for r in rs) for rs in rows), tuple(tuple(es) for es in experts),
        float(tokens_per_device), int(pipelines), kernel,
    )  # fmt: skip


@functools.lru_cache(maxsize=1 << 16)
def _ep_block_moe_time(model, gpu, host, rows, experts, tokens_per_device, pipelines, kernel) -> float:
    curves = curves_for(gpu)
    devices = len(experts)
    pn = max(1, min(pipelines, min((len(es) for es in experts if es), default=1)))
    layer = EpLayer(
        model.hidden_size, model.expert_intermediate, devices, 1, model.experts_per_token, tokens_per_device, 0.0,
        model.bytes_per_activation,
    )  # fmt: skip
    chunks = []
    seen: dict[tuple, float] = {}  # this block's distinct chunks (hashing the profiles per lookup costs more)
    for p in range(pn):
        slowest, sent = 0.0, 0.0
        for es, rs in zip(experts, rows):
            if not es:  # a device without experts (more devices than experts): attention only
                continue
            group = _chunk_members(len(es), pn)[p]
            work = tuple((es[i] >= model.num_experts, model.intermediate_of(es[i]), rs[i]) for i in group)
            if work not in seen:
                seen[work] = _chunk_compute(model, gpu, host, work, kernel)
            slowest = max(slowest, seen[work])
            sent += len(group) / len(es) / devices
        a2a = a2a_time(curves, layer, sent)
        chunks.append(PipelineChunk(a2a, slowest, a2a))
    return pipeline_time(chunks, overlap=pn > 1, interference=curves.interference)


@functools.lru_cache(maxsize=1024)
def _chunk_members(hosted: int, pipelines: int) -> tuple[tuple[int, ...], ...]:
    """The positions among a device's `hosted` experts that each of the PN chunks holds (as
    amoe.runtime.sync.eps.expert_groups cuts them)."""
    return tuple(tuple(i for i in range(hosted) if i * pipelines // hosted == p) for p in range(pipelines))


# Memoised apart from the block: the devices of a uniform routing, and the chunks of equal size, carry the same
# experts' rows, so a block prices a handful of distinct chunks (the runtime's `auto` prices every PN of every new
# row total an iteration brings: 60 ms of CPU each without this, 8 devices' processes on 2 cores).
@functools.lru_cache(maxsize=1 << 16)
def _chunk_compute(model, gpu, host, work: tuple[tuple[bool, int, float], ...], kernel: str) -> float:
    """One device's compute for one chunk: `work` (shared?, SwiGLU width, rows) of each expert in it, its kernel
    ("auto": by load, per width; "": the grouped step, shared experts in it) and one host step. With a kernel a
    shared expert is a GEMM of its own (dense), as the runtime runs it (EmulatedExpertExecutor.run_experts)."""
    curves = curves_for(gpu)
    gpu = fitted(gpu, curves)
    t = 0.0
    by_gemm: dict[tuple[bool, int], list[float]] = {}
    for shared, inter, r in work:
        by_gemm.setdefault((shared and bool(kernel), inter), []).append(r)
    for (alone, inter), r in by_gemm.items():
        k = "dense" if alone else kernel or "grouped"
        if k == "auto":
            k = best_kernel(gpu, curves, r, model.hidden_size, inter)
        t += experts_time(gpu, curves.curve(k), k, r, model.hidden_size, inter)
    busy = sum(r for _, _, r in work)
    if busy:
        t += host.expert_step_s + busy * host.expert_row_s
    return t


def ep_pipelines_for(
    fixed: int, model: ModelProfile, gpu: GpuProfile, devices: int, tokens: int, host=None, inclusion=None
) -> int:
    """A deployment's PN: its own `fixed` one, or (0, auto) what the runtime's `auto` picks for `tokens` rows in all
    under the routing's `inclusion` (None: uniform)."""
    if fixed:
        return fixed
    most = model.num_expert_ids // devices
    return pipeline_chooser(model, gpu, devices, max(1, most), host, inclusion=inclusion)(int(tokens))
