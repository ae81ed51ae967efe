"""The scheduling policies under Poisson arrivals: each policy's AEP deployment on emulated GPUs, loaded
by an open stream of requests (Poisson arrivals; a finished request's place is taken by the next arrival, none is
resent), at a fraction of the bound's request rate below saturation and at one above it.

    amoe bench policies [--policies defrag,mtfs,flfs,waves] [--blocks 8] [--loads 0.5,1.3] [--repeats 2]
        [--seed S] [--out DIR]

Reports per policy its throughput at its maximum (the overload point: what it sustains while arrivals exceed it,
the load where the paper's Fig. 12 shows first-layer-first falling behind) and its ITL at half load (a rate every
policy sustains), the median over --repeats runs (each with its own arrival and routing seed) and the runs'
spread. Prints a table and one final JSON line; writes policies.json to --out.

Each rank holds at most the requests the planner's prediction of this deployment runs at (`amoe.perf.plan.refine`:
the least concurrency within 3 % of the most it simulates); arrivals beyond wait in the coordinator's queue and
replace requests as they end. Without that cap an overloaded point's requests in flight grew all through it, so
its throughput was read while the deployment was still filling, at a concurrency that depended on the arrivals'
draw: two runs of defrag read 72.7 k and 61.8 k tokens/s (experiments/2026-11-26-policies-poisson). `waves`
is served with the bound's wave group, as `amoe plan` prints it (`wave_group`; it once ran without one, by the
straggler wait and the meeting block, and its half-load ITL did not repeat).

The half-load point (decided 2026-11-27 from its traces, experiments/2026-11-27-policies-half-load-window, before
the runs it was used in). Its ITL is the coordinator's histogram over the window: the mean over every
output token whose interval ended in it, so by Little's law the time-average of the requests in flight over the
arrivals' token rate. The ITL is correlated over 0.15–1.1 emulated seconds, the requests in flight over
0.5–2.2 s (a request lives ~0.9 s), so the old window, the last 40 % of 4 s (1.6 s), held one to a few
independent samples: by batch means its 95 % interval was ±6.6 % of the ITL in one run, ±9 % on two runs'
difference — a 5 % agreement was not inside what it could resolve. Now, the same for every policy:

* the point is HALF_DURATION_S = 5.5 emulated seconds of arrivals (was 4);
* its window opens after HALF_WARMUP_S = 1.5 s, the longest request's lifetime (130 tokens at ~11.5 ms): from then
  on every request in flight arrived inside the point, an M/G/∞ queue's steady state (the requests in flight
  plateaued by 1.0–1.25 s in the traces), so the window is 4 s (2.5× the old) and the warm-up is left out by that
  stated rule, not by a fraction of the span;
* each run's ITL comes with its 95 % interval by batch means over HALF_BATCHES = 4 batches of 1 s (at least the
  correlation time; their lag-1 autocorrelation is reported), and the overload point's throughput by Little's law
  with its own (MAX_BATCHES = 4 of 0.4 s); a spread between runs is reported with its interval (the runs'
  half-widths in quadrature), so it says whether two runs differ by more than their windows can resolve.

The overload point is unchanged (4 s, the last 40 %): its throughput already repeated within 1–3 %.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

from amoe.errors import ConfigError
from amoe.perf.studies import calibrate
from amoe.perf.studies.compare import load_point
from amoe.perf.studies.compare_setup import (
    ROUTING,
    Preset,
    Setup,
    mean_output_tokens,
    profile_name,
    serve_config,
    upper_bound,
)
from amoe.testing.servers import ServerProcess

logger = logging.getLogger(__name__)

# 2 + 2 A100s, top-1, short requests: the smallest AEP deployment with more than one attention rank (so waves of
# two ranks meet at the experts). Caps 64 / 256 keep the host's work per emulated second within one core.
# Named by defrag (the recorded runs' name for it, docs/findings.md); each policy's point replaces it.
SETUP = Setup.of("aep", 2, 2, gpu="a100-80g", policy="defrag", top_k=1, workload="short", group="policies")
HALF = 0.5
# The half-load point (module docstring, "The half-load point"): emulated seconds of arrivals, the warm-up left out
# and the batches its interval is computed over.
HALF_DURATION_S = 5.5
HALF_WARMUP_S = 1.5
HALF_BATCHES = 4
# The overload point's window (the last 40 % of 4 s) in batches of 0.4 s: its interval.
MAX_BATCHES = 4


def _preset(blocks: int, loads: tuple[float, ...], duration_s: float, time_scale: float) -> Preset:
    return Preset(
        sweeps=(SETUP,), loads=loads, policy_load=None, policy_base=None, duration_s=duration_s,
        time_scale=time_scale, attn_cap=64, expert_cap=256, blocks=blocks,
    )  # fmt: skip


def _plan_inputs(p: Preset):
    """The setup's model profile, AEP deployment, host and mean context, as the planner sees them."""
    from amoe.perf.model.hosts import host_overhead
    from amoe.perf.model.models import model_profile
    from amoe.perf.model.workloads import mean_context

    model = model_profile(profile_name(SETUP, p), SETUP.top_k)
    dep = replace(SETUP.deployment, attn_cap=p.attn_cap, expert_cap=p.expert_cap)
    return model, dep, host_overhead("amoe-paper"), mean_context(SETUP.workload)


