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
    # The barrier modes (EP, ping-pong): the mean fraction of the window a GPU waited at a barrier for a slower
    # one's step (EP: its attention, head and expert steps; ping-pong: the attention GPUs' steps), and of that the
    # waits for a slower attention step or head; AEP has no barrier (0). docs/simulation.md "The barrier tax".
    barrier_idle: float = 0.0
    attention_idle: float = 0.0
    # AEP at scale: the expert side's rule the figure is of ("waves": group cells; "defrag": defrag's pick), which
    # the plan is then served with; None where the simulation runs the policy itself (event by event).
    expert_pick: str | None = None
