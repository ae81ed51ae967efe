"""`amoe bench compare`: start emulated `amoe serve` deployments (AEP, EP, ...), sweep Poisson request rates
against each with `amoe bench serve`'s machinery, and report throughput against ITL, queue depth over time, the
cost model's upper bound and the headline ratios (AEP / EP, fraction of the bound, defrag vs mtfs / flfs).

Everything is in emulated time: wall seconds / time scale. Writes `--out DIR`: results.json, throughput_vs_itl.png,
queue_depth.png; prints a table and one final JSON line. The recorded runs: docs/findings.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from amoe.errors import ConfigError
from amoe.perf.studies.compare_setup import (
    Preset,
    Setup,
    mean_output_tokens,
    only_groups,
    preset,
    profile_name,
    serve_config,
    time_scale,
    upper_bound,
)
from amoe.perf.studies.point import measure
from amoe.testing.servers import ServerProcess

logger = logging.getLogger(__name__)

# Of a point's arrival span, before the measurement window opens: ~1 request lifetime at the presets' settings.
_WARMUP_FRACTION = 0.6
_SCRAPES_PER_POINT = 40


def run_bench_compare(args: argparse.Namespace) -> int:
    from amoe.perf.studies import calibrate

    p = preset(args.preset)
    # The preset's scale is for the host it was chosen on; a slower host's Python gets proportionally more wall
    # time per emulated second, so host work stays the same share of each emulated step (amoe.perf.studies.calibrate).
    scale, probe_s = (args.time_scale, None) if args.time_scale else calibrate.scaled(p.time_scale)
    p = replace(
        p,
        time_scale=scale,
        duration_s=args.duration or p.duration_s,
        blocks=args.blocks or p.blocks,
        attn_cap=args.attn_cap or p.attn_cap,
        loads=_loads(args.loads) if args.loads else p.loads,
    )
    if args.groups:
        p = only_groups(p, args.groups.split(","))
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1; got {args.repeats}")
    started = time.perf_counter()
    from amoe.perf.studies.compare_report import headline, median_headline, table, write_outputs

    runs = []
    for i in range(args.repeats):
        points = asyncio.run(_run_preset(p, args.seed))
        summary = headline(points, p, args.seed)
        summary["saturated_points"] = [
            f"{pt['config']}@{pt['rate']:.0f}" for pt in points if pt.get("saturated")
        ]
        runs.append((points, summary))
        logger.info("[compare] run %d of %d: %s", i + 1, args.repeats, json.dumps(summary))
    points, summary = runs[0][0], median_headline([s for _, s in runs])
    if probe_s is not None:
        summary["host_probe_us"] = round(probe_s * 1e6, 1)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    write_outputs(Path(args.out), points, summary, p, args, runs=[s for _, s in runs])
    print(table(points))
    print(json.dumps(summary))
    return 0 if all(pt["throughput"] > 0 for pts, _ in runs for pt in pts) else 1


def _loads(text: str) -> tuple[float, ...]:
    try:
        loads = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--loads takes comma-separated numbers, e.g. 0.5,1.5; got {text!r}") from None
    if not loads or any(x <= 0 for x in loads):
        raise ConfigError(f"--loads must be positive fractions of the bound's rate; got {text!r}")
    return loads


async def _run_preset(p: Preset, seed: int) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    for group in (p.sweeps, *p.extra):
        for setup in group:
            with_policy = p.policy_base is not None and setup == p.policy_base
            points += await _sweep(setup, p, seed, with_policy)
    if p.steady:
        points += await _steady_points(p, seed, points)
    if p.policy_base is not None:
        # Each other policy at defrag's policy load and at defrag's maximum: throughput is compared at the maxima,
        # ITL at a load every policy sustains. With steady points every policy runs the requests defrag's
        # maximum held (a load past one policy's capacity measures how its backlog was building when the window
        # closed, which moved 8 % between two runs); without, Poisson arrivals at the rate of defrag's maximum.
        mine = [pt for pt in points if pt["config"] == p.policy_base.name]
        at_load = next(pt for pt in mine if pt["kind"] == "policy")
        at_max = next((pt for pt in mine if pt["kind"] == "max"), None)
        at_max = at_max or max((pt for pt in mine if pt["kind"] == "sweep"), key=lambda pt: pt["throughput"])
        for policy in ("mtfs", "flfs"):
            other = replace(p.policy_base, policy=policy)
            points += await _points(other, p, seed, [at_load["rate"]], kind="policy")
            if p.steady:
                held = round(at_max["running_mean"])
                points.append(await _steady(other, p, seed, held, at_max["itl_ms_mean"], "policy_max"))
            else:
                points += await _points(other, p, seed, [at_max["rate"]], kind="policy_max")
    return points


async def _steady_points(p: Preset, seed: int, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The headline's maxima and AEP at EP's ITL from steady points (amoe.perf.studies.steady), which hold a number of
    requests rather than a rate and so have no backlog to measure: each main setup at the requests its best load
    point held, and AEP at the requests that give it EP's ITL there (a second try aimed by the first's ITL when
    that missed by more than 3 %). On Poisson points alone AEP / EP at EP's ITL moved 6 % between two runs: it was
    read between two load points 4 ms apart on the steep part of AEP's curve."""
    out: list[dict[str, Any]] = []
    best: dict[str, dict[str, Any]] = {}
    for setup in p.sweeps:
        sweep = [pt for pt in points if pt["config"] == setup.name and pt["kind"] == "sweep"]
        top = max(sweep, key=lambda pt: pt["throughput"])
        best[setup.mode] = await _steady(
            setup, p, seed, round(top["running_mean"]), top["itl_ms_mean"], "max"
        )
        out.append(best[setup.mode])
    aep = next((s for s in p.sweeps if s.mode == "aep"), None)
    if aep is None or "ep" not in best or not best["ep"]["itl_ms_mean"]:
        return out
    from amoe.perf.studies.compare_report import throughput_at_itl

    target = best["ep"]["itl_ms_mean"]
    curve = [pt for pt in points + out if pt["config"] == aep.name]
    held = best["aep"]["running_mean"]
    requests = min(held, throughput_at_itl(curve, target) * target / 1e3)  # Little: throughput × ITL
    for _ in range(2):
        if requests < 1:
            break
        pt = await _steady(aep, p, seed, round(requests), target, "at_itl")
        out.append(pt)
        if not pt["itl_ms_mean"] or abs(pt["itl_ms_mean"] / target - 1) <= 0.03:
            break
        requests = min(held, requests * target / pt["itl_ms_mean"])
    return out