def max_seqs(p: Preset, step_variance: str = "sourced") -> int:
    """Requests each attention rank holds: the planner's concurrency for this deployment (module docstring)."""
    from amoe.perf.model.variance import StepVariance
    from amoe.perf.plan.refine import refine

    model, dep, host, ctx = _plan_inputs(p)
    # defrag's concurrency, as the recorded runs had it (before the planner simulated AEP with --aep-policy waves):
    # every policy is compared at the same requests.
    plan = refine(model, dep, ROUTING, ctx, host, variance=StepVariance.parse(step_variance), policy="defrag")
    return math.ceil(plan.prediction.concurrency / SETUP.attn)


def wave_group(p: Preset, step_variance: str = "sourced") -> int:
    """The expert side's wave group `waves` is served with: the bound's (docs/scheduler.md "Group cells"), as
    `amoe plan` prints it for this deployment. Without it waves runs the straggler wait and the meeting block,
    which note arrivals per rank and cannot tell a rank's waves apart (the runs in
    experiments/2026-11-27-policies-poisson-repeats)."""
    from amoe.perf.model.routing import routing_inclusion
    from amoe.perf.model.variance import StepVariance
    from amoe.perf.plan import bounds
    from amoe.perf.plan.bound_pools import wave_group as bound_wave_group

    model, dep, host, ctx = _plan_inputs(p)
    inclusion = routing_inclusion(model, ROUTING)
    pred = bounds.predict(model, dep, inclusion, ctx, host, variance=StepVariance.parse(step_variance))
    return bound_wave_group(pred.extra, p.attn_cap)


async def _policy_points(
    policy: str,
    p: Preset,
    seed: int,
    step_variance: str = "sourced",
    seqs: int | None = None,
    half_duration_s: float = HALF_DURATION_S,
    group: int = 0,
) -> list[dict]:
    setup = replace(SETUP, policy=policy)
    rate_ub = upper_bound(setup, p) / mean_output_tokens(setup.workload)  # requests per emulated second
    config = serve_config(setup, p, seed).replace(emulation={"step_variance": step_variance})
    if seqs:
        config = config.replace(cache={"max_num_seqs": seqs})
    if policy == "waves" and group:
        config = config.replace(scheduler={"wave_group": group})
    server = ServerProcess(config)
    with server:
        points = []
        for load in p.loads:
            # The half-load point: longer, measured from HALF_WARMUP_S on (module docstring); the others as before.
            longer = (
                {"duration_s": half_duration_s, "warmup_s": HALF_WARMUP_S, "grace": 0.0}
                if load == HALF
                else {}
            )
            pt = await load_point(
                server, setup, p, seed, load * rate_ub, f"load {load:g}", series=True, **longer
            )
            points.append({**pt, "rate_of_bound": load})
            for line in pt.get("server_warnings") or ():
                logger.warning("[policies] %s load %g: the server warned: %s", policy, load, line)
        return points


def _little(pt: dict) -> float | None:
    """A point's throughput by Little's law: requests in flight over the mean ITL (tokens per emulated second).
    The token counter moves in bursts as the coordinator's event loop gets to the runtimes' outputs, and on a busy
    host a burst inside a short window read 166 k tokens/s where the bound is 86 k; the ITL histogram times every
    token (as amoe.perf.studies.plan_table.little_rate reads the planner's points)."""
    if not pt.get("itl_ms_mean") or not pt.get("running_mean"):
        return None
    return pt["running_mean"] / (pt["itl_ms_mean"] / 1e3)


def not_overloaded(pt: dict) -> bool:
    """A point above the bound's rate whose every arrival was served within the grace after the last one: the
    deployment kept up with more than it can sustain, so the window did not read an overload (two of the
    2026-11-26 runs' overload points: every request done, 75–154 in flight instead of 2,048, an ITL under 1 ms).
    Such a point is reported but not taken as the policy's maximum."""
    return (
        pt.get("rate_of_bound", 0.0) > 1.0 and bool(pt.get("sent")) and pt.get("completed") == pt.get("sent")
    )


