"""The planner's table at full model depth: for each GPU type × top-k × pool size × routing, the best
plan of each mode (AEP, EP, ping-pong; copies allowed) as `amoe plan` ranks them, each with its corrected bound,
its refined prediction (the discrete-event simulation, docs/simulation.md "Simulation"; ping-pong analytic) and the
fraction of the bound it reaches, AEP / EP against the bounds' AEP / EP, and the planner's pick.

    amoe bench plan-table [--gpus a100-80g,h100,h200] [--sizes 8,16] [--top-k 1,2] [--jobs N] [--out DIR]
    amoe bench plan-table --figure10 --gpus a100-80g

These are predictions. With --measure each cell's best plan of each mode also runs, one copy, on the emulated
runtime at full depth (`amoe bench plan-check`'s measurement: its `amoe serve` command loaded above its predicted rate),
and the row reports measured throughput (× copies) beside the prediction. At the plans' own concurrency that is
up to an hour per point on a 2-core host; an ITL objective (--itl-slo-ms) keeps the plans to fewer requests:

    amoe bench plan-table --measure --itl-slo-ms 150 --gpus a100-80g --sizes 8 --top-k 1 \
        --routings skew-exp:0.08 --out experiments/DATE-plan-table-measured

Prints a markdown table and a final JSON line; writes plan_table.json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from amoe.config import DEFAULT_POLICY
from amoe.errors import ConfigError
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import DEFAULT_LAMBDA
from amoe.perf.plan import bounds
from amoe.perf.plan.deployment import Deployment, describe
from amoe.perf.plan.prediction import Prediction
from amoe.perf.plan.refine import RESOLUTION
from amoe.perf.plan.request import Plan, PlanRequest, check_policy
from amoe.perf.plan.search import best_per_mode, search
from amoe.perf.studies import plan_check

# The sourced skew, the same with request affinity, and the stress case (docs/cost-model.md "Routing override").
ROUTINGS = (f"skew-exp:{DEFAULT_LAMBDA:g}", f"skew-exp:{DEFAULT_LAMBDA:g},rho=0.5", "skew-exp:0.4")
PROFILE = "mixtral-8x7b-mqa"
MODES = ("aep", "ep", "pingpong")


def cell(
    gpu: str, n: int, top_k: int, routing: str, profile: str, itl_slo_ms: float | None = None,
    step_variance: str = "sourced", aep_policy: str = DEFAULT_POLICY,
) -> dict:  # fmt: skip
    """The best plan of each mode on n GPUs of one type (each with its deployment, for --measure), and the
    planner's pick; AEP plans simulated with `aep_policy`."""
    req = PlanRequest(
        profile, {gpu: n}, top_k=top_k, routing=routing, itl_slo_ms=itl_slo_ms, step_variance=step_variance,
        aep_policy=aep_policy,
    )  # fmt: skip
    plans = search(req)
    # A mode's best simulated plan where the search simulated one: an unsimulated plan keeps its optimistic bound,
    # and under an ITL objective is what is left of a mode whose simulated plans all missed it (marked "bound only").
    best = best_per_mode(plans) | best_per_mode([p for p in plans if p.prediction.extra.get("simulated")])
    modes = {}
    for mode, plan in best.items():
        pred = plan.prediction
        bound = pred.extra.get("bound", pred.tokens_per_s)
        modes[mode] = {
            "plan": describe(plan.deployment), "tokens_per_s": round(pred.tokens_per_s),
            "bound": round(bound), "fraction_of_bound": round(pred.tokens_per_s / bound, 3) if bound else None,
            "itl_ms": round(pred.itl_s * 1e3, 1), "concurrency": pred.concurrency,
            "simulated": bool(pred.extra.get("simulated")), "bottleneck": pred.bottleneck,
            "deployment": dataclasses.asdict(plan.deployment),
        }  # fmt: skip
        if "wave_group" in pred.extra:  # how --measure serves it under waves' group cells
            modes[mode]["wave_group"] = pred.extra["wave_group"]
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


