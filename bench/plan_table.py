"""The planner's table at full model depth (issue 20): for each GPU type × top-k × pool size × routing, the best
plan of each mode (AEP, EP, ping-pong; copies allowed) as `amoe plan` ranks them, each with its corrected bound,
its refined prediction (the discrete-event simulation, docs/emulation.md "Simulation"; ping-pong analytic) and the
fraction of the bound it reaches, AEP / EP against the bounds' AEP / EP, and the planner's pick.

    .venv/bin/python bench/plan_table.py [--gpus a100-80g,h100,h200] [--sizes 8,16] [--top-k 1,2] [--jobs N] [--out DIR]
    .venv/bin/python bench/plan_table.py --figure10 --gpus a100-80g

These are predictions, not measurements: bench/plan_check.py is what measures the emulated runtime against them
(within 10 % for six of seven plans on 4-block profiles, docs/results.md "Planner"). Prints a markdown table and a
final JSON line; writes plan_table.json to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from amoe.emulation.routing import DEFAULT_LAMBDA
from amoe.plan import PlanRequest, best_per_mode, describe, search

# The sourced skew, the same with request affinity, and the stress case (docs/emulation.md "Routing").
ROUTINGS = (f"skew-exp:{DEFAULT_LAMBDA:g}", f"skew-exp:{DEFAULT_LAMBDA:g},rho=0.5", "skew-exp:0.4")
PROFILE = "mixtral-8x7b-mqa"


def cell(gpu: str, n: int, top_k: int, routing: str, profile: str) -> dict:
    """The best plan of each mode on n GPUs of one type, and the planner's pick."""
    plans = search(PlanRequest(profile, {gpu: n}, top_k=top_k, routing=routing))
    best = best_per_mode(plans)
    modes = {}
    for mode, plan in best.items():
        pred = plan.prediction
        bound = pred.extra.get("bound", pred.tokens_per_s)
        modes[mode] = {
            "plan": describe(plan.deployment), "tokens_per_s": round(pred.tokens_per_s),
            "bound": round(bound), "fraction_of_bound": round(pred.tokens_per_s / bound, 3) if bound else None,
            "itl_ms": round(pred.itl_s * 1e3, 1), "concurrency": pred.concurrency,
            "simulated": bool(pred.extra.get("simulated")),
        }  # fmt: skip
    row = {
        "gpu": gpu,
        "gpus": n,
        "top_k": top_k,
        "routing": routing,
        "pick": plans[0].deployment.mode,
        **modes,
    }
    if "aep" in modes and "ep" in modes:
        aep, ep = modes["aep"], modes["ep"]
        row["aep_over_ep"] = round(aep["tokens_per_s"] / ep["tokens_per_s"], 3)
        row["bounds_aep_over_ep"] = round(aep["bound"] / ep["bound"], 3)
        row["of_bounds_ratio"] = round(row["aep_over_ep"] / row["bounds_aep_over_ep"], 3)
    return row


