"""A deployment's decode throughput at a fixed number of requests in flight, started in its steady state and measured
over ITLs rather than request lifetimes (`amoe bench plan-check`, `amoe bench plan-table` --measure).

`amoe.perf.studies.compare.load_point` offers Poisson arrivals above the deployment's rate and lets admission hold it at its
concurrency: the deployment fills in about half a request lifetime (output tokens × ITL / overload) and is measured
over the last 40 % of a point 2.5 fills long, ~80 ITLs in all. At full model depth, where ITLs reach a second, that
is an hour of a 2-core host per point. Here the deployment starts where that fill would have brought it:

* its first `concurrency` requests are the steady state's (`steady_state_requests`: length-biased outputs, each
  part-way through, which decode-only emulation takes as a longer prompt and fewer tokens left), so the contexts
  attention reads and the rate at which requests end are the steady state's from the start;
* they arrive spread over one predicted ITL, so each enters at its own phase of an iteration as in a deployment
  that has been running (all at once they would move in waves that small batches never break up);
* the load is closed: each request that ends is replaced by a new one of the workload, as admission replaces it
  from the waiting queue at the plan's concurrency;
* once all are running the point warms up for WARMUP_ITLS of the predicted ITL (again in the ITL it measured, when
  that is over 1.25× the prediction) and is measured over WINDOW_ITLS of it (the simulation's estimate settles within ~2 % over the same 4 + 8, amoe.perf.plan.refine), and over at least
  MIN_WINDOW_WALL_S: the coordinator's token counter moves in bursts as its event loop gets to the runtimes'
  outputs, and an 8-ITL window of a few wall seconds read one burst more or less (±7 % on a 4-block plan).

About 15 predicted ITLs per point instead of ~80. Decode-only emulation only: with prefill a longer prompt would cost
time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from amoe.perf.studies.compare_setup import Preset, Setup, profile_name, time_scale
from amoe.perf.studies.point import FAILED, measure
from amoe.testing.servers import ServerProcess

logger = logging.getLogger(__name__)

WARMUP_ITLS = 4
WINDOW_ITLS = 8
MIN_WINDOW_WALL_S = 30.0
SCRAPES_PER_WINDOW = 32
# Wall seconds: each scrape gathers every runtime's report, which costs the coordinator CPU.
MIN_SCRAPE_PERIOD_S = 0.25
# Wall seconds to wait for every request to be running, beyond their arrivals, before measuring what is running.
_ADMIT_GRACE_S = 120.0
# "All running": this share of the requests, as a replaced request is briefly not running.
_FULL = 0.99
# A warm-up whose ITL is this much longer than the guess is redone in its own ITLs.
_SLOWER = 1.25


async def steady_point(
    server: ServerProcess,
    setup: Setup,
    p: Preset,
    seed: int,
    concurrency: int,
    itl_s: float,
    kind: str,
    min_window_wall_s: float = MIN_WINDOW_WALL_S,
) -> dict[str, Any]:
    """`concurrency` requests in flight from their steady state (module docstring), measured over WINDOW_ITLS of
    `itl_s` (emulated seconds) after WARMUP_ITLS once all are running; cancelled at the end (the server is not
    reused)."""
    import httpx

    from amoe.bench.client import BenchClient
    from amoe.bench.serve import run_requests
    from amoe.perf.studies.probe import MetricsProbe

    scale = time_scale(setup, p)
    itl_wall = itl_s * scale
    window_itls = max(WINDOW_ITLS, math.ceil(min_window_wall_s / itl_wall))
    rate = concurrency / itl_s  # requests per emulated second: the first `concurrency` within one ITL
    requests, arrivals = _steady_load(setup, concurrency, seed, window_itls, rate / scale)
    logger.info(
        "[steady] %s: %d requests over %.1f s wall, then %d + %d ITLs of %.2f s wall",
        setup.name, concurrency, arrivals[-1], WARMUP_ITLS, window_itls, itl_wall,
    )  # fmt: skip
    # Long enough that no request times out before the point ends, even at a fraction of its predicted rate.
    timeout = 10 * (WARMUP_ITLS + window_itls + 2) * itl_wall + 2 * _ADMIT_GRACE_S
    client = BenchClient(server.url, timeout=timeout, stream=False)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http, client:
        client.model = profile_name(setup, p)
        period = max(MIN_SCRAPE_PERIOD_S, window_itls * itl_wall / SCRAPES_PER_WINDOW)
        probe = MetricsProbe(http, period_s=period, cpu_pid=server.proc.pid)
        start = time.perf_counter()
        probe.start()
        load = asyncio.ensure_future(run_requests(client, requests, arrivals, max_concurrency=concurrency))
        full = await _all_running(probe, _FULL * concurrency, start + arrivals[-1] + _ADMIT_GRACE_S)
        await asyncio.sleep(max(0.0, full + WARMUP_ITLS * itl_wall - time.perf_counter()))
        seen = _itl_since(probe, full)
        if seen is not None and seen > _SLOWER * itl_wall:
            # Slower than the guess (another policy at the same requests, a plan short of its prediction): warm
            # up and measure in its own ITLs, as the simulation does (amoe.perf.plan.refine).
            logger.info(
                "[steady] %s: ITL %.2f s wall, not %.2f: measuring in those", setup.name, seen, itl_wall
            )
            itl_wall = seen
            window_itls = max(WINDOW_ITLS, math.ceil(min_window_wall_s / itl_wall))
            await asyncio.sleep(max(0.0, full + WARMUP_ITLS * itl_wall - time.perf_counter()))
        now = time.perf_counter()
        window = (now, now + window_itls * itl_wall)
        await asyncio.sleep(window_itls * itl_wall + period)
        await probe.stop()
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
    point = measure(setup, kind, rate, probe, start, window, [], scale)
    point.update(concurrency=concurrency, guessed_itl_ms=itl_s * 1e3, window_itls=window_itls)
    _warn_of_a_point_short_of_its_load(setup, point, concurrency)
    return point


def _steady_load(
    setup: Setup, concurrency: int, seed: int, window_itls: int, wall_rate: float
) -> tuple[list, list[float]]:
    """The point's requests, the steady state's `concurrency` and enough replacements for every request to end
    twice over within the point, and their arrivals: the first `concurrency` at `wall_rate` (per wall second), the
    replacements queued behind the concurrency limit (each starts as one ends)."""
    from amoe.bench.arrivals import arrival_times
    from amoe.bench.workloads import make_requests, make_workload, steady_state_requests

    workload = make_workload(setup.workload)
    ends = math.ceil(2 * concurrency * (WARMUP_ITLS + window_itls + 2) / workload.output_range[0])
    requests = steady_state_requests(workload, concurrency, seed=seed)
    requests += make_requests(workload, ends, seed=seed, prompt_format="ids")
    arrivals = arrival_times(concurrency, wall_rate, 1.0, seed)
    arrivals += [arrivals[-1]] * ends
    return requests, arrivals


def _warn_of_a_point_short_of_its_load(setup: Setup, point: dict[str, Any], concurrency: int) -> None:
    """Say so when the coordinator ended requests during the point, or fewer than all were running."""
    failed = {r: n for r, n in point["ended"].items() if r in FAILED}
    if failed:
        logger.warning(
            "[steady] %s: requests ended by the coordinator during the point: %s", setup.name, failed
        )
    if point["running_mean"] < _FULL * concurrency:
        logger.warning(
            "[steady] %s: %.0f of %d requests running in the window",
            setup.name, point["running_mean"], concurrency,
        )  # fmt: skip


def _itl_since(probe, t0: float) -> float | None:
    """Mean ITL (wall seconds) the coordinator observed from the first scrape at or after t0 to the last one."""
    after = [s for s in probe.scrapes if s.t >= t0]
    if len(after) < 2 or after[-1].itl_count <= after[0].itl_count:
        return None
    return (after[-1].itl_sum - after[0].itl_sum) / (after[-1].itl_count - after[0].itl_count)


async def _all_running(probe, running: float, deadline: float) -> float:
    """The wall time of the first scrape that finds `running` requests running (or the deadline: then the window
    measures what runs, reported in the point)."""
    seen = 0
    while time.perf_counter() < deadline:
        for s in probe.scrapes[seen:]:
            if s.running >= running:
                return s.t
        seen = len(probe.scrapes)
        await asyncio.sleep(probe.period_s / 2)
    logger.warning(
        "[steady] fewer than %.0f requests were running by the deadline; measuring what runs", running
    )
    return time.perf_counter()