def one_copy(mode_row: dict) -> Plan:
    """A row's plan of one mode (as `_cell` wrote it), one copy of it: what --measure runs."""
    dep = dict(mode_row["deployment"])
    if dep.get("expert_map") is not None:
        dep["expert_map"] = tuple(dep["expert_map"])
    d = Deployment(**dep)
    n = d.replicas
    pred = Prediction(
        tokens_per_s=mode_row["tokens_per_s"] / n, itl_s=mode_row["itl_ms"] / 1e3,
        concurrency=mode_row["concurrency"] // n, bottleneck=mode_row.get("bottleneck", ""),
        extra={
            "bound": mode_row["bound"] / n, "simulated": mode_row.get("simulated", False),
            **({"wave_group": mode_row["wave_group"]} if "wave_group" in mode_row else {}),
        },
    )  # fmt: skip
    return Plan(dataclasses.replace(d, replicas=1), pred, None)


# The policy a measured point's key leaves unnamed: AEP points recorded before --aep-policy ran defrag and their
# keys carry no policy, so a defrag point's key has none (a format of measured.jsonl, not a default).
UNNAMED_POLICY = "defrag"


class Measured:
    """Measured points by what they run (one copy's plan, top-k, routing, requests), one JSON line each in a file:
    a plan that several cells share (8 and 16 GPUs of the same copies) runs once, and an interrupted --measure
    picks up where it stopped."""

    def __init__(self, path: Path, run: bool = True) -> None:
        self.path = path
        self.run = run  # False: report only what the file holds
        self.step_variance = "sourced"  # what the runs' emulated GPUs have (amoe.perf.model.variance)
        self.aep_policy = DEFAULT_POLICY  # the scheduling policy the AEP plans run (amoe serve --scheduler)
        self.points: dict[str, dict] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    self.points[entry["key"]] = entry["result"]

    @staticmethod
    def key(
        profile: str,
        top_k: int,
        routing: str,
        plan: Plan,
        step_variance: str = "off",
        aep_policy: str = UNNAMED_POLICY,
    ) -> str:
        # Points recorded before step-time variance existed ran without it, and AEP points recorded before
        # --aep-policy ran defrag: their keys have no suffix.
        suffix = "" if step_variance == "off" else f" variance {step_variance}"
        # the policy the plan runs: refine's record where it has one (a plan simulated at scale runs defrag)
        aep_policy = plan.prediction.extra.get("aep_policy", aep_policy)
        if plan.deployment.mode == "aep" and aep_policy != UNNAMED_POLICY:
            suffix += f" policy {aep_policy}"
        return f"{profile} top{top_k} {routing} {describe(plan.deployment)} c{plan.prediction.concurrency}{suffix}"

    def put(self, key: str, result: dict) -> None:
        self.points[key] = result
        with self.path.open("a") as f:
            f.write(json.dumps({"key": key, "result": result}) + "\n")


def little_rate(runs: list[dict]) -> float | None:
    """Measured runs' median throughput by Little's law: requests in flight over the mean ITL (tokens per emulated
    second). Every point recorded both, and neither depends on where the window's two scrapes fell on a lock-step
    deployment's staircase counter (fit_over_two_scrapes). It counts a request waiting for its first token as
    producing (~1 % high at ~100 tokens a request). Within 1.1 % of the counter's least-squares slope on 27 of the
    first 31 points with both; on the other 4 the counter is too coarse to tell (7–8 steps, or 20 uneven ones,
    scraped 4 times an ITL: where the steps fell is known only to ±10 %), while the ITL histogram times every
    token (experiments/2026-11-25-plan-table-full-depth). None if no run recorded both."""
    rates = [
        r["running_mean"] / (r["itl_ms"] / 1e3) for r in runs if r.get("itl_ms") and r.get("running_mean")
    ]
    return statistics.median(rates) if rates else None


