"""`amoe bench barrier-tax`: EP's barrier tax on a request trace, the simulation against the emulated runtime
(docs/simulation.md "The barrier tax"; what counts as agreement: experiments/2026-11-29-barrier-tax/RULES.md).

Every attention rank of an EP deployment reads its own requests' contexts, so their attention steps differ and
every barrier waits for the slowest; the idle fraction is the time ranks wait for a slower peer's step over their
time. For each size the simulation (at scale, on the trace) predicts EP's throughput and idle fraction, and the
same deployment perfectly balanced (every rank the mean load); then the emulated runtime runs it, started in the
same steady state of the trace and fed the trace's requests in arrival order (amoe.perf.studies.steady with the
trace's load), and measures both. Emulated figures are amoe's own cost model's, not a GPU's.

Prints a table and a final JSON line; writes barrier_tax.jsonl to --out. Exits 1 when a size misses the
agreement.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from amoe.config import AmoeConfig
from amoe.errors import ConfigError
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.traces import load_trace
from amoe.perf.model.variance import StepVariance
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.prediction import Prediction
from amoe.perf.plan.request import Plan, PlanRequest
from amoe.perf.plan.serving import plan_config
from amoe.perf.plan.simulate import simulate
from amoe.perf.plan.simulate.trace_loads import initial_requests
from amoe.perf.studies import calibrate, steady
from amoe.perf.studies.compare_setup import Preset, Setup, load_settings
from amoe.perf.studies.plan_check import startup_timeout_s
from amoe.testing.servers import ServerProcess

logger = logging.getLogger(__name__)

TOLERANCE = 0.10  # |measured / simulated - 1| for throughput and idle fraction (RULES.md)
BASE_TIME_SCALE = 400.0  # on the reference host, stretched by the host probe
OVERLOAD = 1.5  # offered arrivals over the rate requests end: the deployment stays saturated
SIM_ITLS = 400  # the simulation's window, in its ITLs
HOST = "amoe-paper"


@dataclass(frozen=True)
class TaxCase:
    """The deployment and workload every size runs (RULES.md)."""

    profile: str = "qwen3-235b-a22b"
    blocks: int = 4
    gpu: str = "h800"
    per_rank: int = 64
    trace: str = "azure-conv"
    routing: str = "skew-exp:0.005"  # the frontier table's λ · 8 / 128 experts
    step_variance: str = "sourced"
    gpus_per_node: int = 16  # one NVLink domain: the exchange priced alike in the runtime and the simulation

    @property
    def model_name(self) -> str:
        return f"{self.profile}:{self.blocks}"

    def deployment(self, n: int) -> Deployment:
        return Deployment("ep", self.gpu, n, attn_cap=self.per_rank, gpus_per_node=self.gpus_per_node)


def predict(case: TaxCase, n: int, seed: int = 0) -> dict:
    """The simulation's figures for EP over `n` GPUs on the trace: throughput, ITL, idle fraction (and its
    attention side), the perfectly balanced deployment's throughput, and the trace's mean context's."""
    model, trace = model_profile(case.model_name), load_trace(case.trace)
    dep, c, ctx = case.deployment(n), n * case.per_rank, trace.mean_decode_context()
    run = functools.partial(
        simulate, model, dep, case.routing, ctx, host_overhead(HOST), c, seed=seed,
        variance=StepVariance.parse(case.step_variance),
    )  # fmt: skip
    itl = run(duration_s=0.01, trace=trace).itl_s
    sim, balanced = (run(duration_s=SIM_ITLS * itl, trace=trace, balanced=b) for b in (False, True))
    mean = run(duration_s=SIM_ITLS * itl)
    return {
        "tokens_per_s": round(sim.tokens_per_s, 1), "itl_ms": round(sim.itl_s * 1e3, 3),
        "barrier_idle": round(sim.barrier_idle, 5), "attention_idle": round(sim.attention_idle, 5),
        "balanced_tokens_per_s": round(balanced.tokens_per_s, 1),
        "tax": round(1 - sim.tokens_per_s / balanced.tokens_per_s, 5),
        "balanced_barrier_idle": round(balanced.barrier_idle, 5),
        "mean_context_tokens_per_s": round(mean.tokens_per_s, 1), "mean_context": round(ctx, 1),
    }  # fmt: skip


