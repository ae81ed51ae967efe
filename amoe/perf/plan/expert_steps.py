"""The expert side's steps as the bounds cost them: each expert GPU's grouped step over its experts' share of a
block's rows, for every (block, GPU) at once (cost_model.grouped_expert_time's formula, vectorised and cached: the
planner asks it for every candidate and wave count), and the rows each expert GPU receives per token."""

from __future__ import annotations

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import GpuProfile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile


def expert_shares(placed: list[list[int]], q: np.ndarray) -> np.ndarray:
    """[blocks, expert GPUs]: the rows each expert GPU receives per token of a block (Σ of its experts' inclusion
    probabilities; the GPU hosting the shared expert gets every token)."""
    where = np.zeros((q.shape[1], len(placed)))
    for g, experts in enumerate(placed):
        where[experts, g] = 1.0
    return q @ where


# grouped_steps' answers, keyed by everything they depend on: the planner asks the same (placement, rows) for every
# attention cap and split that shares it (a 256-GPU DeepSeek-V3 pool has 8,000 AEP candidates).
_STEPS_CACHE: dict = {}


_STEPS_CACHE_MAX = 8192


def steps_key(
    model: ModelProfile, gpu: GpuProfile, placed: list[list[int]], q: np.ndarray, cap: int, host: HostOverhead
) -> int:
    """`grouped_steps`' cache key but its rows: hashing the model, host and placement was half of AEP's bound's
    time at 256 GPUs, so a caller asking for many row counts computes it once (64 bits, as q's hash already was)."""
    return hash((model, gpu.name, tuple(map(tuple, placed)), q.shape, hash(q.tobytes()), cap, host))


def grouped_steps(
    model: ModelProfile, gpu: GpuProfile, placed: list[list[int]], q: np.ndarray, rows_in: float, cap: int,
    host: HostOverhead, key: int | None = None,
) -> np.ndarray:  # fmt: skip
    """[blocks, expert GPUs]: each expert GPU's grouped step(s) over its experts' share of `rows_in` rows of a
    block (an expert over the cap takes several steps): cost_model.grouped_expert_time for every (block, GPU) at
    once (the planner asks this for every candidate and wave count). `key`: `steps_key` of the other arguments."""
    key = (steps_key(model, gpu, placed, q, cap, host) if key is None else key, rows_in)
    if key not in _STEPS_CACHE:
        if len(_STEPS_CACHE) >= _STEPS_CACHE_MAX:
            _STEPS_CACHE.clear()
        _STEPS_CACHE[key] = _grouped_steps_uncached(model, gpu, placed, q, rows_in, cap, host)
    return _STEPS_CACHE[key]


def _grouped_steps_uncached(
    model: ModelProfile, gpu: GpuProfile, placed: list[list[int]], q: np.ndarray, rows_in: float, cap: int,
    host: HostOverhead,
) -> np.ndarray:  # fmt: skip
    num_ids = q.shape[1]
    where = np.zeros((num_ids, len(placed)))
    for g, experts in enumerate(placed):
        where[experts, g] = 1.0
    gpu_of = where.argmax(axis=1)
    inter = np.array([model.intermediate_of(e) for e in range(num_ids)], dtype=float)
    rows = rows_in * q  # [blocks, ids]
    # Each GPU's most loaded expert per block, by a segmented max over the experts sorted by GPU (a [blocks, ids,
    # GPUs] product was most of the planner's time at 256 GPUs); GPUs without experts take 0.
    order = np.argsort(gpu_of, kind="stable")
    firsts = np.searchsorted(gpu_of[order], np.arange(len(placed)))
    hosting = np.bincount(gpu_of, minlength=len(placed)) > 0
    most = np.zeros((rows.shape[0], len(placed)))
    if hosting.any():
        most[:, hosting] = np.maximum.reduceat(rows[:, order], firsts[hosting], axis=1)
    steps = np.maximum(1.0, np.ceil(most / cap))  # [blocks, GPUs]
    per_step = rows / steps[:, gpu_of]
    busy = per_step > 0
    r = np.where(busy, np.maximum(1.0, np.round(per_step)), 0.0)  # whole rows, as grouped_expert_time rounds
    h, bp, ba = model.hidden_size, model.bytes_per_param, model.bytes_per_activation
    weights = np.where(busy, h * inter * bp, 0.0)  # read once per step by each expert with rows
    gate_up_f, gate_up_b = (4 * r * h * inter) @ where, (2 * weights + r * (h + 2 * inter) * ba) @ where
    act_b = (r * 3 * inter * ba) @ where
    down_f, down_b = (2 * r * inter * h) @ where, (weights + r * (inter + h) * ba) @ where
    count = busy.astype(float) @ where
    any_busy = count > 0
    phases = ((gate_up_f, gate_up_b), (0.0, act_b), (down_f, down_b))
    mean_rows = (r @ where) / np.maximum(count, 1.0)
    slow = gpu.kernels.decode_grouped_slowdown
    gpu_s = cm.swiglu_gemms_time(gpu, model.expert_precision, phases, mean_rows, any_busy, slow)
    fixed = np.where(any_busy, cm.EXPERT_KERNELS * gpu.launch_s + host.expert_step_s, 0.0)
    return steps * (gpu_s + fixed + (per_step @ where) * host.expert_row_s)


# Expert ids a block past which a bound's steps are costed all at once (`block_steps`): the frontier profiles
# (DeepSeek-V3's 257, Qwen3's 128), where one grouped_expert_time per (block, GPU) was most of `amoe plan`'s time
# on 256 GPUs (2.7 M calls for ping-pong's splits alone).
VECTORISED_MIN_EXPERTS = 65


def block_steps(
    model: ModelProfile, gpu: GpuProfile, placed: list[list[int]], q: np.ndarray, rows_in: float,
    host: HostOverhead, vectorised: bool = False,
) -> np.ndarray:  # fmt: skip
    """[blocks, GPUs]: each GPU's grouped step over its experts' share of `rows_in` rows of each block, with no cap.
    Vectorised (`grouped_steps`, cached) for frontier profiles or when asked: grouped_expert_time's formula in
    another summation order, within 2 ulp of it (4.4e-16 relative, measured on DeepSeek-V3 and Mixtral tables);
    else one grouped_expert_time per (block, GPU), the same numbers to the last bit as before."""
    if vectorised or q.shape[1] >= VECTORISED_MIN_EXPERTS:
        return grouped_steps(model, gpu, placed, q, rows_in, 1 << 30, host)
    return np.array([
        [cm.grouped_expert_time(model, gpu, [rows_in * q[blk, e] for e in es], host, es) for es in placed]
        for blk in range(model.num_blocks)
    ])  # fmt: skip