def fit_over_two_scrapes(points: dict[str, dict]) -> dict[str, list[float]]:
    """Per mode, each measured run's least-squares throughput over its two-scrape one (amoe.perf.studies.point
    token_rate_fit), for the runs that recorded both: how far the table's reading of a lock-step deployment's
    staircase counter is off."""
    out: dict[str, list[float]] = {}
    for result in points.values():
        for run in result.get("runs", []):
            if run.get("throughput_fit") and run.get("throughput"):
                out.setdefault(result["plan"].split()[0], []).append(
                    round(run["throughput_fit"] / run["throughput"], 3)
                )
    return {mode: sorted(v) for mode, v in sorted(out.items())}


async def measure_plan(
    profile: str, top_k: int, routing: str, plan: Plan, base_scale: float, probe_s: float, measured: Measured,
    run: bool = True, tag: str = "",
) -> dict | None:  # fmt: skip
    """One copy's plan run on the emulated runtime at full depth (plan_check's steady point), or its
    earlier run from `measured` (None: not measured, and `measured` or `run` runs nothing). `tag` keeps a point
    apart from the plan's others (a close call's runs)."""
    key = Measured.key(profile, top_k, routing, plan, measured.step_variance, measured.aep_policy) + tag
    if key not in measured.points and measured.run and run:
        blocks = bounds.full_depth(model_profile(profile)).num_blocks
        preset = dataclasses.replace(
            plan_check.PRESETS["depth"], checks=(), blocks=blocks, step_variance=measured.step_variance,
            aep_policy=measured.aep_policy,
        )  # fmt: skip
        check = plan_check.Check(profile, top_k, plan.deployment, plan.prediction.concurrency, routing)
        got = await plan_check.run_check(check, preset, base_scale, probe_s, repeats=1, plan=plan)
        measured.put(key, got)
    return measured.points.get(key)


def readings(got: dict, replicas: int, predicted: float) -> dict:
    """A measured point's figures for `replicas` copies of it: led by Little's law where its runs recorded it (the
    two scrapes misread a lock-step deployment's staircase counter by up to a step; little_rate), the two-scrape
    figure beside it, and measured over `predicted`."""
    two = got["measured"] * replicas
    little = little_rate(got["runs"])
    value = little * replicas if little is not None else two
    return {
        "measured": round(value), "measured_by": "little" if little is not None else "two scrapes",
        "measured_two_scrapes": round(two), "measured_over_predicted": round(value / predicted, 3),
    }  # fmt: skip


# A close call: a row whose two best measured modes are within the simulation's resolution of each other
# (plan.RESOLUTION). One run at the table's time scale cannot order them: two runs of one plan differ by up to 2 %
# there, and on eight emulated runtimes AEP's measured 2-3 % under its simulation at scale ~64 and at it at 2.5x
# that (experiments/2026-11-28-headroom). So every mode of the row runs CLOSE_CALL_RUNS more times, in turn within each
# run, at CLOSE_CALL_SCALE times the time scale (the host's own delays that much smaller against every emulated
# step), and the row reads the means. The rule was written down before the runs that first applied it
# (experiments/2026-11-28-close-call/RULE.md), then coded as it stands.
CLOSE_CALL_SCALE = 2.5
CLOSE_CALL_RUNS = 3


def _read_mode(entry: dict, points: list[dict], itl_slo_ms: float | None) -> None:
    """A mode's measured figures from its points (one, or a close call's): the mean of each point's reading, the
    mean of each point's median ITL, every run kept."""
    read = [readings(p, entry["deployment"]["replicas"], entry["tokens_per_s"]) for p in points]
    value = statistics.mean(r["measured"] for r in read)
    itls = [
        statistics.median(i) for p in points if (i := [r["itl_ms"] for r in p["runs"] if r.get("itl_ms")])
    ]
    entry.update(
        measured=round(value), measured_by=read[0]["measured_by"],
        measured_two_scrapes=round(statistics.mean(r["measured_two_scrapes"] for r in read)),
        measured_over_predicted=round(value / entry["tokens_per_s"], 3),
        measured_fraction_of_bound=round(value / entry["bound"], 3) if entry["bound"] else None,
        measured_itl_ms=round(statistics.mean(itls), 1) if itls else None,
        measured_runs=[r for p in points for r in p["runs"]],
    )  # fmt: skip
    if itl_slo_ms is not None and itls:
        entry["measured_meets_itl_slo"] = entry["measured_itl_ms"] <= itl_slo_ms


