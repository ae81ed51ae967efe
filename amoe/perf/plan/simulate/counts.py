"""What the simulations at scale draw and price in counts (amoe.perf.plan.simulate.scale): rows per expert drawn
from the routing's inclusion probabilities (`Counts`), every expert GPU's grouped step over such rows at once
(`GroupedSteps`), EPLB's copies as shares (`share_matrix`), and the transfers between the pools on both ends'
links (`Nics`)."""

from __future__ import annotations

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model.ep_scale import sample_counts
from amoe.perf.model.gpus import GpuProfile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.routing import RouterOverride, RoutingSpec
from amoe.perf.plan.bound_pools import pool_links
from amoe.perf.plan.deployment import Deployment

# Inclusion probabilities by (router, shared experts, epoch): sampled for DeepSeek-V3 (Gumbel keys, ~5 s), they are
# the same for every simulation of one routing and seed, and a plan runs dozens (measured: most of a 256-GPU
# AEP simulation's CPU time was this, once per simulation). A few entries: one routing a plan, epochs move on.
_INCLUSION: dict[tuple, np.ndarray] = {}


def _inclusion(router: RouterOverride, num_shared: int, epoch: int) -> np.ndarray:
    key = (
        repr(router.spec),
        router.num_experts,
        router.top_k,
        router.num_blocks,
        router.seed,
        num_shared,
        epoch,
    )
    if key not in _INCLUSION:
        q = router.inclusion_at(epoch)
        q = np.concatenate([q, np.ones((q.shape[0], num_shared))], axis=1)
        q.flags.writeable = False
        if len(_INCLUSION) >= 8:
            _INCLUSION.pop(next(iter(_INCLUSION)))
        _INCLUSION[key] = q
    return _INCLUSION[key]


class Counts:
    """Rows per expert id of n tokens of a block, drawn from the routing's inclusion probabilities (by skew epoch
    when the skew shifts); the shared expert, if any, gets every token."""

    def __init__(self, model: ModelProfile, routing: str, seed: int) -> None:
        spec = RoutingSpec.parse(routing)
        if not spec.is_override:
            spec = RoutingSpec("uniform")
        self.model, self.rng = model, np.random.default_rng([seed, 35])
        self.router = RouterOverride(spec, model.num_experts, model.top_k, model.num_blocks, seed)
        self._q: dict[int, np.ndarray] = {}

    def inclusion(self, now_s: float) -> np.ndarray:
        """[blocks, expert ids] inclusion probabilities in the skew epoch at `now_s`."""
        epoch = self.router.epoch(now_s)
        if epoch not in self._q:
            self._q = {
                epoch: _inclusion(self.router, self.model.num_shared_experts, epoch)
            }  # time only moves on
        return self._q[epoch]

    def draw(self, block: int, tokens: int, now_s: float) -> np.ndarray:
        return sample_counts(self.rng, tokens, self.inclusion(now_s)[block])

    def draw_many(self, blocks: np.ndarray, tokens: int, now_s: float) -> np.ndarray:
        """[len(blocks), expert ids]: one draw of `tokens` tokens for each of `blocks` (AEP at scale: each
        attention GPU's wave its own)."""
        return sample_counts(self.rng, tokens, self.inclusion(now_s)[blocks])


