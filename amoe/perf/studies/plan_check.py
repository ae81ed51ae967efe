"""Does the emulated runtime reach what the planner predicts? Each plan's predicted throughput (amoe.perf.plan.search,
what `amoe plan` ranks by) against the maximum the emulated runtime measures when it runs that plan's `amoe serve`
config. The emulated executor holds each step for the cost model's time, so this checks the runtime's
queueing, batching and scheduling against the simulation's, not the cost model against a GPU (docs/emulation.md).

    amoe bench plan-check [--preset full|depth|ci] [--repeats N] [--only ep,pingpong] [--match S] [--out DIR]

For every plan: start the emulated deployment the plan's config describes (`amoe.perf.plan.serving.plan_config`, emulated), run it
at the plan's concurrency and measure output tokens per emulated second in steady state. By default the deployment
starts in that steady state (amoe.perf.studies.steady: the plan's requests as a running deployment holds them, a closed
load, measured over ITLs; about 15 ITLs a point); `--fill poisson` instead offers Poisson arrivals above the
predicted rate until admission holds the plan at its concurrency (~80 ITLs a point; both agree within 2 % on the
full preset, experiments/2026-11-25-plan-check-full). The time scale is the preset's,
stretched by a host probe (amoe.perf.studies.calibrate) so host work is the same fraction of each emulated step on any
machine; a point whose server saturated the host's CPU is marked and rerun at twice the time scale. With
--repeats N each plan runs N times and reports the median and spread.

Prints a table and one final JSON line; writes plan_check.json to --out. Exits 1 when a plan's median is further than
the preset's tolerance from its prediction. Profiles keep --blocks of the model's blocks (the bounds at that depth:
a truncated profile pays its share of the head, so the prediction is the full model's scaled, docs/simulation.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from amoe.config import DEFAULT_POLICY, AmoeConfig
from amoe.errors import ConfigError
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import DEFAULT_LAMBDA
from amoe.perf.model.variance import StepVariance
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan.deployment import Deployment, describe
from amoe.perf.plan.refine import refine
from amoe.perf.plan.request import Plan, PlanRequest, check_policy
from amoe.perf.plan.serving import plan_config
from amoe.perf.studies import calibrate, steady
from amoe.perf.studies.compare import load_point
from amoe.perf.studies.compare_setup import Preset, Setup, load_settings, mean_output_tokens
from amoe.testing.servers import ServerProcess

logger = logging.getLogger("plan_check")

ROUTING = f"skew-exp:{DEFAULT_LAMBDA:g}"
# The scale32 preset's time scale on the reference host (stretched by the host probe, as every preset's is). Its
# plan runs ~81 k runtime steps per emulated second (16 attention GPUs × 4 waves × 5 steps, 16 expert GPUs × ~16
# grouped steps, per 7.07 ms ITL) and each attention step fans out to 16 expert GPUs: at ~1 ms of host CPU per step
# with its messages that is ~80 CPU-s per emulated second, against ~10 for the 8-GPU presets' plans at their
# scale of 40. 400 keeps the runtimes at ~0.2 of a core and leaves the coordinator and the 4,096-request load
# generator the rest (experiments/2026-11-27-plan-check-32-runtimes: the measured host cores).
SCALE32_TIME_SCALE = 400.0


@dataclass(frozen=True)
class Check:
    """One plan to check: a deployment of a profile at a top-k."""

    profile: str
    top_k: int
    deployment: Deployment
    concurrency: int | None = None  # requests in flight (AEP); None: the plan's own (amoe.perf.plan.refine)
    routing: str = ROUTING


def _aep(
    gpu, a, e, top_k, profile="mixtral-8x7b-mqa", cap=256, ecap=512, concurrency=None, expert_gpu=None,
    routing=ROUTING,
):  # fmt: skip
    dep = Deployment("aep", gpu, a, expert_gpu or gpu, e, attn_cap=cap, expert_cap=ecap)
    return Check(profile, top_k, dep, concurrency, routing)


def _ep(gpu, n, top_k, profile="mixtral-8x7b-mqa", cap=256):
    return Check(profile, top_k, Deployment("ep", gpu, n, attn_cap=cap))


def _pingpong(gpu, a, e, m, top_k, profile="mixtral-8x7b-mqa", cap=256):
    return Check(profile, top_k, Deployment("pingpong", gpu, a, gpu, e, attn_cap=cap, micro_batches=m))


@dataclass(frozen=True)
class CheckPreset:
    checks: tuple[Check, ...]
    blocks: int  # blocks of each profile kept (the emulated runtimes' depth and the prediction's)
    duration_s: float  # emulated seconds of arrivals per point
    time_scale: float  # on the reference host (calibrate.REFERENCE_PROBE_S); stretched by the probe
    overload: float  # offered rate over the predicted one (--fill poisson)
    tolerance: float  # |measured / predicted - 1| allowed
    min_window_s: float = steady.MIN_WINDOW_WALL_S  # wall seconds a steady point is measured over, at least
    # The emulated GPUs' step-time variance (amoe.perf.model.variance), in the runs and in the prediction.
    step_variance: str = "sourced"
    # The scheduling policy of the AEP plans, in the runs (`--scheduler`) and in the prediction (`amoe plan`'s).
    aep_policy: str = DEFAULT_POLICY


PRESETS = {
    # AEP splits (one heterogeneous), EP, ping-pong; A100 and H100; top-1 and top-2: at least six
    # diverse plans.
    "full": CheckPreset(
        checks=(
            _aep("a100-80g", 4, 4, 1),
            _aep("h100", 3, 5, 2),
            _aep("a100-80g", 2, 6, 2),
            _aep("a100-80g", 3, 3, 2, expert_gpu="h100"),  # heterogeneous: experts on the faster GPU
            _ep("a100-80g", 8, 1),
            _ep("h100", 4, 2),
            _pingpong("a100-80g", 4, 4, 2, 1),
            _pingpong("h100", 2, 2, 3, 2),
        ),
        blocks=4, duration_s=1.0, time_scale=40.0, overload=2.0, tolerance=0.10,
    ),
    # At the profiles' full depth (32 blocks): three plans, AEP at a fixed 256 requests per attention GPU, where its
    # batches stay small (the simulation's hardest case: waves; at its own concurrency an AEP plan's steps are
    # near their caps, and `amoe bench plan-table` --measure runs those at this preset's settings). It checks, at 32
    # blocks, the simulation behind the planner's full-depth table (experiments/2026-11-25-plan-check-depth).
    "depth": CheckPreset(
        checks=(
            _ep("h100", 2, 2, cap=128),
            _aep("a100-80g", 4, 4, 1, cap=64, ecap=256, concurrency=1024),
            _pingpong("h100", 2, 2, 3, 2, cap=64),
        ),
        blocks=32, duration_s=1.0, time_scale=40.0, overload=3.0, tolerance=0.10,
    ),
    # What step-time variance costs a barrier and a queue (experiments/2026-11-26-step-variance-plan-check): AEP 4 + 4 and EP 8
    # on A100s, whose bounds without variance are equal at top-1 (same throughput and ITL) and 1.01 apart at top-2,
    # run once with --step-variance sourced and once with off.
    "variance": CheckPreset(
        checks=(
            _aep("a100-80g", 4, 4, 1),
            _ep("a100-80g", 8, 1),
            _aep("a100-80g", 4, 4, 2),
            _ep("a100-80g", 8, 2),
        ),
        blocks=4, duration_s=1.0, time_scale=40.0, overload=2.0, tolerance=0.10,
    ),
    # One frontier-class plan at 32 emulated runtimes, where the simulation runs at scale
    # (amoe.perf.plan.simulate.scale: counts per expert, the attention GPUs on one timeline, AEP in waves) and the
    # runtime's queues, batching and 16-way fan-out are the real ones. Chosen before any run
    # (experiments/2026-11-27-plan-check-32-runtimes): DeepSeek-V3 (256 experts top-8, FP8) at 4 of its 58 MoE
    # blocks on H800s; AEP, the mode the simulation is least sure of; A = E = 16, so no expert GPU receives more
    # than an attention GPU sends; attention cap 64 and 256 requests per attention GPU (4 waves), where the bound
    # and the simulation are attention-bound with the links idle a third of the time or more: the runtime prices a
    # message on its (sender, receiver) pair, the simulation on both ends' shared NICs, and the simulation predicts
    # the same figure over NVLink as over the NICs (so the difference does not bind). λ scaled to 256 experts as
    # amoe bench frontier does (0.08 · 8 / 256).
    "scale32": CheckPreset(
        checks=(
            _aep("h800", 16, 16, 8, profile="deepseek-v3", cap=64, ecap=1024, concurrency=4096,
                 routing="skew-exp:0.0025"),
        ),
        blocks=4, duration_s=1.0, time_scale=SCALE32_TIME_SCALE, overload=2.0, tolerance=0.10,
    ),
    # `make test` runs this one (tests/test_plan_check.py): two small plans, one AEP and one EP, ~35 s here.
    "ci": CheckPreset(
        checks=(_aep("a100-80g", 2, 2, 1, cap=64), _ep("a100-80g", 2, 2, cap=64)),
        blocks=2, duration_s=0.4, time_scale=40.0, overload=3.0, tolerance=0.15, min_window_s=10.0,
    ),
}  # fmt: skip


# The out-of-sample preset's plans are drawn, not chosen: `sample_checks(seed)` with the seed given on the command
# line (a fresh one for each recorded run), against constants frozen before the draw (tests/test_no_fitted_constants.py).
SAMPLE = CheckPreset(checks=(), blocks=4, duration_s=1.0, time_scale=40.0, overload=2.0, tolerance=0.10)


def sample_checks(seed: int, n: int = 8) -> tuple[Check, ...]:
    """`n` plans drawn by a seeded generator: GPU type, top-k, mode, split (AEP: attention + expert GPUs of 8;
    EP: 2, 4 or 8 devices; ping-pong: 2-4 + 2-4 GPUs, 2 or 3 micro-batches). One copy each: copies multiply a
    plan's throughput exactly in the model, so the check is of one."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        gpu, top_k = rng.choice(("a100-80g", "h100")), rng.choice((1, 2))
        mode = rng.choice(("aep", "aep", "ep", "pingpong"))
        if mode == "aep":
            a = rng.randint(2, 6)
            out.append(_aep(gpu, a, 8 - a, top_k))
        elif mode == "ep":
            out.append(_ep(gpu, rng.choice((2, 4, 8)), top_k))
        else:
            out.append(_pingpong(gpu, rng.randint(2, 4), rng.randint(2, 4), rng.choice((2, 3)), top_k))
    return tuple(out)


