"""What a half-load point of `amoe bench policies` measures, and how precisely: the ITL's time series
and its confidence interval by batch means.

A half-load point's ITL is the coordinator's ITL histogram differenced over a window: the mean over every output
token whose interval ended in it (token-weighted). At half load every arrival is served, so the window's token rate
is the arrivals' and, by Little's law, that mean is the requests in flight over the token rate: it moves with the
requests in flight, which follow the Poisson draw of the last request lifetime or so. Successive stretches of the
window are therefore not independent samples; batch means over stretches longer than that correlation give an
honest interval (Law & Kelton, "Simulation Modeling and Analysis", §9.5.3: the method of batch means).

`python -m amoe.perf.studies.policy_itl --policy waves --seed 0 --duration 10 --out DIR` runs one half-load point
(niced by the caller) and writes every scrape and every request's latency, for the analysis in
experiments/2026-11-27-policies-half-load-window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path

from amoe.perf.plan.simulate.batch_means import batch_means

logger = logging.getLogger(__name__)


async def trace_point(
    policy: str, seed: int, duration_s: float, load: float, blocks: int, period_s: float
) -> dict:
    """One point of `amoe bench policies`' setting at `load` × the bound's rate for `duration_s` emulated seconds,
    every `period_s` emulated seconds scraped; waits for every request to finish. Times in emulated seconds."""
    import httpx

    from amoe.bench.arrivals import arrival_times
    from amoe.bench.client import BenchClient
    from amoe.bench.serve import run_requests
    from amoe.bench.workloads import make_requests, make_workload
    from amoe.perf.studies import calibrate
    from amoe.perf.studies.compare_setup import (
        mean_output_tokens,
        profile_name,
        serve_config,
        time_scale,
        upper_bound,
    )
    from amoe.perf.studies.policy_bench import SETUP, _preset, max_seqs
    from amoe.perf.studies.probe import MetricsProbe
    from amoe.testing.servers import ServerProcess

    scale, probe_s = calibrate.scaled(25.0)
    p = _preset(blocks, (load,), duration_s, scale)
    setup = replace(SETUP, policy=policy)
    seqs = max_seqs(p)
    scale = time_scale(setup, p)
    rate = load * upper_bound(setup, p) / mean_output_tokens(setup.workload)
    num = max(4, round(rate * duration_s))
    arrivals = arrival_times(num, rate / scale, 1.0, seed)
    requests = make_requests(make_workload(setup.workload), num, seed=seed, prompt_format="ids")
    server = ServerProcess(
        serve_config(setup, p, seed).replace(
            emulation={"step_variance": "sourced"}, cache={"max_num_seqs": seqs}
        )
    )
    finished: list[tuple[float, float, int, bool]] = []
    with server:
        client = BenchClient(server.url, timeout=600, stream=False)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http, client:
            client.model = profile_name(setup, p)
            probe = MetricsProbe(http, period_s=period_s * scale, cpu_pid=server.proc.pid)
            start = time.perf_counter()
            probe.start()

            def done(r) -> None:
                finished.append((time.perf_counter() - start, r.latency, r.output_tokens, r.success))

            results, _ = await run_requests(client, requests, arrivals, on_done=done)
            await probe.stop()
    scrapes, reqs = _in_emulated_seconds(probe.scrapes, arrivals, results, start, scale)
    return {
        "policy": policy, "seed": seed, "load": load, "duration_s": duration_s, "rate": rate, "sent": num,
        "time_scale": scale, "probe_us": round(probe_s * 1e6, 1), "max_num_seqs_per_rank": seqs,
        "scrapes": scrapes, "requests": reqs,
    }  # fmt: skip


def _in_emulated_seconds(
    scrapes: list, arrivals: list[float], results: list, start: float, scale: float
) -> tuple[list[dict], list[dict]]:
    """The point's scrapes and its requests (arrival, latency, output tokens, success), times in emulated seconds
    from the point's `start`."""
    out = [
        {
            "t": (s.t - start) / scale, "running": s.running, "tokens": s.tokens, "itl_sum": s.itl_sum / scale,
            "itl_count": s.itl_count, "queue_tokens": s.queue_tokens, "cpu_s": s.cpu_s,
        }
        for s in scrapes
    ]  # fmt: skip
    reqs = [
        {
            "arrival": a / scale,
            "latency": r.latency / scale,
            "output_tokens": r.output_tokens,
            "ok": r.success,
        }
        for a, r in zip(arrivals, results)
    ]
    return out, reqs