def figure10(gpu: str, routing: str, workload: str = "short") -> dict:
    """The paper's Figure 10 setup at full depth (32 blocks): the 16-expert model on one 8-GPU host and on two
    (16 GPUs, links between hosts on the critical path), AEP 4 + 4 → 8 + 8 and EP 8 → 16, each refined by the
    simulation: AEP's scaling and AEP / EP on 16, against the paper's 1.92× and 3× (over SGLang)."""
    from amoe.emulation import bounds
    from amoe.emulation.profiles import host_overhead, model_profile
    from amoe.plan import mean_context, refine

    model = bounds.full_depth(model_profile("mixtral-8x7b-16e", 1))
    ctx, host = mean_context(workload), host_overhead("amoe-paper")
    deployments = {
        "aep8": bounds.Deployment("aep", gpu, 4, gpu, 4),
        "aep16": bounds.Deployment("aep", gpu, 8, gpu, 8),
        "ep8": bounds.Deployment("ep", gpu, 8),
        "ep16": bounds.Deployment("ep", gpu, 16),
    }
    got = {}
    for name, dep in deployments.items():
        pred = refine(model, dep, routing, ctx, host).prediction
        got[name] = {"plan": describe(dep), "tokens_per_s": round(pred.tokens_per_s),
                     "bound": round(pred.extra.get("bound", pred.tokens_per_s)), "itl_ms": round(pred.itl_s * 1e3, 1)}  # fmt: skip
    t = {k: v["tokens_per_s"] for k, v in got.items()}
    return {
        "gpu": gpu, "routing": routing, **got,
        "aep_16_over_8": round(t["aep16"] / t["aep8"], 3), "ep_16_over_8": round(t["ep16"] / t["ep8"], 3),
        "aep_over_ep_16": round(t["aep16"] / t["ep16"], 3), "aep_over_ep_8": round(t["aep8"] / t["ep8"], 3),
        "paper": {"aep_16_over_8": 1.92, "aep_over_sglang_16": 3.0},
    }  # fmt: skip


def _k(x: int) -> str:
    return f"{x / 1000:.1f} k"


def markdown(rows: list[dict]) -> str:
    head = (
        "| GPUs | top-k | routing | pick | AEP plan | AEP tok/s (of bound) | EP plan | EP tok/s (of bound) "
        "| ping-pong tok/s | AEP / EP | bounds' AEP / EP | AEP / EP of bounds' |"
    )
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        aep, ep, pp = r.get("aep", {}), r.get("ep", {}), r.get("pingpong", {})

        def tps(m: dict) -> str:
            return f"{_k(m['tokens_per_s'])} ({m['fraction_of_bound']:.2f})" if m else "–"

        lines.append(
            f"| {r['gpus']}× {r['gpu']} | {r['top_k']} | {r['routing']} | **{r['pick']}** | {aep.get('plan', '–')} "
            f"| {tps(aep)} | {ep.get('plan', '–')} | {tps(ep)} | {_k(pp['tokens_per_s']) if pp else '–'} "
            f"| {r.get('aep_over_ep', '–')} | {r.get('bounds_aep_over_ep', '–')} | {r.get('of_bounds_ratio', '–')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="a100-80g,h100,h200")
    parser.add_argument("--sizes", default="8,16")
    parser.add_argument("--top-k", default="1,2")
    parser.add_argument("--routings", default=";".join(ROUTINGS), help="';'-separated routing specs")
    parser.add_argument("--profile", default=PROFILE)
    parser.add_argument("--out", default="docs/results/plan_table")
    parser.add_argument("--jobs", type=int, default=1, help="cells planned at once, one process each")
    parser.add_argument(
        "--figure10", action="store_true", help="only the Figure 10 setup (16 experts, 8 vs 16 GPUs)"
    )
    args = parser.parse_args()
    started = time.monotonic()
    if args.figure10:
        for routing in args.routings.split(";"):
            print(json.dumps(figure10(args.gpus.split(",")[0], routing)), flush=True)
        return
    grid = itertools.product(
        args.gpus.split(","), [int(s) for s in args.sizes.split(",")], [int(s) for s in args.top_k.split(",")],
        args.routings.split(";"), [args.profile],
    )  # fmt: skip
    rows = []
    # Each cell is one process's simulations (pure Python, one core); the rows come back in the grid's order.
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(cell, *zip(*grid)):
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(markdown(rows))
    picks = {m: sum(r["pick"] == m for r in rows) for m in ("aep", "ep", "pingpong")}
    ratios = [r["of_bounds_ratio"] for r in rows if "of_bounds_ratio" in r]
    summary = {
        "profile": args.profile, "cells": len(rows), "picks": picks,
        "aep_fraction_of_bound": sorted(r["aep"]["fraction_of_bound"] for r in rows if "aep" in r),
        "aep_over_ep_of_bounds_min_max": [min(ratios), max(ratios)] if ratios else None,
        "wall_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_table.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