def prediction(check: Check, p: CheckPreset, workload: str = "short") -> Plan:
    """What `amoe plan` predicts for the check's deployment: the bound, refined by the simulation at the
    concurrency the plan runs at, as the planner refines its best candidates."""
    model = model_profile(f"{check.profile}:{p.blocks}", check.top_k)
    host = host_overhead("amoe-paper")
    return refine(
        model, check.deployment, check.routing, mean_context(workload), host, concurrency=check.concurrency,
        variance=StepVariance.parse(p.step_variance), policy=p.aep_policy,
    )  # fmt: skip


def serve_config(check: Check, plan: Plan, p: CheckPreset, time_scale: float) -> AmoeConfig:
    """The plan's emulated config (what `amoe plan --out FILE --emulated` writes), at this run's time scale."""
    req = PlanRequest(
        f"{check.profile}:{p.blocks}",
        {check.deployment.attn_gpu: 8},
        top_k=check.top_k,
        routing=check.routing,
        step_variance=p.step_variance,
        aep_policy=p.aep_policy,
    )
    config = plan_config(plan, req, emulated=True)
    return config.replace(emulation={"time_scale": time_scale}, **load_settings(time_scale))


# Wall seconds a runtime's start-up may take on a busy host: each imports torch and the runtime (2.3 CPU-s measured
# here), so 32 runtimes need ~75 CPU-s of a 2-core host's, past the harness's default 180 s when other work shares
# it. The coordinator's own limit (300 s, coordinator.cluster) names a runtime that never came up.
STARTUP_S_PER_RUNTIME = 10.0


