"""Throughput per GPU against cluster size, AEP against EP, as the cost model extrapolates it: the best
plan of each mode (`amoe plan`'s search) on 8 to 256 GPUs across hosts of 8.

    amoe bench plan-scale [--gpu h100] [--profile mixtral-8x7b-16e] [--top-k 1] [--out DIR]

Prints a table and a final JSON line; writes scale.png (throughput per GPU vs GPUs) and scale.json to --out. These
are predictions, not measurements: nothing here runs a runtime. By default the bounds (docs/simulation.md "Bounds");
with --simulate each mode's best shapes are refined by the discrete-event simulation and ranked by it, as `amoe plan`
does (one copy of each, so a plan of many small copies costs what one copy does). A copy of more than 16 GPUs or
16,384 requests is simulated at scale (amoe.perf.plan.simulate.scale) rather than keeping its bound.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from amoe.perf.model.routing import DEFAULT_LAMBDA
from amoe.perf.plan.deployment import describe
from amoe.perf.plan.request import PlanRequest
from amoe.perf.plan.search import search

SIZES = (8, 16, 32, 64, 128, 256)


def best(gpu: str, n: int, mode: str, args, replicate: bool) -> dict | None:
    req = PlanRequest(
        args.profile, {gpu: n}, top_k=args.top_k, routing=args.routing, modes=(mode,), gpus_per_node=8,
        attn_caps=(256, 1024), expert_caps=(512,), balanced=False, itl_slo_ms=args.itl_slo_ms,
        replicate=replicate, simulate_top=3 if args.simulate else 0,
    )  # fmt: skip
    # With --simulate the search refines its best shapes as `amoe plan` does and ranks them by the simulation: the
    # best by the bound alone can be an attention-heavy split that needs far more requests in flight than a
    # smaller one (H100 top-1: 5 + 3 simulates to 0.39 of its bound).
    plans = search(req)
    if not plans:
        return None
    p = plans[0]
    return {
        "gpus": n, "mode": mode if replicate else f"{mode}-1", "plan": describe(p.deployment), "used_gpus": p.deployment.num_gpus,
        "tokens_per_s": round(p.prediction.tokens_per_s), "per_gpu": round(p.prediction.tokens_per_s / n),
        "itl_ms": round(p.prediction.itl_s * 1e3, 1), "simulated": bool(p.prediction.extra.get("simulated")),
        "bound": round(p.prediction.extra.get("bound", p.prediction.tokens_per_s)),
    }  # fmt: skip


def main(args) -> int:
    """`amoe bench plan-scale` (its flags: amoe.perf.studies.commands)."""
    started = time.monotonic()
    args.routing = args.routing or f"skew-exp:{DEFAULT_LAMBDA:g}"
    # Best of each mode with copies allowed (what a deployment would do), and as one deployment over every GPU
    # (one EP group, one AEP cluster: the paper's multi-node question).
    rows = [
        r for n in SIZES for mode in ("aep", "ep") for replicate in (True, False)
        if (r := best(args.gpu, n, mode, args, replicate))
    ]  # fmt: skip
    print(f"{'GPUs':>5} {'mode':<4} {'tok/s':>9} {'/GPU':>7} {'ITL ms':>7}  plan")
    for r in rows:
        print(
            f"{r['gpus']:>5} {r['mode']:<4} {r['tokens_per_s']:>9} {r['per_gpu']:>7} {r['itl_ms']:>7}  {r['plan']}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps({"args": _flags(args), "rows": rows}, indent=1) + "\n")
    _plot(rows, out / "scale.png", args)
    ratios = {
        key: _ratios(rows, a, e) for key, a, e in (("best", "aep", "ep"), ("one_deployment", "aep-1", "ep-1"))
    }
    print(json.dumps({"gpu": args.gpu, "profile": args.profile, "top_k": args.top_k, "routing": args.routing,
                      "simulate": args.simulate, "aep_over_ep_by_gpus": ratios,
                      "not_simulated": [f"{r['mode']}@{r['gpus']}" for r in rows if args.simulate and not r["simulated"]],
                      "wall_s": round(time.monotonic() - started, 1)}))  # fmt: skip
    return 0


def _flags(args) -> dict:
    """The command's own flags (the CLI's namespace also holds its callbacks)."""
    names = ("gpu", "profile", "top_k", "routing", "itl_slo_ms", "out", "simulate")
    return {name: getattr(args, name) for name in names}


def _ratios(rows: list[dict], aep_mode: str, ep_mode: str) -> dict[int, float]:
    out = {}
    for n in SIZES:
        aep = next((r for r in rows if r["gpus"] == n and r["mode"] == aep_mode), None)
        ep = next((r for r in rows if r["gpus"] == n and r["mode"] == ep_mode), None)
        if aep and ep:
            out[n] = round(aep["tokens_per_s"] / ep["tokens_per_s"], 3)
    return out


def _plot(rows: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"aep": "AEP (best, copies allowed)", "ep": "EP (best, copies allowed)",
              "aep-1": "AEP, one deployment", "ep-1": "EP, one group"}  # fmt: skip
    for mode, label in labels.items():
        pts = [(r["gpus"], r["per_gpu"]) for r in rows if r["mode"] == mode]
        style = "-" if "-1" not in mode else "--"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (8 per host)")
    ax.set_ylabel("output tokens/s per GPU (" + ("simulated" if args.simulate else "bound") + ")")
    ax.set_title(f"{args.profile} top-{args.top_k} on {args.gpu}, {args.routing}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