def _interval(pt: dict | None, batches: int, little: bool) -> dict:
    """A point's 95 % interval by batch means over its window (amoe.perf.plan.simulate.batch_means): the
    half-width relative to its figure and the batch figures' lag-1 autocorrelation; {} for a point recorded
    without its series or too short for the batches."""
    from amoe.perf.plan.simulate.batch_means import batch_means

    series = (pt or {}).get("series")
    if not series:
        return {}
    try:
        got = batch_means(series, series[0][0], series[-1][0], batches, little=little)
    except ConfigError:
        return {}
    lag1 = got["lag1"]
    return {"ci_rel": round(got["ci_rel"], 4), "lag1": None if lag1 is None else round(lag1, 2)}


def _summary(points: list[dict], loads: tuple[float, ...]) -> dict:
    at = {pt["kind"]: pt for pt in points}
    half = at.get(f"load {HALF:g}")
    top = at.get(f"load {max(loads):g}")
    itl_ci = _interval(half, HALF_BATCHES, little=False)
    tps_ci = _interval(top, MAX_BATCHES, little=True)
    # A run whose overload point did not overload has no maximum to report (None: left out of the median).
    invalid = [pt["kind"] for pt in points if not_overloaded(pt)]
    little = [x for x in map(_little, points) if x is not None]
    return {
        "throughput_little_max": round(max(little)) if little and not invalid else None,
        "throughput_max": None if invalid else round(max(pt["throughput"] for pt in points)),
        "not_overloaded": invalid,
        "server_warnings": sum(len(pt.get("server_warnings") or ()) for pt in points),
        "throughput_little_ci_rel": tps_ci.get("ci_rel"),
        "throughput_little_lag1": tps_ci.get("lag1"),
        "itl_ms_at_half_load": round(half["itl_ms_mean"], 2) if half and half["itl_ms_mean"] else None,
        "itl_ci_rel": itl_ci.get("ci_rel"),
        "itl_lag1": itl_ci.get("lag1"),
        "itl_window_s": half.get("window_s") if half else None,
        "completed_at_max_load": at[f"load {max(loads):g}"]["completed"],
        "saturated": [pt["kind"] for pt in points if pt.get("saturated")],
    }


def report(path: Path) -> dict:
    """A recorded policies.json summarised again from its points (the summary of a run made before a reading was
    added, e.g. Little's law): its summary with every policy's row recomputed."""
    recorded = json.loads(Path(path).read_text())
    loads = tuple(recorded["summary"]["loads"])
    duration_s = recorded["summary"].get("duration_s")
    for rs in recorded["runs"].values():  # runs recorded before points kept their load and arrivals: as sent
        for pt in (pt for r in rs for pt in r["points"]):
            pt.setdefault("rate_of_bound", float(pt["kind"].split()[-1]))
            if duration_s and pt.get("rate"):
                pt.setdefault("sent", max(4, round(pt["rate"] * duration_s)))
    runs = {
        policy: [{"seed": r["seed"], **_summary(r["points"], loads), "points": r["points"]} for r in rs]
        for policy, rs in recorded["runs"].items()
    }
    return {**recorded["summary"], "policies": {policy: _median(r) for policy, r in runs.items()}}