def trace_load(
    case: TaxCase, n: int, seed: int, scale: float, tokens_per_s: float, window_itls: int, wall_rate: float
) -> tuple[list, list[float]]:
    """The runtime's requests and wall arrivals: the steady state's first ones (initial_requests, as the
    simulation starts), `wall_rate` a second, then the trace's in arrival order from the simulation's starting
    point, their gaps compressed to OVERLOAD × the rate requests end at `tokens_per_s`."""
    from amoe.bench.workloads import id_requests

    trace, c = load_trace(case.trace), n * case.per_rank
    draw, first = initial_requests(trace, c, seed)
    end_rate = tokens_per_s / float(trace.output_tokens.mean())  # requests ending per emulated second
    itl_wall = c / tokens_per_s * scale
    span_s = (steady.WARMUP_ITLS + window_itls + 4) * itl_wall / scale + c / wall_rate / scale
    more = math.ceil(OVERLOAD * end_rate * span_s) + c // 4
    index = (first + np.arange(more)) % len(trace)
    gaps = np.diff(trace.arrival_s[index], prepend=trace.arrival_s[index[0]])
    gaps[gaps < 0] = 1.0 / trace.rate  # where the trace wraps round
    offsets = np.cumsum(gaps) * trace.rate / (OVERLOAD * end_rate) * scale  # wall seconds
    lengths = list(zip(draw.context.tolist(), draw.left.tolist()))
    lengths += list(zip(trace.input_tokens[index].tolist(), trace.output_tokens[index].tolist()))
    arrivals = (np.arange(c) / wall_rate).tolist() + (c / wall_rate + offsets).tolist()
    return id_requests(lengths, seed=seed), arrivals


def serve_config(case: TaxCase, n: int, pred: dict, scale: float) -> AmoeConfig:
    """The deployment's emulated config (what `amoe plan --out FILE --emulated` writes), at this scale."""
    pred_ = Prediction(pred["tokens_per_s"], pred["itl_ms"] / 1e3, n * case.per_rank, "barrier")
    req = PlanRequest(case.model_name, {case.gpu: n}, routing=case.routing, step_variance=case.step_variance)
    config = plan_config(Plan(case.deployment(n), pred_, None), req, emulated=True)
    return config.replace(emulation={"time_scale": scale}, **load_settings(scale))


async def measure(case: TaxCase, n: int, pred: dict, scale: float, seed: int = 0) -> dict:
    """One run of the deployment on the emulated runtime from the trace's steady state (module docstring)."""
    setup = Setup(case.deployment(n), top_k=model_profile(case.model_name).top_k, profile=case.profile)
    preset = Preset(
        sweeps=(setup,), loads=(1.0,), policy_load=None, policy_base=None, duration_s=1.0, time_scale=scale,
        attn_cap=case.per_rank, expert_cap=512, blocks=case.blocks,
    )  # fmt: skip
    load = functools.partial(trace_load, case, n, seed, scale, pred["tokens_per_s"])
    config = serve_config(case, n, pred, scale)
    server = ServerProcess(config, startup_timeout_s=startup_timeout_s(case.deployment(n)))
    with server:
        point = await steady.steady_point(
            server, setup, preset, seed, n * case.per_rank, pred["itl_ms"] / 1e3, "barrier-tax", load=load
        )
    idle, attn = point.get("barrier_idle") or {}, point.get("attention_idle") or {}
    return {
        "tokens_per_s": point.get("throughput_fit"), "tokens_per_s_two_scrapes": round(point["throughput"], 1),
        "barrier_idle": round(statistics.mean(idle.values()), 5) if idle else None,
        "attention_idle": round(statistics.mean(attn.values()), 5) if attn else None,
        "idle_by_runtime": idle, "itl_ms": point.get("itl_ms_mean"), "running_mean": point.get("running_mean"),
        "host_cores": point.get("host_cores"), "saturated": bool(point.get("saturated")), "time_scale": scale,
    }  # fmt: skip


