"""A discrete-event simulation of a deployment on emulated GPUs: what `amoe plan` predicts with where the analytic
bounds (amoe.perf.plan.bounds) are not enough (docs/simulation.md "Simulation").

The bounds put every GPU at its best batch at once. AEP's runtimes do not get there: each drains whichever μ-queue
its scheduler picks as soon as it is free, so at a given concurrency its batches are smaller than the bound's (on
the ci plan, 31 rows per attention step of a cap of 64 and 30 rows per expert step where the bound assumed 64), and
EP's barrier waits for the slowest device of *this* iteration's routing, not of the expected one. The simulation
runs the same pieces the emulated runtimes run — the C++ scheduler (`amoe._core.Scheduler`, the same policy,
look-ahead and decay), the routing override (same seed, skew, affinity), the cost model's step times with the host
overhead, the links' latency and bytes — over a fixed number of requests decoding forever (decode only, as the
benchmarks measure), each starting at a random layer, and counts their progress in steady state.

* **AEP**: attention rank r holds its requests; its grid is (block 0..B-1, head). A step takes up to the attention
  cap from the picked queue, holds for the cost model's attention (or head) time, then routes each row: row-part
  (token, k) goes to the expert GPU of its expert after the link's time. Expert GPU g's grid is (block, its
  experts); a step takes up to the expert cap from every hosted expert's queue of the picked block (one grouped
  step, cost_model.grouped_expert_time, as the runtime's engine drains it; `scheduler.group_experts = False`:
  the picked queue alone) and sends each part back. A token enters its
  rank's next queue when the last of its k parts is back. A message takes its time on the sender's link, and each
  GPU's link in takes one message at a time, so messages into one GPU queue (many attention GPUs into
  few expert GPUs: the incast).
* **EP**: per iteration and block, every device attends its b rows, the all-to-alls take links.all_to_all_time,
  and the block ends when the slowest device's grouped GEMM over its experts' rows of this iteration's routing ends.
* **Ping-pong**: the lock-step of amoe/runtime/sync/pingpong.py step by step: a BEGIN barrier per iteration, then
  every attention GPU attends its m micro-batches of block 0 in turn and sends each on; an expert GPU runs
  (block, micro-batch) in that order, each once the micro-batch of every attention GPU has arrived, over this
  iteration's routing; an attention GPU takes micro-batch i of the next block (or its head) once every expert GPU's
  reply is back; both ends' links as the simulation at scale prices them (scale.Nics). The bubbles the analytic Eq. 5 shape leaves out (the pipeline's fill and drain each iteration, a
  hot expert GPU holding the next micro-batch, m heads) are in.

Step-time variance (amoe.perf.model.variance, sourced by default): every step of GPU i (attention GPUs first, then
expert GPUs; EP: device i) takes the cost model's time × its fixed speed × a jitter drawn per step, as the emulated
executor holds it; the barriers of EP and ping-pong wait for the slowest device's step.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from amoe.perf.model import cost_model as cm
from amoe.perf.model import ep_block
from amoe.perf.model.gpus import GpuProfile, gpu_profile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.routing import RouterOverride, RoutingSpec, routing_inclusion
from amoe.perf.model.variance import StepVariance
from amoe.perf.plan.bound_ep import ep_exchange_time
from amoe.perf.plan.bound_pools import pool_link
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate.result import Simulated
from amoe.perf.plan.simulate.scale import Nics


class Steps:
    """Step-time variance of the simulated GPUs: `time(device, t)` is a step's time on GPU `device` (its runtime
    id), `times(devices, t)` one step on each of several at once (a barrier's max is then theirs)."""

    def __init__(self, variance: StepVariance, num_devices: int) -> None:
        self.variance = variance
        self.speed = variance.speeds(0, num_devices)  # [devices]
        # One jitter stream for the whole simulation (each runtime has its own): the draws are alike in law.
        self.rng = variance.jitter_rng(num_devices)

    def time(self, device: int, t: float) -> float:
        if self.variance.is_off:
            return t
        return t * self.speed[device] * float(self.variance.draw(self.rng))

    def times(self, first: int, t: ArrayLike) -> np.ndarray:
        t = np.asarray(t, dtype=float)
        if self.variance.is_off:
            return t
        count = t.shape[-1]
        return t * self.speed[first : first + count] * self.variance.draw(self.rng, t.shape)


def router_of(model: ModelProfile, routing: str, seed: int) -> RouterOverride:
    spec = RoutingSpec.parse(routing)
    return RouterOverride(
        spec, model.num_experts, model.top_k, model.num_blocks, seed=seed, num_shared=model.num_shared_experts
    )


def simulate_ep(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int, duration_s: float,
    seed: int, steps: Steps,
) -> Simulated:  # fmt: skip
    """EP iterations with this iteration's routing: the barrier waits for the slowest device's grouped GEMM."""
    gpu: GpuProfile = gpu_profile(dep.attn_gpu)
    n = dep.num_attn
    b = max(1, min(dep.attn_cap, -(-concurrency // n)))
    tokens = n * b
    router = router_of(model, routing, seed)
    local = dep.experts_on(model.num_expert_ids)
    where = np.empty(model.num_expert_ids, dtype=np.int64)
    for d, experts in enumerate(local):
        where[experts] = d
    c = int(round(ctx))
    attn = cm.decode_attention_time(model, gpu, b, c, host)
    a2a = ep_exchange_time(model, gpu, b, dep)
    head = cm.head_time(model, gpu, b, b, host)
    rid = np.arange(tokens)
    q = routing_inclusion(model, routing, seed) if dep.pipelined and not dep.ep_pipelines else None
    pn = ep_block.ep_pipelines_for(dep.ep_pipelines, model, gpu, n, tokens, host, q) if dep.pipelined else 1
    elapsed, iterations, position = 0.0, 0, 0
    while elapsed < duration_s or iterations < 8:
        iteration = float(steps.times(0, np.full(n, head)).max())
        for blk in range(model.num_blocks):
            ids, _ = router.route(
                blk, tokens, request_ids=rid, positions=np.full(tokens, position), now_s=elapsed
            )
            counts = np.bincount(ids.reshape(-1), minlength=model.num_expert_ids)
            # Two barriers a block (dispatch, combine): each waits for this step's slowest device.
            attn_wait = float(steps.times(0, np.full(n, attn)).max())
            if dep.pipelined:  # EPS-MoE's chunks (amoe.perf.model.eps), the runtime's PN and kernel choice
                rows = [counts[es].tolist() for es in local]
                iteration += attn_wait + ep_block.ep_block_moe_time(
                    model, gpu, host, rows, local, b, pn, dep.ep_kernel
                )
                continue
            per_device = [cm.grouped_expert_time(model, gpu, counts[es].tolist(), host, es) for es in local]
            iteration += attn_wait + a2a + float(steps.times(0, per_device).max())
        elapsed += iteration
        iterations += 1
        position += 1
    tps = tokens * iterations / elapsed
    return Simulated(
        tps,
        tokens / tps,
        tokens,
        float(b),
        float(tokens * model.experts_per_token / model.num_expert_ids),
        1.0,
        1.0,
    )


def _expert_steps(
    model: ModelProfile, ge: GpuProfile, host: HostOverhead, steps: Steps, placed: list[list[int]],
    counts: np.ndarray, arrive: np.ndarray, e_free: np.ndarray, exp_busy: float, A: int,
) -> float:  # fmt: skip
    """Each expert GPU's grouped step over its experts' rows of `counts` once they have `arrive`d: `e_free` [GPUs]
    moves to each step's end; returns `exp_busy` with their seconds added. Expert GPU g is device A + g."""
    for g, es in enumerate(placed):
        step = steps.time(A + g, cm.grouped_expert_time(model, ge, counts[es].tolist(), host, es))
        e_free[g] = max(e_free[g], arrive[g]) + step
        exp_busy += step
    return exp_busy


def simulate_pingpong(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int, duration_s: float,
    seed: int, steps: Steps,
) -> Simulated:  # fmt: skip
    """Ping-pong iterations in lock-step (module docstring): the attention GPUs are alike (same batch), so one
    timeline stands for them, each step as long as this step's slowest of them (the experts wait for every attention
    GPU's micro-batch); each expert GPU has its own."""
    ga, ge = gpu_profile(dep.attn_gpu), gpu_profile(dep.expert_gpu)
    A, m, L = dep.num_attn, max(1, dep.micro_batches), model.num_blocks
    micro = max(1, min(dep.attn_cap, -(-concurrency // A)) // m)
    rows = A * micro  # one micro-batch of every attention GPU: what an expert GPU's step gathers
    placed = dep.experts_on(model.num_expert_ids)
    # Both ends' links, one message set at a time each way (the dispatch leaves each attention GPU and enters each
    # expert GPU with every attention GPU's rows for it: the incast).
    nics = Nics(model, dep, micro, len(placed))
    begin = cm.transfer_time(64, pool_link(ga, dep))  # the BEGIN barrier: a row count and a stop flag
    attn = cm.decode_attention_time(model, ga, micro, int(round(ctx)), host)
    head = cm.head_time(model, ga, micro, host=host)
    router = router_of(model, routing, seed)
    rid = np.arange(rows * m).reshape(m, rows)
    now, iterations, position = 0.0, 0, 0
    exp_busy, attn_busy = 0.0, 0.0

    def attn_step(t: float) -> float:  # the slowest attention GPU's this step
        return float(steps.times(0, np.full(A, t)).max())

    while now < duration_s or iterations < 8:
        a_free = now + begin
        e_free = np.full(len(placed), a_free)
        sent = []  # when micro-batch i's attention step ends (its dispatch leaves)
        for _ in range(m):
            a_free += attn_step(attn)
            sent.append(a_free)
        for blk in range(L):
            back = []
            for i in range(m):
                ids, _ = router.route(
                    blk, rows, request_ids=rid[i], positions=np.full(rows, position), now_s=now
                )
                counts = np.bincount(ids.reshape(-1), minlength=model.num_expert_ids)
                into = np.array([float(counts[es].sum()) for es in placed])
                arrive = nics.dispatch(sent[i], into)
                exp_busy = _expert_steps(model, ge, host, steps, placed, counts, arrive, e_free, exp_busy, A)
                back.append(nics.combine(e_free, into, float(e_free.max())))
            step = attn if blk < L - 1 else head
            for i in range(m):
                a_free = max(a_free, back[i]) + attn_step(step)
                sent[i] = a_free
        attn_busy += m * (L * attn + head)  # block 0 .. L-1 attention and the heads
        now = a_free
        iterations += 1
        position += 1
    tokens = rows * m
    tps = tokens * iterations / now
    return Simulated(
        tps, now / iterations, tokens, float(micro), float(rows * model.experts_per_token / model.num_expert_ids),
        min(1.0, attn_busy / now), min(1.0, exp_busy / (len(placed) * now)),
    )  # fmt: skip