def startup_timeout_s(d: Deployment) -> float:
    """How long the harness waits for the plan's server to listen: ServerProcess's default, or 10 s a runtime."""
    return max(180.0, STARTUP_S_PER_RUNTIME * (d.num_attn + d.num_expert))


async def measure(check: Check, plan: Plan, p: CheckPreset, time_scale: float, seed: int, fill: str) -> dict:
    """One run of the plan at its concurrency (one copy's share of the prediction's). `steady` (the default): that
    many steady-state requests, measured over ITLs (amoe.perf.studies.steady); `poisson`: arrivals at `overload` × the
    predicted rate until admission holds the plan at its concurrency, measured over the last 40 % of a point about
    a request lifetime long (amoe.perf.studies.compare; ~5× the wall time)."""
    d = check.deployment
    # the point's name in the logs and its workload (the server runs the plan's config: serve_config)
    setup = Setup(d, policy=p.aep_policy, top_k=check.top_k, profile=check.profile)
    pred = plan.prediction
    # Arrivals fill the plan's concurrency in ITL × tokens per request / overload; the measured window (the last
    # 40 % of the point) opens well after that.
    fill_s = pred.itl_s * mean_output_tokens(setup.workload) / p.overload
    preset = Preset(
        sweeps=(setup,), loads=(p.overload,), policy_load=None, policy_base=None,
        duration_s=max(p.duration_s, 2.5 * fill_s),
        time_scale=time_scale, attn_cap=d.attn_cap, expert_cap=d.expert_cap, blocks=p.blocks,
    )  # fmt: skip
    server = ServerProcess(serve_config(check, plan, p, time_scale), startup_timeout_s=startup_timeout_s(d))
    with server:
        try:
            if fill == "steady":
                per_copy = pred.concurrency // d.replicas
                return await steady.steady_point(
                    server, setup, preset, seed, per_copy, pred.itl_s, "plan", p.min_window_s
                )
            rate = p.overload * pred.tokens_per_s / mean_output_tokens(setup.workload)
            return await load_point(server, setup, preset, seed, rate, "plan")
        except Exception:
            tail = "\n".join(list(server.lines)[-40:])
            logger.error("[plan_check] %s failed; the server's last lines:\n%s", describe(d), tail)
            raise


