"""The emulation's time scale from the host it runs on: measure what the host's Python does per runtime
step, and stretch emulated time so that host work stays the same fraction of every emulated step on any machine.

An emulated runtime's step is a sleep of (predicted GPU time × time scale) plus the host work around it (batch
assembly, messages, the scheduler): the host work is the part the emulation must keep small, and it is what makes a
result move with the machine (a host whose Python runs 2× slower doubles it). `host_probe()` times a fixed mix of
that work — the wire message of an expert batch, the index ops of batch assembly, routing's numpy — and
`scaled(base)` multiplies a preset's time scale by probe / REFERENCE_PROBE_S, the probe on the machine the presets'
scales were chosen on. A point whose server used most of the host's cores is marked and rerun slower
(`saturated`): there the host, not the emulated GPUs, set the pace.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from amoe import core

# The probe's median on the development machine (2 cores, Python 3.11, torch 2.13 CPU; 2026-11-25), where the presets'
# time scales keep the host at about one core at their top loads. Measured with `python -m amoe.perf.studies.calibrate`.
REFERENCE_PROBE_S = 55e-6
# A point whose server processes and load generator used more than this fraction of the host's cores is marked
# saturated: the runtimes queued for the CPU, so the emulated GPUs did not set the pace.
SATURATED_CORE_FRACTION = 0.85
_ROWS = 64
_HIDDEN = 16  # the emulation's wire width (amoe.runtime.emulated.WIRE_HIDDEN)


def _one_step(rng: np.random.Generator, x: torch.Tensor) -> None:
    """One runtime step's host work in miniature: route, group rows by expert, build and read a wire message."""
    ids = torch.from_numpy(rng.integers(0, 8, _ROWS))
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=8)
    rows = x.index_select(0, order)
    cols = {
        name: torch.zeros(_ROWS, dtype=torch.int64)
        for name in ("request_id", "kind", "block", "index", "position", "chunk_start", "slot", "attn_rank")
    }
    msg = core.make_message(
        rows, chunk_len=torch.ones(_ROWS, dtype=torch.int64), expert_id=ids, weight=torch.ones(_ROWS), **cols
    )
    meta = msg.meta()
    int(meta["block"][0]) + int(counts.max())


def host_probe(seconds: float = 0.3, repeats: int = 5) -> float:
    """Median seconds of one probe step (see module docstring), over `repeats` runs of ~seconds / repeats each."""
    rng = np.random.default_rng(0)
    x = torch.zeros(_ROWS, _HIDDEN)
    for _ in range(20):  # warm caches and lazy imports
        _one_step(rng, x)
    medians = []
    for _ in range(repeats):
        times, end = [], time.perf_counter() + seconds / repeats
        while (start := time.perf_counter()) < end:
            _one_step(rng, x)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return statistics.median(medians)


def scaled(base_time_scale: float, probe_s: float | None = None) -> tuple[float, float]:
    """(time scale, probe seconds): the preset's scale stretched by how slow this host's Python is now."""
    probe_s = host_probe() if probe_s is None else probe_s
    return base_time_scale * probe_s / REFERENCE_PROBE_S, probe_s


# Output tokens per wall second a 2-core reference host serves with the host at about one core (the coordinator's
# per-token work and the load generator's): a plan predicted faster than this runs at a proportionally higher scale.
WALL_TOKENS_PER_S = 5000.0


def plan_time_scale(scale: float, probe_s: float, predicted_tps: float) -> float:
    """The time scale one deployment runs at: `scale` (a preset's, already stretched by the probe) for every mode —
    the synchronous modes' barrier exchange is C++ (cpp/exchange.h), so their host work per block is as small as
    AEP's — and at least what keeps its emulated tokens/s within WALL_TOKENS_PER_S of wall time on the reference
    host (more on a slower one)."""
    return max(scale, predicted_tps / WALL_TOKENS_PER_S * probe_s / REFERENCE_PROBE_S)


def saturated(host_cores: float | None) -> bool:
    """Whether a point's measured host CPU (cores in use) says the host, not the emulated GPUs, set its pace."""
    return host_cores is not None and host_cores > SATURATED_CORE_FRACTION * (os.cpu_count() or 1)


if __name__ == "__main__":
    print(f"host probe: {host_probe() * 1e6:.0f} µs per step (reference {REFERENCE_PROBE_S * 1e6:.0f} µs)")
