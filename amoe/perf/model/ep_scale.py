"""EP as it is deployed at scale: redundant experts placed by EPLB, two-batch overlap, DeepEP's
dispatch in FP8 and combine in BF16, and expert loads drawn per iteration from counts rather than per token.

* **EPLB** (github.com/deepseek-ai/EPLB, as DeepSeek and SGLang deploy it): per layer, the R redundant slots go one
  at a time to the expert with the most load per copy, then every copy (load / copies) goes, heaviest first, to
  the least-loaded device with a free slot ((E + R) / devices slots each). A token of an expert with c copies is
  served by one of them, evenly.
* **Two-batch overlap** (DeepSeek's decode schedule, github.com/deepseek-ai/profile-data, which SGLang's TBO
  follows): a device's batch runs as two micro-batches whose stages alternate on the compute stream while the other
  one's exchange is on the wire: micro-batch 0's dispatch is hidden behind its shared expert and micro-batch 1's
  projections before attention's core (ATTN-0), its combine behind micro-batch 1's core and output projections
  (ATTN-1), and the other way round. Where the wire takes longer than the stage it hides behind, the compute stream
  waits at that barrier (DeepEP's receive kernel holds it, busy-waiting: what DeepSeek's profile shows as its
  dispatch and combine kernels' time). Without the overlap a block is its parts in turn.
* **Counts at scale**: a block's rows per expert over T tokens are drawn as independent binomials (T, q_e) from
  the exact inclusion probabilities: the same per-expert mean and variance as T keyed top-k draws, without their
  within-token correlation (k of E experts), at a cost that does not grow with T — what lets the simulation run
  256 devices of 256 tokens (docs/simulation.md "Simulation at scale").
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's parts of an EP block, seconds: attention's stage before its core (`stage_in`), the core
    and after it (`stage_out`), the slowest device's experts, and the dispatch's and combine's wire times."""

    stage_in: float
    stage_out: float
    experts: float
    dispatch: float
    combine: float


def attention_stages(parts: dict[str, float]) -> tuple[float, float]:
    """(stage_in, stage_out) of cost_model.attention_parts: the GEMMs before the core, then the core and the GEMMs
    after it; the elementwise kernels, launch gaps and host step split evenly between the two."""
    rest = parts["elementwise"] + parts["launches"] + parts["host"]
    return parts["gemm_in"] + rest / 2, parts["core"] + parts["gemm_out"] + rest / 2


def block_time(mb: MicroBatch, overlap: bool) -> float:
    """One EP block: without overlap attention, dispatch, the slowest device's experts and combine in turn (`mb`
    the whole batch); with two-batch overlap (`mb` one of two alike micro-batches) each exchange waits on the stage
    of the other micro-batch it is hidden behind (module docstring)."""
    if not overlap:
        return mb.stage_in + mb.stage_out + mb.dispatch + mb.experts + mb.combine
    return 2 * (max(mb.stage_in, mb.dispatch) + mb.experts + max(mb.stage_out, mb.combine))


def overlapped_block(stage_in, stage_out, experts, dispatch: float, combine: float) -> float:
    """block_time with overlap for two micro-batches that differ (each argument but the wire times a pair, one per
    micro-batch): micro-batch h's dispatch hides behind stage_in[h] (its shared expert and the other's projections
    in, taken as the size of its own stage), its combine behind the other's stage_out."""
    total = 0.0
    for h in (0, 1):
        total += max(stage_in[h], dispatch) + experts[h] + max(stage_out[1 - h], combine)
    return total


def sample_counts(rng: np.random.Generator, tokens: int, inclusion: np.ndarray) -> np.ndarray:
    """Rows per expert id of `tokens` tokens, each expert drawn binomially with its inclusion probability."""
    return rng.binomial(tokens, np.clip(inclusion, 0.0, 1.0)).astype(np.float64)