def _compare(row: dict, modes: list[str], itl_slo_ms: float | None) -> None:
    """The row's measured ratios and picks from its modes' measured figures."""
    if all("measured" in row.get(m, {}) for m in ("aep", "ep")):
        aep, ep = row["aep"], row["ep"]
        row["measured_aep_over_ep"] = round(aep["measured"] / ep["measured"], 3)
        row["measured_of_bounds_ratio"] = round(row["measured_aep_over_ep"] / row["bounds_aep_over_ep"], 3)
        two_scrapes = aep["measured_two_scrapes"] / ep["measured_two_scrapes"]
        row["measured_two_scrapes_of_bounds_ratio"] = round(two_scrapes / row["bounds_aep_over_ep"], 3)
    if all("measured" in row[m] for m in modes):
        row["measured_pick"] = max(modes, key=lambda m: row[m]["measured"])
        # the best of the plans whose measured ITL meets the objective (None: none does)
        if itl_slo_ms is not None:
            within = [m for m in modes if row[m].get("measured_meets_itl_slo")]
            row["measured_pick_within_slo"] = (
                max(within, key=lambda m: row[m]["measured"]) if within else None
            )


def is_close_call(row: dict, modes: list[str]) -> bool:
    values = sorted((row[m]["measured"] for m in modes), reverse=True)
    return len(values) > 1 and values[1] >= (1 - RESOLUTION) * values[0]


async def measure_row(
    row: dict, profile: str, base_scale: float, probe_s: float, measured: Measured, run_modes=MODES,
    itl_slo_ms: float | None = None,
) -> None:  # fmt: skip
    """Each mode's plan of the row, one copy on the emulated runtime at full depth, its measured throughput times
    the copies and its measured ITL (the runs' median mean ITL, emulated ms; against `itl_slo_ms`), beside the
    prediction. Modes not in `run_modes` are only read from `measured`. A close call (above) is measured again
    once every mode has its point, when the row is run at all."""
    modes = [m for m in MODES if m in row]

    async def point(mode: str, scale: float, run: bool, tag: str = "") -> dict | None:
        plan = one_copy(row[mode])
        return await measure_plan(
            profile, row["top_k"], row["routing"], plan, scale, probe_s, measured, run=run, tag=tag
        )

    for mode in modes:
        got = await point(mode, base_scale, mode in run_modes)
        if got is not None:
            _read_mode(row[mode], [got], itl_slo_ms)
    _compare(row, modes, itl_slo_ms)
    if "measured_pick" not in row or not is_close_call(row, modes):
        return
    again: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(CLOSE_CALL_RUNS):
        for mode in modes:
            tag = f" close call {i + 1} at x{CLOSE_CALL_SCALE:g}"
            got = await point(mode, base_scale * CLOSE_CALL_SCALE, bool(run_modes), tag)
            if got is None:  # not run here (the row was not chosen) and not in the file
                row["close_call"] = {"runs": 0, "pick_at_table_scale": row["measured_pick"]}
                return
            again[mode].append(got)
    row["close_call"] = {
        "runs": CLOSE_CALL_RUNS, "time_scale_factor": CLOSE_CALL_SCALE, "pick_at_table_scale": row["measured_pick"],
        "at_table_scale": {m: row[m]["measured"] for m in modes},
        "each_run": {m: [readings(p, row[m]["deployment"]["replicas"], 1.0)["measured"] for p in again[m]]
                     for m in modes},
    }  # fmt: skip
    for mode in modes:
        _read_mode(row[mode], again[mode], itl_slo_ms)
    _compare(row, modes, itl_slo_ms)


FIGURE10_PROFILE = "mixtral-8x7b-16e"


