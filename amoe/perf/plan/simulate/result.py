"""What a simulation reports (amoe.perf.plan.simulate, event by event, and amoe.perf.plan.simulate.scale, at
scale): one module both import, so neither imports the other's results."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Simulated:
    """A simulated run's steady state."""

    tokens_per_s: float
    itl_s: float
    concurrency: int
    attention_rows_per_step: float
    expert_rows_per_step: float
    attention_busy: float  # mean fraction of the measured window the attention GPUs held
    expert_busy: float