async def _steady(
    setup: Setup, p: Preset, seed: int, requests: int, itl_ms: float, kind: str
) -> dict[str, Any]:
    """One steady point on a fresh server: `requests` in flight from their steady state, ITL guessed at itl_ms."""
    from amoe.perf.studies.steady import steady_point

    server = ServerProcess(serve_config(setup, p, seed))
    with server:
        return await steady_point(server, setup, p, seed, requests, itl_ms / 1e3, kind)


async def _sweep(setup: Setup, p: Preset, seed: int, with_policy: bool) -> list[dict[str, Any]]:
    """The load sweep of one setup; the base setup of the policy comparison also runs its policy point."""
    rate_ub = upper_bound(setup, p) / mean_output_tokens(setup.workload)
    server = ServerProcess(serve_config(setup, p, seed))
    with server:
        points = [await load_point(server, setup, p, seed, load * rate_ub, "sweep") for load in p.loads]
        if with_policy:
            best = max(pt["throughput"] for pt in points)
            rate = p.policy_load * best / mean_output_tokens(setup.workload)
            points.append(await load_point(server, setup, p, seed, rate, "policy"))
    return [await _unsaturated(pt, setup, p, seed) for pt in points]


async def _points(setup: Setup, p: Preset, seed: int, rates: list[float], kind: str) -> list[dict[str, Any]]:
    server = ServerProcess(serve_config(setup, p, seed))
    with server:
        points = [await load_point(server, setup, p, seed, rate, kind) for rate in rates]
    return [await _unsaturated(pt, setup, p, seed) for pt in points]


async def _unsaturated(point: dict[str, Any], setup: Setup, p: Preset, seed: int) -> dict[str, Any]:
    """The point, or, when its server saturated the host's CPU (the host, not the emulated GPUs, set its pace), the
    same load rerun once on a fresh server at twice the time scale; the rerun keeps the first run's host CPU."""
    if not point.get("saturated"):
        return point
    slower = replace(setup, slowdown=2 * setup.slowdown)
    logger.warning(
        "[compare] %s at %.0f req/s saturated the host (%.2f cores): rerun at time scale %g",
        setup.name, point["rate"], point["host_cores"], time_scale(slower, p),
    )  # fmt: skip
    server = ServerProcess(serve_config(slower, p, seed))
    with server:
        rerun = await load_point(server, slower, p, seed, point["rate"], point["kind"])
    rerun["rerun_of"] = {k: point[k] for k in ("throughput", "itl_ms_mean", "host_cores", "time_scale")}
    return rerun