async def run_check(
    check: Check,
    p: CheckPreset,
    base_scale: float,
    probe_s: float,
    repeats: int,
    fill: str = "steady",
    plan: Plan | None = None,
) -> dict:
    """The check's plan (its prediction, or `plan` as predicted elsewhere) run `repeats` times: the median."""
    plan = plan or prediction(check, p)
    start_scale = calibrate.plan_time_scale(base_scale, probe_s, plan.prediction.tokens_per_s)
    runs = []
    for i in range(repeats):
        scale = start_scale
        for attempt in range(2):
            point = await measure(check, plan, p, scale, seed=i, fill=fill)
            hot = calibrate.saturated(point.get("host_cores"))
            runs.append({"time_scale": scale, "throughput": point["throughput"],
                         "throughput_fit": point.get("throughput_fit"), "host_cores": point["host_cores"],
                         "saturated": hot, "itl_ms": point["itl_ms_mean"], "rerun": attempt > 0, "busy": point["busy"],
                         "rows_per_step": point.get("rows_per_step"),
                         "running_mean": point.get("running_mean"), "ttft_ms": point.get("ttft_ms_mean"),
                         "tokens_series": point.get("tokens_series"),
                         # The host's 1-minute load average as the point ended: other work on the cores, which
                         # host_cores (this server's processes) does not count.
                         "load_average": round(os.getloadavg()[0], 2)})  # fmt: skip
            logger.info(
                "[plan_check] %s run %d: %.0f tokens/s measured against %.0f predicted (%.3f) at time scale %g, "
                "%s host cores, load average %.2f", describe(check.deployment), i + 1, point["throughput"],
                plan.prediction.tokens_per_s, point["throughput"] / max(plan.prediction.tokens_per_s, 1e-9), scale,
                point["host_cores"], runs[-1]["load_average"],
            )  # fmt: skip
            if not hot:
                break
            logger.warning("[plan_check] %s saturated the host (%.2f cores): rerun at time scale %g",
                           describe(check.deployment), point["host_cores"], 2 * scale)  # fmt: skip
            scale *= 2
    kept = [r["throughput"] for r in runs if not r["saturated"]] or [r["throughput"] for r in runs]
    measured = statistics.median(kept)
    predicted = plan.prediction.tokens_per_s
    return {
        "plan": describe(check.deployment), "profile": f"{check.profile}:{p.blocks}", "top_k": check.top_k,
        "predicted": round(predicted, 1), "measured": round(measured, 1),
        "ratio": round(measured / predicted, 3) if predicted else None,
        "spread": round((max(kept) - min(kept)) / measured, 3) if measured else None,
        "bound": round(plan.prediction.extra.get("bound", predicted), 1),
        "predicted_itl_ms": round(plan.prediction.itl_s * 1e3, 2), "concurrency": plan.prediction.concurrency,
        "bottleneck": plan.prediction.bottleneck, "runs": runs,
    }  # fmt: skip


