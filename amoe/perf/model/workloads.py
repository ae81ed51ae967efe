"""The AMoE paper's §5 workloads as the cost model needs them: each request's input and output lengths drawn
independently and uniformly (inclusive) from a range, and the mean context a decoding request holds.

These are the lengths of `amoe bench serve --workload short | medium | reasonable` (amoe.bench.workloads, which
draws the requests; the serving product's load generator keeps its own table, tests check the two agree).
"""

from __future__ import annotations

from amoe.errors import ConfigError
from amoe.perf.model import cost_model as cm

PAPER_WORKLOADS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "short": ((30, 70), (70, 130)),
    "medium": ((50, 150), (50, 250)),
    "reasonable": ((100, 300), (100, 500)),
}


def mean_context(workload: str) -> float:
    """The mean context of a decoding request of the named paper workload (cost_model.mean_decode_context)."""
    if workload not in PAPER_WORKLOADS:
        raise ConfigError(f"--workload must be one of {', '.join(PAPER_WORKLOADS)}; got {workload!r}")
    return cm.mean_decode_context(*PAPER_WORKLOADS[workload])