def main(args) -> int:
    """`amoe bench policies` (its flags: amoe.perf.studies.commands)."""
    if getattr(args, "report", None):
        print(json.dumps(report(args.report)))
        return 0
    policies = args.policies.split(",")
    loads = tuple(float(x) for x in args.loads.split(","))
    if HALF not in loads:
        raise ConfigError(f"--loads must include {HALF:g} (the ITL at half load); got {args.loads!r}")
    if not args.half_duration > HALF_WARMUP_S:
        raise ConfigError(
            f"--half-duration must exceed the half-load point's {HALF_WARMUP_S:g} s warm-up; got {args.half_duration}"
        )
    scale, probe_s = calibrate.scaled(args.time_scale)
    p = _preset(args.blocks, loads, args.duration, scale)
    seqs = max_seqs(p, args.step_variance) if args.max_num_seqs is None else args.max_num_seqs
    group = wave_group(p, args.step_variance) if "waves" in policies else 0
    logger.info("[policies] each rank holds at most %d requests; waves' wave group %d", seqs, group)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    started = time.monotonic()
    runs: dict[str, list[dict]] = {policy: [] for policy in policies}
    for i in range(args.repeats):
        seed = args.seed + i
        for policy in policies:  # interleaved, so a change in the host's load falls on every policy alike
            points = asyncio.run(
                _policy_points(policy, p, seed, args.step_variance, seqs or None, args.half_duration, group)
            )
            runs[policy].append({"seed": seed, **_summary(points, loads), "points": _slim(points)})
            logger.info(
                "[policies] %s seed %d: %s",
                policy,
                seed,
                {k: v for k, v in runs[policy][-1].items() if k != "points"},
            )
    rows = {policy: _median(r) for policy, r in runs.items()}
    summary = {
        "setup": SETUP.name.replace("-defrag", ""), "gpu": SETUP.gpu, "blocks": args.blocks, "loads": loads, "repeats": args.repeats, "seed": args.seed, "step_variance": args.step_variance,
        "max_num_seqs_per_rank": seqs, "wave_group": group, "duration_s": args.duration, "half_duration_s": args.half_duration,
        "half_warmup_s": HALF_WARMUP_S, "half_batches": HALF_BATCHES, "max_batches": MAX_BATCHES,
        "time_scale": round(scale, 2), "probe_us": round(probe_s * 1e6, 1), "policies": rows,
        "wall_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policies.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
    print(
        f"{'policy':<8} {'tok/s at max':>13} {'spread':>7} {'by Little':>10} {'spread':>7} {'± 95 %':>7} "
        f"{'ITL ms at half':>15} {'spread':>7} {'± 95 %':>7}"
    )
    for policy, r in rows.items():
        print(
            f"{policy:<8} {r['throughput_max']!s:>13} {r['throughput_spread']!s:>7} {r['throughput_little_max']!s:>10} "
            f"{r['throughput_little_spread']!s:>7} {r['throughput_little_spread_ci']!s:>7} "
            f"{r['itl_ms_at_half_load']!s:>15} {r['itl_spread']!s:>7} {r['itl_spread_ci']!s:>7}"
        )
    print(json.dumps(summary))
    return 0


def _median(runs: list[dict]) -> dict:
    little_runs = [r for r in runs if r.get("throughput_little_max")]
    itl_runs = [r for r in runs if r["itl_ms_at_half_load"]]
    little = [r["throughput_little_max"] for r in little_runs]
    med_little = statistics.median(little) if little else None
    tps = [r["throughput_max"] for r in runs if r["throughput_max"] is not None]
    itl = [r["itl_ms_at_half_load"] for r in runs if r["itl_ms_at_half_load"]]
    med_tps, med_itl = statistics.median(tps) if tps else None, statistics.median(itl) if itl else None
    return {
        "throughput_little_max": round(med_little) if med_little else None, "throughput_little_runs": little,
        "throughput_little_spread": _spread(little),
        "throughput_max": round(med_tps) if med_tps else None, "throughput_runs": tps,
        "throughput_spread": _spread(tps),
        "itl_ms_at_half_load": round(med_itl, 2) if med_itl else None, "itl_runs": itl,
        "itl_spread": _spread(itl),
        # Each run's 95 % interval (relative half-width, batch means) and the spread's: the runs' intervals
        # combined in quadrature over their median (two runs: their difference's interval).
        "throughput_little_ci_runs": [r.get("throughput_little_ci_rel") for r in little_runs],
        "throughput_little_spread_ci": _spread_ci(little, [r.get("throughput_little_ci_rel") for r in little_runs]),
        "itl_ci_runs": [r.get("itl_ci_rel") for r in itl_runs],
        "itl_spread_ci": _spread_ci(itl, [r.get("itl_ci_rel") for r in itl_runs]),
    }  # fmt: skip


def _spread_ci(xs: list[float], rel: list[float | None]) -> float | None:
    """The 95 % half-width of the runs' spread, relative to their median: their own intervals' half-widths in
    quadrature (for two runs, the interval of their difference); None without two runs that have one."""
    if len(xs) < 2 or any(r is None for r in rel):
        return None
    return round(math.sqrt(sum((x * r) ** 2 for x, r in zip(xs, rel))) / statistics.median(xs), 3)


def _spread(xs: list[float]) -> float | None:
    """(max − min) / median over the runs; None with fewer than two (one run agrees with nothing)."""
    return round((max(xs) - min(xs)) / statistics.median(xs), 3) if len(xs) >= 2 else None


def _slim(points: list[dict]) -> list[dict]:
    keep = ("kind", "rate", "throughput", "throughput_fit", "itl_ms_mean", "itl_ms_p90", "ttft_ms_mean", "busy",
            "host_cores", "saturated", "running_mean", "completed", "sent", "rate_of_bound", "server_warnings",
            "window_s", "series")  # fmt: skip
    return [{k: pt.get(k) for k in keep} for pt in points]