def binned(trace: dict, width: float) -> list[dict]:
    """The trace's scrapes in bins of `width` emulated seconds: per bin its mean requests in flight, token rate and
    token-weighted mean ITL (ms)."""
    sc = trace["scrapes"]
    out, i = [], 0
    end = sc[-1]["t"]
    t = 0.0
    while t + width <= end + 1e-9:
        a = min(sc, key=lambda s: abs(s["t"] - t))
        b = min(sc, key=lambda s: abs(s["t"] - t - width))
        inside = [s["running"] for s in sc if a["t"] <= s["t"] <= b["t"]]
        dn = b["itl_count"] - a["itl_count"]
        out.append({
            "t": round(t, 3), "running": statistics.fmean(inside) if inside else None,
            "tok_per_s": (b["tokens"] - a["tokens"]) / (b["t"] - a["t"]) if b["t"] > a["t"] else None,
            "itl_ms": (b["itl_sum"] - a["itl_sum"]) / dn * 1e3 if dn else None,
        })  # fmt: skip
        t += width
        i += 1
    return out


def correlation_time(values: list[float], width: float) -> float:
    """The integrated autocorrelation time of a binned series (emulated seconds): width × (1 + 2 Σ ρ_k), summed
    until ρ_k first falls below 0 (the initial positive sequence, Geyer 1992). Independent samples in a window of
    length L: about L / this."""
    n = len(values)
    mean = statistics.fmean(values)
    dev = [v - mean for v in values]
    var = sum(d * d for d in dev) / n
    total = 1.0
    for k in range(1, n // 2):
        rho = sum(dev[i] * dev[i + k] for i in range(n - k)) / n / var
        if rho <= 0:
            break
        total += 2 * rho
    return width * total


async def service_curve(policy: str, seed: int, concurrencies: list[int], blocks: int) -> list[dict]:
    """The policy's ITL at fixed requests in flight (closed load from the steady state, amoe.perf.studies.steady), one
    fresh server a point: the curve ITL(N) that Little's law N = rate × tokens × ITL meets at half load. Where its
    elasticity d ln ITL / d ln N is near 1 the two lines nearly coincide and the requests in flight, and with them
    the ITL, are weakly pinned: a run's level wanders with the arrivals."""
    from amoe.perf.studies import calibrate
    from amoe.perf.studies.compare_setup import serve_config
    from amoe.perf.studies.policy_bench import SETUP, _preset, max_seqs
    from amoe.perf.studies.steady import steady_point
    from amoe.testing.servers import ServerProcess

    scale, _ = calibrate.scaled(25.0)
    p = _preset(blocks, (0.5,), 4.0, scale)
    setup = replace(SETUP, policy=policy)
    seqs = max_seqs(p)
    out = []
    for n in concurrencies:
        server = ServerProcess(
            serve_config(setup, p, seed).replace(
                emulation={"step_variance": "sourced"}, cache={"max_num_seqs": seqs}
            )
        )
        with server:
            pt = await steady_point(server, setup, p, seed, n, 0.009, f"closed {n}")
        out.append({
            "policy": policy, "concurrency": n, "itl_ms": pt["itl_ms_mean"], "running": pt["running_mean"],
            "throughput": pt["throughput"], "host_cores": pt["host_cores"], "time_scale": pt["time_scale"],
        })  # fmt: skip
        logger.info("[policy_itl] %s", out[-1])
    return out


def analyse(trace: dict) -> list[str]:
    """The lines of experiments/2026-11-27-policies-half-load-window/traces/analysis.txt for one trace: host
    CPU, requests in flight / token rate / ITL in 0.25 s bins, batch-means intervals over several windows (the
    bench's old one, [2.4, 4.0], first), correlation times, and the requests' own latency per token by when
    they arrived."""
    sc = trace["scrapes"]
    head = {
        k: round(v, 2) if isinstance(v, float) else v
        for k, v in trace.items()
        if k not in ("scrapes", "requests")
    }
    lines = [str(head)]
    cores = [
        (b["cpu_s"] - a["cpu_s"]) / ((b["t"] - a["t"]) * trace["time_scale"])
        for a, b in zip(sc, sc[1:])
        if a["cpu_s"] is not None and b["cpu_s"] is not None and b["t"] > a["t"]
    ]
    lines.append(f" host cores mean {statistics.fmean(cores):.2f} max {max(cores):.2f}")
    lines.append(" t    running  tok/s   itl_ms")
    for b in binned(trace, 0.25):
        lines.append(f" {b['t']:5.2f} {b['running']:7.1f} {b['tok_per_s'] or 0:8.0f} {b['itl_ms'] or 0:7.2f}")
    end = trace["duration_s"]
    lines += _batch_means_lines([(s["t"], s["itl_sum"], s["itl_count"], s["running"]) for s in sc], end)
    for w in (0.1, 0.25):
        bins = [b for b in binned(trace, w) if b["t"] >= 1.0 and b["itl_ms"] and b["t"] + w <= end]
        itl = correlation_time([b["itl_ms"] for b in bins], w)
        running = correlation_time([b["running"] for b in bins], w)
        lines.append(f"  correlation time (bins {w}) itl: {itl:.2f} s, running: {running:.2f} s")
    rq = [r for r in trace["requests"] if r["ok"] and r["output_tokens"] > 1]
    per = sorted(r["latency"] / r["output_tokens"] * 1e3 for r in rq)

    def q(xs: list[float], p: float) -> float:
        return xs[int(p * (len(xs) - 1))]

    lines.append(
        f"  per-request latency/token ms: n {len(per)} mean {statistics.fmean(per):.2f} p10 {q(per, 0.1):.2f} "
        f"p50 {q(per, 0.5):.2f} p90 {q(per, 0.9):.2f} p99 {q(per, 0.99):.2f} max {per[-1]:.2f}"
    )
    for a, e in [(0, 1), (1, 2), (2, 3), (2.4, 4), (3, 4), (4, 6), (6, 8)]:
        sel = sorted(r["latency"] / r["output_tokens"] * 1e3 for r in rq if a <= r["arrival"] < e)
        life = [r["latency"] for r in rq if a <= r["arrival"] < e]
        if sel:
            lines.append(
                f"   arrived [{a},{e}): n {len(sel)} mean {statistics.fmean(sel):.2f} p90 {q(sel, 0.9):.2f} "
                f"lifetime {statistics.fmean(life):.2f} s"
            )
    return lines


def _batch_means_lines(series: list[tuple], end: float) -> list[str]:
    """The ITL's batch-means interval over several windows and batch counts (the bench's old window, [2.4, 4.0],
    first), with the batches' lag-1 correlation and their means."""
    lines = []
    for a, e, k in [
        (2.4, 4.0, 4),
        (2.4, 4.0, 8),
        (1.0, 4.0, 6),
        (1.5, 5.5, 4),
        (1.0, end, 7),
        (1.0, end, 14),
    ]:
        r = batch_means(series, a, e, k)
        lag1 = None if r["lag1"] is None else round(r["lag1"], 2)
        means = [round(m * 1e3, 2) for m in r["batch_means"]]
        lines.append(
            f"  window [{a},{e}] {k} batches: itl {r['value'] * 1e3:.2f} ms ±{r['ci_rel'] * 100:.1f}% "
            f"lag1 {lag1} means {means}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="waves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=10.0, help="emulated seconds of arrivals")
    ap.add_argument("--load", type=float, default=0.5, help="fraction of the bound's request rate")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--period", type=float, default=0.05, help="emulated seconds between scrapes")
    ap.add_argument("--out", help="directory; writes trace_<policy>_<seed>.json")
    ap.add_argument(
        "--curve", metavar="N,N,...", help="the ITL at these fixed requests in flight; run no trace"
    )
    ap.add_argument(
        "--analyse", nargs="+", metavar="TRACE", help="print the analysis of recorded traces; run nothing"
    )
    args = ap.parse_args(argv)
    if args.curve:
        curve = asyncio.run(
            service_curve(args.policy, args.seed, [int(x) for x in args.curve.split(",")], args.blocks)
        )
        print(json.dumps(curve))
        return 0
    if args.analyse:
        for path in args.analyse:
            print(path)
            print("\n".join(analyse(json.loads(Path(path).read_text()))))
        return 0
    if not args.out:
        raise SystemExit("policy_itl: --out is required to run a trace")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    trace = asyncio.run(
        trace_point(args.policy, args.seed, args.duration, args.load, args.blocks, args.period)
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"trace_{args.policy}_{args.seed}.json").write_text(json.dumps(trace) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