async def run(p: CheckPreset, repeats: int, fill: str = "steady") -> tuple[list[dict], dict]:
    base_scale, probe_s = calibrate.scaled(p.time_scale)
    logger.info("[plan_check] host probe %.0f µs per step: time scale %.1f", probe_s * 1e6, base_scale)
    rows = [await run_check(c, p, base_scale, probe_s, repeats, fill) for c in p.checks]
    return rows, {"probe_us": round(probe_s * 1e6, 1), "time_scale": round(base_scale, 2)}


def table(rows: list[dict]) -> str:
    lines = [f"{'plan':<56} {'top':>3} {'predicted':>10} {'measured':>10} {'ratio':>6} {'spread':>6}"]
    for r in rows:
        lines.append(
            f"{r['plan']:<56} {r['top_k']:>3} {r['predicted']:>10.0f} {r['measured']:>10.0f} {r['ratio']:>6.3f} "
            f"{r['spread']:>6.3f}"
        )
    return "\n".join(lines)


def main(args) -> int:
    """`amoe bench plan-check` (its flags: amoe.perf.studies.commands)."""
    if args.preset == "sample":
        if args.seed is None:
            raise ConfigError("--preset sample draws its plans from --seed N: give a seed not used before")
        p = dataclasses.replace(SAMPLE, checks=sample_checks(args.seed))
    else:
        p = PRESETS[args.preset]
    p = dataclasses.replace(
        p, step_variance=getattr(args, "step_variance", "sourced"),
        aep_policy=check_policy(getattr(args, "aep_policy", DEFAULT_POLICY)),
    )  # fmt: skip
    if getattr(args, "time_scale", None) is not None:
        if args.time_scale <= 0:
            raise ConfigError(f"--time-scale must be positive; got {args.time_scale:g}")
        p = dataclasses.replace(p, time_scale=args.time_scale)
    if args.only:
        modes = set(args.only.split(","))
        p = dataclasses.replace(p, checks=tuple(c for c in p.checks if c.deployment.mode in modes))
    if args.match:
        p = dataclasses.replace(p, checks=tuple(c for c in p.checks if args.match in describe(c.deployment)))
    started = time.monotonic()
    rows, host = asyncio.run(run(p, max(1, args.repeats), args.fill))
    within = [r for r in rows if r["ratio"] is not None and abs(r["ratio"] - 1) <= p.tolerance]
    summary = {
        "preset": args.preset, "seed": args.seed, "fill": args.fill, "step_variance": p.step_variance,
        "aep_policy": p.aep_policy,
        "routing": ",".join(sorted({c.routing for c in p.checks})) or ROUTING,  # the checks' own (scale32: λ 0.0025)
        "tolerance": p.tolerance, "plans": len(rows),
        "within": len(within), "ratios": {r["plan"] + f" top{r['top_k']}": r["ratio"] for r in rows}, **host,
        "wall_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan_check.json").write_text(json.dumps({"summary": summary, "plans": rows}, indent=1))
    print(table(rows))
    print(json.dumps(summary))
    return 0 if len(within) == len(rows) else 1