def figure10(
    gpu: str,
    routing: str,
    workload: str = "short",
    measure: tuple | None = None,
    policy: str = DEFAULT_POLICY,
) -> dict:
    """The paper's Figure 10 setup at full depth (32 blocks): the 16-expert model on one 8-GPU host and on two
    (16 GPUs, links between hosts on the critical path), AEP 4 + 4 → 8 + 8 and EP 8 → 16, each refined by the
    simulation: AEP's scaling and AEP / EP on 16, against the paper's 1.92× and 3× (over SGLang). With `measure`
    (base scale, probe seconds, Measured) each also runs on the emulated runtime, and the ratios are given on the
    measured throughputs too."""
    from amoe.perf.model.hosts import host_overhead
    from amoe.perf.model.workloads import mean_context
    from amoe.perf.plan.refine import refine

    model = bounds.full_depth(model_profile(FIGURE10_PROFILE, 1))
    ctx, host = mean_context(workload), host_overhead("amoe-paper")
    deployments = {
        "aep8": Deployment("aep", gpu, 4, gpu, 4),
        "aep16": Deployment("aep", gpu, 8, gpu, 8),
        "ep8": Deployment("ep", gpu, 8),
        "ep16": Deployment("ep", gpu, 16),
    }
    got = {}
    for name, dep in deployments.items():
        plan = refine(model, dep, routing, ctx, host, policy=policy)
        pred = plan.prediction
        got[name] = {"plan": describe(dep), "tokens_per_s": round(pred.tokens_per_s),
                     "bound": round(pred.extra.get("bound", pred.tokens_per_s)), "itl_ms": round(pred.itl_s * 1e3, 1),
                     "concurrency": pred.concurrency}  # fmt: skip
        if measure:
            m = asyncio.run(measure_plan(FIGURE10_PROFILE, 1, routing, plan, *measure))
            got[name].update(readings(m, 1, pred.tokens_per_s), runs=m["runs"])
    out = {"gpu": gpu, "routing": routing, **got, "paper": {"aep_16_over_8": 1.92, "aep_over_sglang_16": 3.0}}
    for prefix, field in (
        ("", "tokens_per_s"),
        ("measured_", "measured"),
        ("measured_two_scrapes_", "measured_two_scrapes"),
    ):
        if all(field in v for v in got.values()):
            t = {k: v[field] for k, v in got.items()}
            out |= {
                f"{prefix}aep_16_over_8": round(t["aep16"] / t["aep8"], 3),
                f"{prefix}ep_16_over_8": round(t["ep16"] / t["ep8"], 3),
                f"{prefix}aep_over_ep_16": round(t["aep16"] / t["ep16"], 3),
                f"{prefix}aep_over_ep_8": round(t["aep8"] / t["ep8"], 3),
            }  # fmt: skip
    return out


def _k(x: int) -> str:
    return f"{x / 1000:.1f} k"


def _measured(row: dict, key: str) -> str:
    return f" (measured {row[key]})" if key in row else ""


def _two_scrapes(row: dict) -> str:
    key = "measured_two_scrapes_of_bounds_ratio"
    return f" (two scrapes {row[key]})" if key in row else ""


def markdown(rows: list[dict]) -> str:
    head = (
        "| GPUs | top-k | routing | pick | AEP plan | AEP tok/s (of bound) | EP plan | EP tok/s (of bound) "
        "| ping-pong tok/s (of bound) | AEP / EP | bounds' AEP / EP | AEP / EP of bounds' |"
    )
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        aep, ep, pp = r.get("aep", {}), r.get("ep", {}), r.get("pingpong", {})

        def tps(m: dict) -> str:
            if not m:
                return "–"
            text = f"{_k(m['tokens_per_s'])} ({m['fraction_of_bound']:.2f})"
            if not m.get("simulated"):
                text += " bound only"
            if "measured" in m:  # --measure
                text += f", measured {_k(m['measured'])} ({m['measured_fraction_of_bound']:.2f})"
                if m.get("measured_itl_ms") is not None:
                    text += f" at {m['measured_itl_ms']:g} ms" + (
                        "" if m.get("measured_meets_itl_slo", True) else " ✗"
                    )
            return text

        lines.append(
            f"| {r['gpus']}× {r['gpu']} | {r['top_k']} | {r['routing']} | **{r['pick']}** | {aep.get('plan', '–')} "
            f"| {tps(aep)} | {ep.get('plan', '–')} | {tps(ep)} | {tps(pp)} "
            f"| {r.get('aep_over_ep', '–')}{_measured(r, 'measured_aep_over_ep')} | {r.get('bounds_aep_over_ep', '–')} "
            f"| {r.get('of_bounds_ratio', '–')}{_measured(r, 'measured_of_bounds_ratio')}{_two_scrapes(r)} |"
        )
    return "\n".join(lines)