def agreement(sim: dict, measured: dict) -> dict:
    """The two ratios RULES.md compares and whether both are within TOLERANCE."""
    ratios = {
        k: round(measured[k] / sim[k], 4) if measured.get(k) and sim.get(k) else None
        for k in ("tokens_per_s", "barrier_idle")
    }
    within = all(r is not None and abs(r - 1) <= TOLERANCE for r in ratios.values())
    return {"ratios": ratios, "within": within}


async def run_size(case: TaxCase, n: int, base_scale: float, probe_s: float, seed: int) -> dict:
    """Predict, then measure (again at twice the time scale if the host saturated: the rerun counts)."""
    pred = predict(case, n, seed)
    logger.info("[barrier-tax] ep %d simulated: %s", n, json.dumps(pred))
    scale = calibrate.plan_time_scale(base_scale, probe_s, pred["tokens_per_s"])
    measured = await measure(case, n, pred, scale, seed)
    if measured["saturated"]:
        logger.warning("[barrier-tax] ep %d saturated the host: rerun at time scale %g", n, 2 * scale)
        measured = await measure(case, n, pred, 2 * scale, seed)
    return {
        "gpus": n,
        "case": asdict(case),
        "simulated": pred,
        "measured": measured,
        **agreement(pred, measured),
    }


def main(args) -> int:
    """`amoe bench barrier-tax` (its flags: amoe.perf.studies.commands)."""
    sizes = [int(x) for x in args.sizes.split(",") if x]
    if not sizes or min(sizes) < 2:
        raise ConfigError(f"--sizes takes GPU counts of 2 or more, comma-separated; got {args.sizes!r}")
    case = TaxCase(trace=args.trace)
    load_trace(case.trace)  # a bad name fails here, before any server starts
    if args.simulate_only:
        rows = [{"gpus": n, "case": asdict(case), "simulated": predict(case, n, args.seed)} for n in sizes]
    else:
        base_scale, probe_s = calibrate.scaled(args.time_scale or BASE_TIME_SCALE)
        started = time.monotonic()
        rows = [asyncio.run(run_size(case, n, base_scale, probe_s, args.seed)) for n in sizes]
        logger.info("[barrier-tax] %.0f s wall", time.monotonic() - started)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "barrier_tax.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(table(rows))
    summary = {"barrier_tax": [{"gpus": r["gpus"], **{k: r.get(k) for k in ("ratios", "within")},
                                "tax": r["simulated"]["tax"]} for r in rows]}  # fmt: skip
    print(json.dumps(summary))
    return 0 if args.simulate_only or all(r["within"] for r in rows) else 1


def table(rows: list[dict]) -> str:
    lines = [
        f"{'GPUs':>4} {'sim tok/s':>10} {'run tok/s':>10} {'ratio':>6} {'sim idle':>8} {'run idle':>8} {'ratio':>6} "
        f"{'balanced':>10} {'tax':>6}"
    ]
    for r in rows:
        s, m, ratios = r["simulated"], r.get("measured", {}), r.get("ratios", {})
        lines.append(
            f"{r['gpus']:>4} {s['tokens_per_s']:>10.0f} {m.get('tokens_per_s') or 0:>10.0f} "
            f"{ratios.get('tokens_per_s') or 0:>6.3f} {s['barrier_idle']:>8.4f} {m.get('barrier_idle') or 0:>8.4f} "
            f"{ratios.get('barrier_idle') or 0:>6.3f} {s['balanced_tokens_per_s']:>10.0f} {s['tax']:>6.3f}"
        )
    return "\n".join(lines)
