"""`amoe bench compare`'s outputs: the headline ratios, the readable table, results.json and the plots."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path
from typing import Any

from amoe.perf.studies.compare_setup import Preset, Setup, ep_upper_bound, upper_bound

logger = logging.getLogger(__name__)


def headline(points: list[dict[str, Any]], p: Preset, seed: int = 0) -> dict[str, Any]:
    """AEP / EP at the same ITL per group, AEP's fraction of the bound, defrag vs mtfs / flfs."""
    out: dict[str, Any] = {"time_scale": p.time_scale}
    for group in sorted({pt["group"] for pt in points}, key=lambda g: g != "main"):
        prefix = "" if group == "main" else f"{group}_"
        out.update({f"{prefix}{k}": v for k, v in _group_ratios(points, group, p, seed).items()})
    out.update(_policy_ratios(points))
    out.update(scaling(points))
    return out


# Two runs of a preset agree when every headline ratio is within this fraction of its median.
AGREEMENT = 0.05
# The headline figures that are ratios: what the repeats' agreement is judged on.
_RATIO_WORDS = ("_over_", "fraction", "defrag_vs_")


def median_headline(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline of repeated runs: each number the median of the runs' (nested dicts alike), `spread` the
    (max - min) / median of every ratio, and whether the runs agree within AGREEMENT on all of them."""
    if len(runs) == 1:
        return {**runs[0], "runs": 1}
    spread: dict[str, float] = {}

    def merge(values: list[Any], path: str) -> Any:
        first = values[0]
        if isinstance(first, dict):
            return {k: merge([v.get(k) for v in values], f"{path}{k}.") for k in first}
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) != len(values):
            return first  # lists, strings, missing values: the first run's
        mid = statistics.median(numbers)
        key = path.rstrip(".")
        if any(w in key for w in _RATIO_WORDS) and mid:
            spread[key] = round((max(numbers) - min(numbers)) / abs(mid), 3)
        return round(mid, 3) if isinstance(mid, float) else mid

    out = merge(runs, "")
    out["saturated_points"] = sorted({p for r in runs for p in r.get("saturated_points", [])})
    out["runs"] = len(runs)
    out["spread"] = spread
    out["max_spread"] = max(spread.values(), default=0.0)
    out["agree_within_5pct"] = out["max_spread"] <= AGREEMENT
    return out


def scaling(points: list[dict[str, Any]], small: str = "16e8gpu", large: str = "16gpu") -> dict[str, Any]:
    """Figure 10: each mode's best throughput on two nodes (16 GPUs) over one node (8), same 16-expert model."""
    out: dict[str, Any] = {}
    for mode in ("aep", "ep"):
        best = {
            g: max(
                (pt["throughput"] for pt in points if pt["group"] == g and pt["setup"]["mode"] == mode),
                default=0,
            )
            for g in (small, large)
        }
        if best[small] and best[large]:
            out[f"{mode}_16gpu_over_8gpu"] = _ratio(best[large], best[small])
    return out


def _group_ratios(points: list[dict[str, Any]], group: str, p: Preset, seed: int) -> dict[str, Any]:
    sweep = [pt for pt in points if pt["group"] == group and pt["kind"] == "sweep"]
    aep = [pt for pt in sweep if pt["setup"]["mode"] == "aep"]
    ep = [pt for pt in sweep if pt["setup"]["mode"] == "ep"]
    if not aep or not ep:
        return {}
    # Steady points (amoe.perf.studies.steady), where the preset has them: the maxima at the requests the best load
    # point held, and AEP's curve near EP's ITL from points aimed at it.
    steady = {pt["setup"]["mode"]: pt for pt in points if pt["group"] == group and pt["kind"] == "max"}
    at_itl = [pt for pt in points if pt["group"] == group and pt["kind"] == "at_itl"]
    curve = [pt for pt in points if pt["group"] == group and pt["config"] == aep[0]["config"]]
    if "aep" in steady and at_itl:
        curve = [steady["aep"], *at_itl]
    ep_best = steady.get("ep") or max(ep, key=lambda pt: pt["throughput"])
    budget = ep_best["itl_ms_mean"] or float("inf")
    aep_max = steady["aep"]["throughput"] if "aep" in steady else max(pt["throughput"] for pt in aep)
    setup = Setup.from_record(aep[0]["setup"])
    bound = upper_bound(setup, p)
    ep_bound = ep_upper_bound(Setup.from_record(ep_best["setup"]), p, seed)
    return {
        # At EP's ITL at its max, on AEP's curve: every point of that config, the policy comparison's included.
        "aep_over_ep": _ratio(throughput_at_itl(curve, budget), ep_best["throughput"]),
        "aep_over_ep_max": _ratio(aep_max, ep_best["throughput"]),
        "aep_max_tokens_per_s": round(aep_max),
        "ep_max_tokens_per_s": round(ep_best["throughput"]),
        "ep_itl_ms_at_max": _round(ep_best["itl_ms_mean"]),
        "upper_bound_tokens_per_s": round(bound),
        "upper_bound_kv_only_tokens_per_s": round(upper_bound(setup, p, max_attn_batch=1 << 20)),
        "aep_fraction_of_upper_bound": _ratio(aep_max, bound),
        # What the emulated GPUs alone allow EP (every device at full batches, stalls only at the barriers): the
        # ratio of the two bounds is the largest AEP / EP a perfect runtime could show on this cost model.
        "ep_upper_bound_tokens_per_s": round(ep_bound),
        "ep_fraction_of_its_bound": _ratio(ep_best["throughput"], ep_bound),
        "bounds_aep_over_ep": _ratio(bound, ep_bound),
    }


def throughput_at_itl(sweep: list[dict[str, Any]], itl_ms: float) -> float:
    """The most throughput a setup's throughput-vs-ITL curve (Figure 9: its points in ITL order, linear between
    neighbours) reaches at mean ITL ≤ itl_ms; 0 if even its lightest point is slower."""
    pts = sorted((pt for pt in sweep if pt["itl_ms_mean"] is not None), key=lambda pt: pt["itl_ms_mean"])
    best = max((pt["throughput"] for pt in pts if pt["itl_ms_mean"] <= itl_ms), default=0.0)
    for a, b in zip(pts, pts[1:]):
        lo, hi = a["itl_ms_mean"], b["itl_ms_mean"]
        if lo <= itl_ms < hi:  # the curve crosses the ITL budget between these two loads
            f = (itl_ms - lo) / (hi - lo)
            best = max(best, a["throughput"] + f * (b["throughput"] - a["throughput"]))
    return best


def _policy_ratios(points: list[dict[str, Any]]) -> dict[str, Any]:
    """defrag against mtfs and flfs: throughput at each policy's maximum (defrag's: its sweep's best point, the
    others' at that point's rate), ITL and throughput at the policy load (of defrag's maximum)."""
    at_load = {pt["setup"]["policy"]: pt for pt in points if pt["kind"] == "policy"}
    at_max = {pt["setup"]["policy"]: pt for pt in points if pt["kind"] == "policy_max"}
    defrag = at_load.get("defrag")
    out: dict[str, Any] = {}
    if defrag is None:
        return out
    sweep = [pt for pt in points if pt["kind"] in ("sweep", "max") and pt["config"] == defrag["config"]]
    steady = [pt["throughput"] for pt in sweep if pt["kind"] == "max"]
    defrag_max = (steady or [max(pt["throughput"] for pt in sweep)])[0] if sweep else None
    for other in ("mtfs", "flfs"):
        if other not in at_load:
            continue
        o = at_load[other]
        ratios = {
            "itl_mean": _ratio(defrag["itl_ms_mean"], o["itl_ms_mean"]),
            "throughput_at_load": _ratio(defrag["throughput"], o["throughput"]),
        }
        if other in at_max:
            ratios["throughput"] = _ratio(defrag_max, at_max[other]["throughput"])
        out[f"defrag_vs_{other}"] = ratios
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def table(points: list[dict[str, Any]]) -> str:
    """One row per load point (emulated time); busy = mean fraction of the window each role's runtimes ran layers;
    host = CPU cores the server and the load generator used; scale = the setup's wall seconds per emulated second."""
    head = (
        f"{'config':<32} {'kind':<6} {'req/s':>8} {'tok/s':>9} {'ITL mean':>9} {'p50':>7} {'p90':>7} "
        f"{'TTFT':>7} {'busy':>11} {'host':>5} {'scale':>5}"
    )
    rows = [head, "-" * len(head)]
    for pt in points:
        rows.append(
            f"{pt['config']:<32} {pt['kind']:<6} {pt['rate']:>8.1f} {pt['throughput']:>9.0f} "
            f"{_fmt(pt['itl_ms_mean'])} {_fmt(pt['itl_ms_p50'], 7)} {_fmt(pt['itl_ms_p90'], 7)} "
            f"{_fmt(pt.get('ttft_ms_mean'), 7)} {busy_summary(pt.get('busy') or {}):>11} "
            f"{_fmt(pt.get('host_cores'), 5)} {pt.get('time_scale', 0):>5g}"
        )
    return "\n".join(rows)


def busy_summary(busy: dict[str, float]) -> str:
    """ "a0.91/e0.55": the mean busy fraction of the attention and the expert runtimes (EP devices are "a")."""
    parts = []
    for role in ("attention", "expert"):
        values = [v for k, v in busy.items() if k.split()[0] == role]
        if values:
            parts.append(f"{role[0]}{sum(values) / len(values):.2f}")
    return "/".join(parts) or "n/a"


def _fmt(x: float | None, width: int = 9) -> str:
    return f"{'n/a':>{width}}" if x is None else f"{x:>{width}.2f}"


def write_outputs(
    out: Path, points: list[dict[str, Any]], summary: dict[str, Any], p: Preset, args: argparse.Namespace,
    runs: list[dict[str, Any]] | None = None,
) -> None:  # fmt: skip
    """results.json (the table and plots of the first run, the headline: the runs' medians, and each run's
    headline), throughput_vs_itl.png, queue_depth.png."""
    from amoe.perf.studies.plots import plot_queue_depth, plot_throughput_vs_itl

    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": f"amoe bench compare --preset {args.preset} --seed {args.seed} --repeats {getattr(args, 'repeats', 1)}",
        "preset": args.preset,
        "time_scale": p.time_scale,
        "duration_s": p.duration_s,
        "blocks": p.blocks,
        "attn_batch_cap": p.attn_cap,
        "expert_batch_cap": p.expert_cap,
        "headline": summary,
        "runs": runs or [summary],
        "points": [{k: v for k, v in pt.items() if k != "queue"} for pt in points],
        "queue_depth": {f"{pt['config']}@{pt['rate']:.0f}": pt.get("queue", []) for pt in points},
    }
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    plot_throughput_vs_itl(points, out / "throughput_vs_itl.png")
    plot_queue_depth(points, out / "queue_depth.png")
    logger.info("[compare] wrote %s", out)
