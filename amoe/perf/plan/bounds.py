"""What a deployment can do at best on emulated GPUs: decode throughput and inter-token latency of AEP, EP and
ping-pong, from the cost model's step times (docs/simulation.md "Bounds"; `amoe plan` searches over these).

Every bound is at the profile's full depth (a truncated `NAME:N` profile is a benchmark device, not a model), with
the expected load of each expert taken from the exact probability that it is among a token's top-k picks
(`routing.inclusion_probabilities`), per block:

* **AEP**: each attention GPU keeps W waves of w rows in flight (KV and the batch cap permitting); a rank's waves
  meet the expert GPUs in groups of m (m a doubling dividing W) that travel together, and a group's iteration is
  its critical path, per block its m attention steps + transfer + the hottest expert GPU's grouped step over the
  block's rows of every attention GPU's group + transfer back, plus the heads; expert GPU g runs W / m grouped
  steps a block, so ITL = max(path_m, W · attention work, W / m · g's work, link), with the best m, and
  throughput = A · W · w / ITL (as ping-pong's bound, without its lock-step). The hottest expert GPU over all
  blocks, not the mean, sets the expert side's rate: with skew it carries more than its share.
* **EP**: every device runs attention on b rows, then a dispatch all-to-all, one grouped GEMM over its local
  experts (one host step, not one per expert), a combine all-to-all, and waits at the barrier for the slowest
  device, block after block.
* **Ping-pong** (MegaScale-Infer): attention and expert pools as AEP, each attention batch split into m
  micro-batches that alternate between the pools block by block; a block takes the slower pool's m steps plus the
  two transfers that the alternation cannot hide.

Transfers between AEP's and ping-pong's pools (the incast; `PoolLinks`) take the slower of the sender's
and the receiver's link: an expert GPU receives the rows of every attention GPU whose wave or micro-batch reached
it (A / E times what one attention GPU sends when A > E, more on a hot one), and the busiest such GPU sets each
block's transfers. Each GPU's NIC (full duplex) is also a throughput limit, bottleneck "link": per iteration it
moves its rows in and out, whatever the waves or micro-batches.

ITL follows from Little's law: concurrency / throughput (each of the C requests decoding at once gets one token per
C / T seconds).

Step-time variance (amoe.perf.model.variance; sourced by default, `variance=OFF` for none): every GPU runs at its own
fixed speed (GPU i of the deployment: attention GPUs first, then expert GPUs; EP: device i) and each step jitters. A
barrier pays the slowest: EP's blocks and ping-pong's micro-batch steps wait for `expected_max` over the devices, and
so does an AEP wave's critical path at the expert GPUs of a block. A queue does not: each AEP GPU works at its own
speed and the slowest expert GPU sets the expert side's rate; but attention GPUs whose waves meet at every block's
expert step go at the slowest one's pace (`_aep`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.variance import SOURCED, StepVariance
from amoe.perf.plan.bound_ep import ep_bound
from amoe.perf.plan.bound_pools import disaggregated_bound
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.prediction import Prediction


def full_depth(model: ModelProfile) -> ModelProfile:
    """The profile at its model's full depth (a `NAME:N` benchmark profile keeps N blocks; its bounds are the full
    model's × N / depth, since the head is scaled too, so ratios do not depend on the truncation)."""
    if model.full_blocks is None:
        return model
    return replace(model, name=model.name.partition(":")[0], num_blocks=model.full_blocks, full_blocks=None)


def predict(
    model: ModelProfile,
    dep: Deployment,
    inclusion: np.ndarray,
    mean_context: float,
    host: HostOverhead,
    itl_slo_s: float | None = None,
    variance: StepVariance = SOURCED,
) -> Prediction:
    """The bound of `dep` (module docstring) for a model at full depth and per-block inclusion probabilities.
    Replicas multiply throughput and concurrency; ITL is one copy's. With `itl_slo_s` AEP's operating point is the
    best whose ITL meets it (EP's and ping-pong's are set by the batch cap and micro-batches the search varies).
    `variance`: the GPUs' step-time variance (module docstring)."""
    one = replace(dep, replicas=1)
    pred = (
        ep_bound(model, one, inclusion, mean_context, host, variance)
        if dep.mode == "ep"
        else disaggregated_bound(model, one, inclusion, mean_context, host, itl_slo_s, variance)
    )
    if dep.replicas == 1 or pred.tokens_per_s <= 0:
        return pred
    return replace(
        pred, tokens_per_s=pred.tokens_per_s * dep.replicas, concurrency=pred.concurrency * dep.replicas,
        attention_tokens_per_s=pred.attention_tokens_per_s * dep.replicas,
        expert_tokens_per_s=pred.expert_tokens_per_s * dep.replicas,
    )  # fmt: skip
