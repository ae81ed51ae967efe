"""EP as it is deployed at scale: redundant experts placed by EPLB, two-batch overlap, DeepEP's
dispatch in FP8 and combine in BF16, and expert loads drawn per iteration from counts rather than per token.

* **EPLB** (github.com/deepseek-ai/EPLB, as DeepSeek and SGLang deploy it): per layer, the R redundant slots go one
  at a time to the expert with the most load per copy, then every copy (load / copies) goes, heaviest first, to
  the least-loaded device with a free slot ((E + R) / devices slots each). A token of an expert with c copies is
  served by one of them, evenly.
* **Two-batch overlap** (SGLang's TBO after DeepSeek's profile-data design): a device's batch runs as two
  micro-batches, one computing (attention, its experts) while the other's dispatch or combine is on the wire, so
  a block takes the longer of the two streams: max(2 · compute(b/2), 2 · exchange(b/2)), instead of their sum at b.
* **Counts at scale**: a block's rows per expert over T tokens are drawn as independent binomials (T, q_e) from
  the exact inclusion probabilities: the same per-expert mean and variance as T keyed top-k draws, without their
  within-token correlation (k of E experts), at a cost that does not grow with T — what lets the simulation run
  256 devices of 256 tokens (docs/simulation.md "Simulation at scale").
"""

from __future__ import annotations

import numpy as np

from amoe import eplb
from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import GpuProfile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile


def eplb_placement(load: np.ndarray, num_devices: int, redundant: int) -> list[list[tuple[int, float]]]:
    """Per device, its (expert id, share of that expert's tokens) copies for one layer's expected `load`: EPLB's
    global policy, the one implementation the serving product rebalances with (amoe.eplb)."""
    counts, packs = eplb.place_layer(load, len(load) + redundant, num_devices)
    return [[(e, 1.0 / counts[e]) for e in pack] for pack in packs]


def device_rows(
    placement: list[list[tuple[int, float]]], rows_per_expert: np.ndarray
) -> list[tuple[list[float], list[int]]]:
    """(rows of each copy, expert ids) per device, for a block's rows per expert."""
    return [
        ([rows_per_expert[e] * share for e, share in copies], [e for e, _ in copies]) for copies in placement
    ]


def slowest_device(model: ModelProfile, gpu: GpuProfile, loads, host: HostOverhead) -> tuple[float, float]:
    """(the slowest device's grouped GEMM, the mean device's) over `device_rows` loads."""
    times = [cm.grouped_expert_time(model, gpu, rows, host, ids) for rows, ids in loads]
    return max(times), sum(times) / len(times)


def block_time(attn_s: float, experts_s: float, exchange_s: float, overlap: bool) -> float:
    """One EP block: without overlap attention, dispatch, the slowest device's experts and combine in turn; with
    two-batch overlap the arguments are one micro-batch's (half the batch) and the two streams overlap."""
    if not overlap:
        return attn_s + exchange_s + experts_s
    return max(2 * (attn_s + experts_s), 2 * exchange_s)


def sample_counts(rng: np.random.Generator, tokens: int, inclusion: np.ndarray) -> np.ndarray:
    """Rows per expert id of `tokens` tokens, each expert drawn binomially with its inclusion probability."""
    return rng.binomial(tokens, np.clip(inclusion, 0.0, 1.0)).astype(np.float64)
