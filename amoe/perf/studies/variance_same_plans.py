"""Each frontier-table cell's plan at its concurrency, simulated without and with the sourced step-time variance
(the same window, routing and seeds): what the variance alone does to the plan a table shows. Reads
`amoe bench frontier --table` JSON lines; one JSON line per cell with a plan.

    amoe bench variance-same-plans experiments/2026-11-27-frontier-step-variance/table_deepseek_v3_variance.jsonl

The window is refine's at the cell's ITL (warm-up 4 ITLs, 8 ITLs measured, AEP's batch-means stop); `off` is the
simulation at scale as it was before it drew the variance, to the last digit (tests/test_scale_variance.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time

from amoe.config import SchedulerSection
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import DEFAULT_LAMBDA, routing_inclusion
from amoe.perf.model.variance import OFF, SOURCED
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.search import balanced_map
from amoe.perf.plan.simulate import simulate
from amoe.perf.studies.frontier import TABLE_CONTEXT

# The scheduler the recorded runs simulated an event-level AEP plan with (the default then, defrag; the simulation at
# scale models defrag's expert side whatever is asked).
RECORDED_SCHEDULER = SchedulerSection(policy="defrag")


def parse(text: str, q) -> Deployment:
    """The deployment `amoe.perf.plan.deployment.describe` printed as `text` (H800s, as the tables run)."""
    rep = re.search(r" x(\d+) replicas", text)
    replicas = int(rep.group(1)) if rep else 1
    cap = int(re.search(r" cap (\d+)", text).group(1))
    if text.startswith("ep "):
        n = int(re.match(r"ep (\d+)x", text).group(1))
        red = re.search(r"eplb\+(\d+)", text)
        return Deployment(
            "ep", "h800", n, attn_cap=cap, replicas=replicas, redundant_experts=int(red.group(1)) if red else 0,
            two_batch_overlap=" tbo" in text,
        )  # fmt: skip
    mode = text.split()[0]
    a, e = map(int, re.match(r"\w+ (\d+)xh800 attn \+ (\d+)xh800", text).groups())
    emap = balanced_map(q, e) if text.endswith("balanced") else None
    if mode == "aep":
        ecap = int(re.search(r"ecap (\d+)", text).group(1))
        return Deployment(
            "aep", "h800", a, "h800", e, attn_cap=cap, expert_cap=ecap, replicas=replicas, expert_map=emap
        )
    mb = int(re.search(r"m=(\d+)", text).group(1))
    return Deployment(
        "pingpong", "h800", a, "h800", e, attn_cap=cap, micro_batches=mb, replicas=replicas, expert_map=emap
    )


def main(args: argparse.Namespace) -> int:
    """`amoe bench variance-same-plans TABLE` (amoe.perf.studies.commands)."""
    path = args.table
    host = host_overhead("none")
    with open(path) as f:
        cells = [json.loads(line) for line in f]
    for cell in cells:
        if "plan" not in cell:
            continue
        model = model_profile(cell["profile"])
        routing = f"skew-exp:{DEFAULT_LAMBDA * 8 / model.num_experts:g}"
        dep = parse(cell["plan"], routing_inclusion(model, routing))
        one = dataclasses.replace(dep, replicas=1)
        requests, itl = cell["concurrency"] // dep.replicas, cell["itl_ms"] / 1e3
        out = {k: cell[k] for k in ("profile", "gpus", "mode", "itl_slo_ms", "plan")} | {
            "requests_per_copy": requests
        }
        t0 = time.time()
        for name, variance in (("off", OFF), ("sourced", SOURCED)):
            sim = simulate(
                model, one, routing, TABLE_CONTEXT, host, requests, warmup_s=4 * itl, duration_s=8 * itl,
                variance=variance, batches=32, scheduler=RECORDED_SCHEDULER,
            )  # fmt: skip
            out[name] = {
                "per_gpu": round(sim.tokens_per_s * dep.replicas / cell["gpus"]),
                "itl_ms": round(sim.itl_s * 1e3, 1),
                "expert_rows_per_step": round(sim.expert_rows_per_step, 1),
            }
        out["ratio"] = round(out["sourced"]["per_gpu"] / max(1, out["off"]["per_gpu"]), 3)
        out["wall_s"] = round(time.time() - t0, 1)
        print(json.dumps(out), flush=True)
    return 0
