"""The AMoE paper's published step times the cost model is calibrated to, and the operating points (derived in
docs/cost-model.md) they are compared at (tests/test_emulation.py checks the table)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CalibrationPoint:
    """A published step time and the operating point (derived in docs/cost-model.md) it is compared at."""

    name: str
    kind: str  # "attention" or "expert"
    gpu: str
    model: str
    top_k: int
    rows: int  # rows in the step
    context: int  # mean context tokens per row (attention only)
    paper_s: float
    source: str


# Figure 3 (A100 40GB, Mixtral 8x7B expert layer): throughput rises ~linearly until this batch, then flattens.
FIG3_KNEE_ROWS = 128

# §5.4 / Figure 13: one step of each kind sampled from a medium-workload run of Figure 9 (A100 80GB, 4 attention
# + 4 expert GPUs, Mixtral 8x7B MQA). The paper gives neither batch size; docs/cost-model.md derives them from
# Figure 11's top-1 operating point (250 req/s at 80 % of peak throughput, 150 output tokens per request):
# ~1024 rows per attention step; ~420 rows per expert step (per-rank fragments of 128 rows, ~3.3 of them merged
# while the expert GPU is busy; the range over 2–4 merged fragments is 256–512).
MEDIUM_MEAN_CONTEXT = 186  # input U[50,150] + tokens generated so far, output U[50,250]: 100 + E[o^2]/(2E[o])
CALIBRATION_POINTS: tuple[CalibrationPoint, ...] = (
    CalibrationPoint(
        name="attention step, medium workload",
        kind="attention",
        gpu="a100-80g",
        model="mixtral-8x7b-mqa",
        top_k=1,
        rows=1024,
        context=MEDIUM_MEAN_CONTEXT,
        paper_s=2.7e-3,
        source="AMoE §5.4, Figure 13",
    ),
    CalibrationPoint(
        name="expert step, medium workload",
        kind="expert",
        gpu="a100-80g",
        model="mixtral-8x7b-mqa",
        top_k=1,
        rows=420,
        context=0,
        paper_s=0.8e-3,
        source="AMoE §5.4, Figure 13",
    ),
)