class GroupedSteps:
    """Every expert GPU's grouped step (cost_model.grouped_expert_time) for one vector of rows per expert id, at
    once: [expert ids] -> [expert GPUs] seconds. `placed`: each GPU's experts, or a [expert ids, GPUs] matrix of
    the share of an expert's rows each copy serves (EPLB's redundant copies; each copy reads its own weights)."""

    def __init__(
        self, model: ModelProfile, gpu: GpuProfile, placed: list[list[int]] | np.ndarray, host: HostOverhead
    ) -> None:
        num_ids = model.num_expert_ids
        if isinstance(placed, np.ndarray):
            self.where = placed
        else:
            self.where = np.zeros((num_ids, len(placed)))
            for g, experts in enumerate(placed):
                self.where[experts, g] = 1.0
        self.inter = np.array([model.intermediate_of(e) for e in range(num_ids)], dtype=float)[:, None]
        self.model, self.gpu, self.host = model, gpu, host

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        copy = rows[:, None] * self.where  # [ids, GPUs] rows each copy serves
        return self.over(copy, self.inter)

    def over(self, copy: np.ndarray, inter: np.ndarray) -> np.ndarray:
        """[G] each GPU's grouped step over `copy` [copies, G], the rows each copy it hosts serves (`inter`: the
        copies' intermediate sizes, [copies, 1] or [copies, G])."""
        m, gpu = self.model, self.gpu
        h, bp, ba = m.hidden_size, m.bytes_per_param, m.bytes_per_activation
        busy = copy > 0
        r = np.where(busy, np.maximum(1.0, np.round(copy)), 0.0)
        weights = np.where(busy, h * inter * bp, 0.0)
        gate_up_f, gate_up_b = (4 * r * h * inter).sum(0), (2 * weights + r * (h + 2 * inter) * ba).sum(0)
        act_b = (r * 3 * inter * ba).sum(0)
        down_f, down_b = (2 * r * inter * h).sum(0), (weights + r * (inter + h) * ba).sum(0)
        count = busy.sum(0)
        phases = ((gate_up_f, gate_up_b), (0.0, act_b), (down_f, down_b))
        mean_rows = r.sum(0) / np.maximum(count, 1)
        slow = gpu.kernels.decode_grouped_slowdown
        gpu_s = cm.swiglu_gemms_time(gpu, m.expert_precision, phases, mean_rows, count > 0, slow)
        fixed = np.where(busy.any(0), cm.EXPERT_KERNELS * gpu.launch_s + self.host.expert_step_s, 0.0)
        return gpu_s + fixed + copy.sum(0) * self.host.expert_row_s


def share_matrix(num_ids: int, placement: list[list[tuple[int, float]]]) -> np.ndarray:
    """[expert ids, devices]: the share of each expert's rows each device's copy serves."""
    out = np.zeros((num_ids, len(placement)))
    for d, copies in enumerate(placement):
        for e, share in copies:
            out[e, d] += share
    return out


class Nics:
    """Transfers between the pools on both ends' links (the incast), each link direction carrying one
    message set at a time (full duplex: in and out apart): the alike attention GPUs' one NIC (their timeline) and
    each expert GPU's. A dispatch of `rows` rows per attention GPU (their row copies, rows · top-k) leaves the
    attention GPU's link out and enters each expert GPU's link in with the rows it gets from all A attention GPUs;
    it arrives when both ends are through, plus the latency. The combine leaves each expert GPU's link out once
    that GPU is done and enters the attention GPU's link in once the last one is (every part must be back before
    the block goes on), as the transfer back was priced before. While no link is busy when a message set comes, this is latency + the slower end's bytes, which is
    the sender's whenever each expert GPU receives no more than one attention GPU sends (A ≤ E and no hot GPU):
    those plans keep the times they had."""

    def __init__(self, model: ModelProfile, dep: Deployment, rows: int, num_expert: int) -> None:
        self.links = pool_links(model, dep)
        self.copies = rows * model.experts_per_token
        self.a_out = self.a_in = 0.0
        self.e_in, self.e_out = np.zeros(num_expert), np.zeros(num_expert)

    def dispatch(self, t: float, into: np.ndarray) -> np.ndarray:
        """[expert GPUs] when a dispatch that leaves at `t` is in each expert GPU (`into`: its rows)."""
        lk = self.links
        self.a_out = max(t, self.a_out) + self.copies * lk.attn_out
        got = into > 0
        self.e_in = np.where(got, np.maximum(t, self.e_in) + into * lk.expert_in, self.e_in)
        return np.maximum(self.a_out, np.where(got, self.e_in, 0.0)) + lk.latency

    def combine(self, done: np.ndarray, into: np.ndarray, last: float) -> float:
        """When every part of a block is back at the attention GPU: each expert GPU `done` with its `into` rows
        at that time, the last of them at `last`."""
        lk = self.links
        got = into > 0
        self.e_out = np.where(got, np.maximum(done, self.e_out) + into * lk.expert_out, self.e_out)
        self.a_in = max(last, self.a_in) + self.copies * lk.attn_in
        return max(self.a_in, float(self.e_out[got].max()) if got.any() else 0.0) + lk.latency