def _row_indices(text: str | None, count: int) -> set[int]:
    """--measure-rows "0,2" → {0, 2} (indices into the table's rows, in its order); None: every row."""
    if not text:
        return set(range(count))
    try:
        chosen = {int(i) for i in text.split(",")}
    except ValueError:
        raise ConfigError(f"--measure-rows takes row indices, e.g. 0,2; got {text!r}") from None
    if not chosen <= set(range(count)):
        raise ConfigError(f"--measure-rows: the table has rows 0-{count - 1}; got {text!r}")
    return chosen


def main(args) -> int:
    """`amoe bench plan-table` (its flags: amoe.perf.studies.commands)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape otherwise
    started = time.monotonic()
    routings = args.routings.split(";") if args.routings else list(ROUTINGS)
    policy = check_policy(getattr(args, "aep_policy", DEFAULT_POLICY))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measure = _measurement(args, out, policy) if args.measure else None
    if args.figure10:
        for routing in routings:
            print(
                json.dumps(figure10(args.gpus.split(",")[0], routing, measure=measure, policy=policy)),
                flush=True,
            )
        return 0
    if args.plans:
        rows = json.loads(Path(args.plans).read_text())["rows"]
    else:
        grid = itertools.product(
            args.gpus.split(","), [int(s) for s in args.sizes.split(",")], [int(s) for s in args.top_k.split(",")],
            routings, [args.profile], [args.itl_slo_ms], [args.step_variance], [policy],
        )  # fmt: skip
        # Each cell is one process's simulations (pure Python, one core); the rows come back in the grid's order.
        with ProcessPoolExecutor(max(1, args.jobs)) as pool:
            rows = list(pool.map(cell, *zip(*grid)))
    if measure:
        _measure_rows(args, rows, measure)
    for row in rows:
        print(json.dumps(row), flush=True)
    print(markdown(rows))
    picks = {m: sum(r["pick"] == m for r in rows) for m in ("aep", "ep", "pingpong")}
    ratios = [r["of_bounds_ratio"] for r in rows if "of_bounds_ratio" in r]
    summary = {
        "profile": args.profile, "cells": len(rows), "picks": picks,
        "aep_fraction_of_bound": sorted(r["aep"]["fraction_of_bound"] for r in rows if "aep" in r),
        "aep_over_ep_of_bounds_min_max": [min(ratios), max(ratios)] if ratios else None,
        "itl_slo_ms": args.itl_slo_ms, "step_variance": args.step_variance, "aep_policy": policy,
        "wall_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
    if args.measure:
        summary.update(_measured_summary(rows, measure[2]))
    (out / "plan_table.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


def _measurement(args: argparse.Namespace, out: Path, policy: str) -> tuple[float, float, Measured]:
    """--measure: the base time scale (scaled by the host probe when it runs anything), the probe, and the file of
    measured points."""
    from amoe.perf.studies import calibrate

    measured = Measured(out / "measured.jsonl", run=not args.report_measured)
    measured.step_variance = args.step_variance
    measured.aep_policy = policy
    base = getattr(args, "time_scale", 40.0)
    if not base > 0:
        raise ConfigError(f"--time-scale must be positive; got {base:g}")
    return (*(calibrate.scaled(base) if measured.run else (base, 0.0)), measured)


def _measure_rows(args: argparse.Namespace, rows: list[dict], measure: tuple[float, float, Measured]) -> None:
    """Measure the rows' plans (measure_row), the sourced skew's rows first, then the stress case, then affinity:
    an interrupted run has the most telling part (the points are kept; a rerun measures only what is missing)."""
    order = sorted(rows, key=lambda r: ({ROUTINGS[0]: 0, ROUTINGS[2]: 1}.get(r["routing"], 2), rows.index(r)))
    run_modes = tuple((getattr(args, "measure_modes", None) or ",".join(MODES)).split(","))
    bad = set(run_modes) - set(MODES)
    if bad:
        raise ConfigError(f"--measure-modes takes {', '.join(MODES)}; got {', '.join(sorted(bad))}")
    chosen = _row_indices(getattr(args, "measure_rows", None), len(rows))
    for row in order:
        here = run_modes if rows.index(row) in chosen else ()
        asyncio.run(measure_row(row, args.profile, *measure, run_modes=here, itl_slo_ms=args.itl_slo_ms))
        print(json.dumps({k: v for k, v in row.items() if k not in ("aep", "ep", "pingpong")}), flush=True)


def _measured_summary(rows: list[dict], measured: Measured) -> dict:
    """The summary's measured part: picks, ITLs, measured over predicted, the goals, the close calls."""
    done = [r for r in rows if "measured_pick" in r]
    aep = [r["aep"]["measured_fraction_of_bound"] for r in rows if "measured" in r.get("aep", {})]
    of_bounds = [r["measured_of_bounds_ratio"] for r in rows if "measured_of_bounds_ratio" in r]
    two = [
        r["measured_two_scrapes_of_bounds_ratio"] for r in rows if "measured_two_scrapes_of_bounds_ratio" in r
    ]
    return dict(
        measured_cells=len(done), measured_picks_agree=sum(r["measured_pick"] == r["pick"] for r in done),
        measured_picks={m: sum(r["measured_pick"] == m for r in done) for m in ("aep", "ep", "pingpong")},
        measured_picks_within_slo_agree=sum(r.get("measured_pick_within_slo") == r["pick"] for r in done),
        measured_itl_ms={f"{r['gpu']} top{r['top_k']} {m}": r[m].get("measured_itl_ms") for r in rows
                         for m in MODES if "measured" in r.get(m, {})},
        measured_itl_misses_slo=sum(not r[m].get("measured_meets_itl_slo", True) for r in rows for m in MODES
                                    if "measured" in r.get(m, {})),
        measured_over_predicted=sorted(
            r[m]["measured_over_predicted"] for r in rows for m in ("aep", "ep", "pingpong")
            if "measured" in r.get(m, {})
        ),
        # The goals: AEP at >= 0.85 of its bound, AEP / EP at >= 0.95 of the bounds' AEP / EP.
        measured_aep_at_085_of_bound=f"{sum(f >= 0.85 for f in aep)} of {len(aep)}",
        measured_aep_over_ep_at_095_of_bounds=f"{sum(f >= 0.95 for f in of_bounds)} of {len(of_bounds)}",
        fit_over_two_scrapes=fit_over_two_scrapes(measured.points),
        measured_of_bounds_ratio=sorted(of_bounds),
        measured_by={b: sum(r[m].get("measured_by") == b for r in rows for m in ("aep", "ep", "pingpong")
                         if "measured" in r.get(m, {})) for b in ("little", "two scrapes")},
        two_scrapes_aep_over_ep_at_095_of_bounds=f"{sum(f >= 0.95 for f in two)} of {len(two)}",
        # rows decided again as close calls (measure_row): the pick at the table's time scale and after
        measured_close_calls={f"{r['gpu']} top{r['top_k']} {r['routing']}": [
            r["close_call"]["pick_at_table_scale"], r["measured_pick"] if r["close_call"]["runs"] else None]
            for r in rows if "close_call" in r},
    )  # fmt: skip