async def load_point(
    server: ServerProcess,
    setup: Setup,
    p: Preset,
    seed: int,
    rate: float,
    kind: str,
    duration_s: float | None = None,
    warmup_s: float | None = None,
    series: bool = False,
    grace: float = 0.1,
) -> dict[str, Any]:
    """One load point: Poisson arrivals at `rate` req/s (emulated) for the preset's duration (or `duration_s`),
    measured by the server's counters over the steady part; requests still running at the end are cancelled.

    The window is the last 40 % of the arrivals' span, or, with `warmup_s`, everything after that many emulated
    seconds. With `series` the point also keeps every scrape of the window (`series`: emulated seconds from the
    window's start, the ITL histogram's sum in emulated seconds and its count, requests running, output tokens)
    for batch means (amoe.perf.studies.policy_itl). `grace`: of the duration, how long after the last arrival to wait
    for requests to finish (`completed`) before cancelling them.

    Requests are not streamed: the server's histograms give TTFT and ITL, and one SSE event per token would cost
    this 2-core host more CPU than the emulated runtimes."""
    import httpx

    from amoe.bench.client import BenchClient
    from amoe.bench.serve import run_requests
    from amoe.perf.studies.probe import MetricsProbe

    scale = time_scale(setup, p)
    duration_s = duration_s or p.duration_s
    num = max(4, round(rate * duration_s))
    requests, arrivals = _poisson_load(setup, num, rate / scale, seed)
    span = arrivals[-1] if arrivals[-1] > 0 else duration_s * scale
    logger.info(
        "[compare] %s: %.1f req/s (emulated), %d requests over %.0f s wall", setup.name, rate, num, span
    )
    url = server.url
    client = BenchClient(url, timeout=600, stream=False)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http, client:
        client.model = profile_name(setup, p)
        probe = MetricsProbe(http, period_s=span / _SCRAPES_PER_POINT, cpu_pid=server.proc.pid)
        warnings_mark = server.num_warnings
        start = time.perf_counter()
        probe.start()
        load = asyncio.ensure_future(run_requests(client, requests, arrivals))
        await asyncio.sleep(span)
        await probe.stop()
        done = await _finish(load, duration_s * scale * grace)
        await _drain(http)
    opens = _WARMUP_FRACTION * span if warmup_s is None else min(warmup_s * scale, span)
    window = (start + opens, start + span)
    point = measure(setup, kind, rate, probe, start, window, done, scale)
    if series:
        point["series"], point["window_s"] = _window_series(probe, window, scale)
    # What the server warned of while the point ran (a runtime lost or replaced, requests moved): a point read
    # from a deployment that was not the planned one must say so.
    point["sent"] = num
    point["server_warnings"] = server.warnings_since(warnings_mark)
    return point


def _poisson_load(setup: Setup, num: int, wall_rate: float, seed: int) -> tuple[list, list[float]]:
    """`num` requests of the setup's workload and their Poisson arrivals at `wall_rate` per wall second."""
    from amoe.bench.arrivals import arrival_times
    from amoe.bench.workloads import make_requests, make_workload

    arrivals = arrival_times(num, wall_rate, 1.0, seed)
    return make_requests(make_workload(setup.workload), num, seed=seed, prompt_format="ids"), arrivals


def _window_series(probe: Any, window: tuple[float, float], scale: float) -> tuple[list[tuple], float]:
    """Every scrape of the window (emulated seconds from its start, the ITL histogram's sum in emulated seconds
    and its count, requests running, output tokens), and the window's emulated length."""
    inside = [s for s in probe.scrapes if window[0] <= s.t <= window[1]]
    series = [
        (round((s.t - inside[0].t) / scale, 4), s.itl_sum / scale, s.itl_count, s.running, s.tokens)
        for s in inside
    ]
    return series, round((inside[-1].t - inside[0].t) / scale, 3) if inside else 0.0


async def _finish(load: asyncio.Future, grace_s: float) -> list:
    """Results of the requests that finish within grace_s after the last arrival; the rest are cancelled."""
    finished, _ = await asyncio.wait([load], timeout=grace_s)
    if finished:
        return load.result()[0]
    load.cancel()
    await asyncio.gather(load, return_exceptions=True)
    return []


async def _drain(http, timeout_s: float = 120.0) -> None:
    """Wait until the server runs no request and its queues are empty (aborted requests' rows still in flight
    end at their next head step), so the next point starts from an idle deployment."""
    from amoe.perf.studies.probe import MetricsProbe

    probe, deadline = MetricsProbe(http, 0.2), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = await probe.scrape()
        if s.running == 0 and s.queue_tokens == 0:
            return
        await asyncio.sleep(0.2)
    logger.warning("[compare] the server did not drain within %.0f s", timeout_s)
