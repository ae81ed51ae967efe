"""Server-side measurements for `amoe bench compare`: `/metrics` scraped at a fixed period while a load point runs.

Throughput and ITL come from the coordinator's counters (generated tokens, the ITL histogram), differenced over a
steady-state window, so requests still streaming when a point ends count as much as finished ones — an overloaded
point need not be drained. Queue depth (the sum of every μ-queue) is kept as a time series for Figure 7.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LE = re.compile(r'le="([^"]+)"')
_LABEL = re.compile(r'(\w+)="([^"]*)"')
TOKENS = "amoe_coordinator_generation_tokens_total"
ITL = "amoe_request_itl_seconds"
TTFT = "amoe_request_ttft_seconds"
BUSY = "amoe_runtime_busy_seconds_total"
UPTIME = "amoe_runtime_uptime_seconds_total"
BARRIER_IDLE = "amoe_runtime_barrier_idle_seconds_total"
ATTENTION_IDLE = "amoe_runtime_attention_idle_seconds_total"
QUEUE = "amoe_runtime_queue_depth_tokens"
RUNNING = "amoe_requests_running"
BATCH_ROWS = "amoe_runtime_batch_size_rows"
FINISHED = "amoe_requests_finished_total"


@dataclass
class Scrape:
    """The sums this benchmark needs from one /metrics page, at wall time t."""

    t: float
    tokens: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    itl_buckets: dict[float, float] = field(default_factory=dict)  # le → cumulative count
    queue_tokens: float = 0.0
    running: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    busy: dict[str, float] = field(default_factory=dict)  # "role runtime" → seconds the runtime ran layers
    uptime: dict[str, float] = field(default_factory=dict)  # "role runtime" → its age when it reported busy
    # "role runtime" → seconds a synchronous device's steps waited for a slower peer's (all; attention's)
    barrier_idle: dict[str, float] = field(default_factory=dict)
    attention_idle: dict[str, float] = field(default_factory=dict)
    cpu_s: float | None = None  # host CPU seconds of the server's processes and this one (Linux), if measured
    # step kind (attn, head, expert) → [rows, steps] summed over the runtimes: the batch sizes the runtime ran
    batch_rows: dict[str, list[float]] = field(default_factory=dict)
    # why requests ended (stop, length, abort, error, rejected) → how many, since the server started
    finished: dict[str, float] = field(default_factory=dict)


def parse_metrics(text: str, t: float) -> Scrape:
    """Sum the series of the metrics above (all labels) from Prometheus text."""
    s = Scrape(t)
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name == TOKENS:
            s.tokens += value
        elif name == f"{ITL}_sum":
            s.itl_sum += value
        elif name == f"{ITL}_count":
            s.itl_count += value
        elif name == f"{ITL}_bucket" and (le := _LE.search(labels)):
            bound = float(le.group(1))
            s.itl_buckets[bound] = s.itl_buckets.get(bound, 0.0) + value
        elif name == QUEUE:
            s.queue_tokens += value
        elif name == RUNNING:
            s.running += value
        elif name == f"{TTFT}_sum":
            s.ttft_sum += value
        elif name == f"{TTFT}_count":
            s.ttft_count += value
        elif name == BUSY and (key := _runtime_key(labels)):
            s.busy[key] = value
        elif name == UPTIME and (key := _runtime_key(labels)):
            s.uptime[key] = value
        elif name == BARRIER_IDLE and (key := _runtime_key(labels)):
            s.barrier_idle[key] = value
        elif name == ATTENTION_IDLE and (key := _runtime_key(labels)):
            s.attention_idle[key] = value
        elif name in (f"{BATCH_ROWS}_sum", f"{BATCH_ROWS}_count") and (
            kind := dict(_LABEL.findall(labels)).get("kind")
        ):
            s.batch_rows.setdefault(kind, [0.0, 0.0])[name.endswith("_count")] += value
        elif name == FINISHED and (reason := dict(_LABEL.findall(labels)).get("reason")):
            s.finished[reason] = s.finished.get(reason, 0.0) + value
    return s


def _runtime_key(labels: str) -> str | None:
    found = dict(_LABEL.findall(labels))
    return f"{found['role']} {found['runtime']}" if "role" in found and "runtime" in found else None


def process_tree_cpu_s(root_pid: int) -> float | None:
    """CPU seconds (user + system) used so far by root_pid and its descendants, from /proc; None off Linux.

    The emulated timings are only as good as the host's spare CPU: a saturated host delays every hold. Reporting
    the host's load beside each point shows when a measurement is the host's limit rather than the GPUs'.
    """
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        stats = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{entry.name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    except OSError:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
            todo += children.get(pid, [])
    return total / tick


class MetricsProbe:
    """Scrapes `url/metrics` every `period_s` until stopped; `scrapes` holds them in time order."""

    def __init__(self, client: httpx.AsyncClient, period_s: float, cpu_pid: int | None = None) -> None:
        self.client, self.period_s = client, period_s
        self.cpu_pid = cpu_pid  # with it, each scrape also records the host CPU of that process tree
        self.scrapes: list[Scrape] = []
        self._task: asyncio.Task | None = None

    async def scrape(self) -> Scrape:
        response = await self.client.get("/metrics")
        response.raise_for_status()
        s = parse_metrics(response.text, time.perf_counter())
        if self.cpu_pid is not None and (cpu := process_tree_cpu_s(self.cpu_pid)) is not None:
            s.cpu_s = cpu + sum(os.times()[:2])  # the load generator's own CPU counts too
        return s

    async def _run(self) -> None:
        while True:
            try:
                self.scrapes.append(await self.scrape())
            except httpx.HTTPError as exc:  # one lost scrape only widens the window
                logger.debug("[compare] scrape failed: %s", exc)
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def window(self, start: float, end: float) -> tuple[Scrape, Scrape] | None:
        """The first scrape at or after `start` and the last at or before `end` (None if fewer than two)."""
        inside = [s for s in self.scrapes if start <= s.t <= end]
        return (inside[0], inside[-1]) if len(inside) >= 2 and inside[-1].t > inside[0].t else None


def histogram_quantile(q: float, first: Scrape, last: Scrape) -> float | None:
    """The q-quantile of the ITL observations between two scrapes (linear inside a bucket, as Prometheus)."""
    bounds = sorted(b for b in last.itl_buckets if b != float("inf"))
    counts = [last.itl_buckets[b] - first.itl_buckets.get(b, 0.0) for b in bounds]
    total = last.itl_count - first.itl_count
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= rank:
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, cumulative
    return bounds[-1] if bounds else None
