"""/metrics latency: a live `amoe serve` (tiny preset, 2 attention + 4 expert runtimes) idle and then under a steady
streamed load, timing GET /metrics beside GET /health on the same server in the same run. /health is the same HTTP
stack with nothing to render, so metrics/health is the cost of the page itself, whatever the machine's noise.

    .venv/bin/python bench/metrics_endpoint.py [--requests 40] [--clients 4]

Then the page's writer alone, in this process: amoe's `text_format` against prometheus_client's `generate_latest` on
the families of the live page (same bytes, checked). Target: median /metrics under load below 50 ms.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.testing.servers import ServerProcess
from coordinator.metrics import text_format

TARGET_MS = 50.0


def stream_forever(url: str, stop, done) -> None:
    """Streamed completions back to back until `stop`, as the metrics test's load does. In a process of its own:
    in the timing process it would share that event loop and add its own waits to the timings."""
    body = {
        "model": "tiny",
        "prompt": "the expert queue",
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            with client.stream("POST", "/v1/completions", json=body) as reply:
                reply.raise_for_status()
                for _ in reply.iter_lines():
                    pass
            with done.get_lock():
                done.value += 1


async def time_gets(url: str, path: str, n: int) -> tuple[list[float], int]:
    """Seconds per GET on a fresh connection each (no kept-alive socket's delayed ACK), and the last page's size."""
    timings, size = [], 0
    for _ in range(n):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            start = time.perf_counter()
            reply = await client.get(path)
            timings.append(time.perf_counter() - start)
        reply.raise_for_status()
        size = len(reply.content)
        await asyncio.sleep(0.02)
    return timings, size


async def measure(url: str, requests: int) -> dict[str, float]:
    """Alternating rounds of /metrics and /health, so both see the same background."""
    metrics, health, size = [], [], 0
    for _ in range(4):
        m, size = await time_gets(url, "/metrics", requests // 4)
        h, _ = await time_gets(url, "/health", requests // 4)
        metrics += m
        health += h
    med_m, med_h = statistics.median(metrics), statistics.median(health)
    return {
        "metrics_ms_p50": round(med_m * 1e3, 1),
        "metrics_ms_p90": round(sorted(metrics)[int(0.9 * len(metrics))] * 1e3, 1),
        "health_ms_p50": round(med_h * 1e3, 1),
        "metrics_over_health": round(med_m / med_h, 2),
        "page_kb": round(size / 1024, 1),
    }


def compare_writers(page: str, repeats: int = 50) -> dict[str, float]:
    """amoe's text writer against prometheus_client's `generate_latest` on the live page's families, in this
    process: the page's own share of a /metrics request, without HTTP or the server's load."""
    families = list(text_string_to_metric_families(page))

    class Page:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Page())
    if text_format(registry) != generate_latest(registry):
        raise AssertionError("text_format differs from generate_latest on the live page")
    timings = {}
    for name, write in (("amoe", text_format), ("prometheus_client", generate_latest)):
        start = time.perf_counter()
        for _ in range(repeats):
            write(registry)
        timings[name] = (time.perf_counter() - start) / repeats
    return {
        "write_ms_amoe": round(timings["amoe"] * 1e3, 2),
        "write_ms_prometheus_client": round(timings["prometheus_client"] * 1e3, 2),
        "prometheus_client_over_amoe": round(timings["prometheus_client"] / timings["amoe"], 2),
    }


async def run(url: str, requests: int, clients: int) -> dict[str, object]:
    out: dict[str, object] = {"idle": await measure(url, requests)}
    ctx = mp.get_context("spawn")
    stop, done = ctx.Event(), ctx.Value("i", 0)
    load = [ctx.Process(target=stream_forever, args=(url, stop, done)) for _ in range(clients)]
    for proc in load:
        proc.start()
    try:
        await asyncio.sleep(5.0)  # every runtime busy and reporting
        out["load"] = await measure(url, requests)
    finally:
        stop.set()
        for proc in load:
            proc.join(60)
    out["completions_during_load"] = done.value
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        out["writers"] = compare_writers((await client.get("/metrics")).text)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="GETs of each path per phase")
    parser.add_argument(
        "--clients", type=int, default=4, help="concurrent streamed completions during the load"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model("tiny", Path(tmp) / "tiny", seed=0)
        config = AmoeConfig().replace(
            model={"path": str(model)}, parallel={"attn_ranks": 2, "expert_ranks": 4}
        )
        with ServerProcess(config) as url:
            result = asyncio.run(run(url, args.requests, args.clients))
    for phase in ("idle", "load"):
        r = result[phase]
        print(
            f"{phase:5} /metrics p50 {r['metrics_ms_p50']:6.1f} ms  p90 {r['metrics_ms_p90']:6.1f} ms  "
            f"/health p50 {r['health_ms_p50']:5.1f} ms  ratio {r['metrics_over_health']:5.2f}  page {r['page_kb']} KB"
        )
    w = result["writers"]
    print(
        f"page writer: amoe {w['write_ms_amoe']} ms, prometheus_client {w['write_ms_prometheus_client']} ms "
        f"({w['prometheus_client_over_amoe']}x)"
    )
    result["target_ms"] = TARGET_MS
    result["target_met"] = result["load"]["metrics_ms_p50"] < TARGET_MS
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
