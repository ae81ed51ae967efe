"""`amoe queues --url URL`: a live terminal view of a running server's mu-queue depths, read from its /metrics.

For when no Grafana is at hand: one table of runtimes (tokens queued, token pool, busy and stall share since the
last frame, a bar) and the queue depth of every (block, expert) and (block, attention rank).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from amoe.errors import AmoeError, ConfigError

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
_MAX_ROWS_LISTED = 20  # deepest queues listed when the block x expert grid is too wide for the terminal


def add_queues_command(sub: Any) -> None:
    p = sub.add_parser("queues", help="live terminal view of the mu-queue depths of a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between frames (default: 1)"
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--api-key", help="the server's API key, if it has one")
    p.set_defaults(run=run_queues)


def run_queues(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise ConfigError(f"--interval must be positive; got {args.interval}")
    url = args.url.rstrip("/")
    clear = sys.stdout.isatty() and not args.once
    previous = None
    while True:
        snap = fetch(url, args.api_key)
        frame = render(snap, previous, url, args.interval, shutil.get_terminal_size().columns)
        sys.stdout.write((_CLEAR if clear else "") + frame + ("" if clear else "\n"))
        sys.stdout.flush()
        if args.once:
            return 0
        previous = snap
        time.sleep(args.interval)


@dataclass
class RuntimeQueues:
    """One runtime's row of the view: its tokens queued, pool parts and busy / idle clocks."""

    role: str = ""
    depth: float = 0.0
    pool_parts: float = 0.0
    busy_s: float = 0.0
    idle_s: float = 0.0
    uptime_s: float = 0.0  # the runtime's clock when it made the report busy_s and idle_s came in


@dataclass
class Snapshot:
    """What one /metrics page says about the queues."""

    runtimes: dict[int, RuntimeQueues] = field(default_factory=dict)
    experts: dict[tuple[int, int], float] = field(default_factory=dict)  # (block, expert) -> tokens
    attention: dict[tuple[int, int], float] = field(default_factory=dict)  # (block, rank) -> tokens


def fetch(url: str, api_key: str | None = None) -> Snapshot:
    """GET url/metrics and parse it; AmoeError (one line) if that fails."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.get(f"{url}/metrics", headers=headers, timeout=5.0)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: not even a URL
        raise AmoeError(f"cannot read {url}/metrics: {exc or type(exc).__name__}") from None
    if reply.status_code != 200:
        raise AmoeError(f"{url}/metrics answered HTTP {reply.status_code}")
    try:
        return parse(reply.text)
    except ValueError as exc:
        raise AmoeError(f"{url}/metrics is not a Prometheus metrics page: {exc}") from None


def parse(text: str) -> Snapshot:
    """The queue view of a Prometheus text page (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            _take(snap, sample.name, sample.labels, sample.value)
    return snap


def _take(snap: Snapshot, name: str, labels: dict[str, str], value: float) -> None:
    if "runtime" not in labels or not labels["runtime"].lstrip("-").isdigit():
        return
    rt = snap.runtimes.setdefault(int(labels["runtime"]), RuntimeQueues())
    if labels.get("role"):
        rt.role = labels["role"]
    if name == "amoe_runtime_queue_depth_tokens":
        rt.depth += value
        block = labels.get("block", "")
        if block and labels.get("expert"):
            snap.experts[(int(block), int(labels["expert"]))] = value
        elif block and labels.get("rank"):
            snap.attention[(int(block), int(labels["rank"]))] = value
    elif name == "amoe_runtime_pool_parts":
        rt.pool_parts = value
    elif name == "amoe_runtime_busy_seconds_total":
        rt.busy_s = value
    elif name == "amoe_runtime_idle_seconds_total":
        rt.idle_s = value
    elif name == "amoe_runtime_uptime_seconds_total":
        rt.uptime_s = value


def render(snap: Snapshot, previous: Snapshot | None, url: str, interval: float, width: int = 100) -> str:
    """One frame: the runtime table with bars, then the block x expert and block x rank grids."""
    head = f"amoe queues  {url}  {time.strftime('%H:%M:%S')}  every {interval:g} s (Ctrl-C quits)"
    if not snap.runtimes:
        return f"{head}\n\nno runtime reports yet (a server with the local backend has no runtimes)\n"
    lines = [head, "", *_runtime_table(snap, previous, width)]
    if snap.experts:
        lines += ["", "expert mu-queues, tokens (block x expert)", *_grid(snap.experts, "e", width)]
    if snap.attention:
        lines += ["", "attention mu-queues, tokens (block x rank; the last block is the head)"]
        lines += _grid(snap.attention, "r", width)
    if not snap.experts and not snap.attention:
        lines += ["", "(per-layer depths are off: server.metrics_per_layer=false)"]
    return "\n".join(lines) + "\n"


def _runtime_table(snap: Snapshot, previous: Snapshot | None, width: int) -> list[str]:
    rows = [f"{'runtime':>7}  {'role':<9}  {'queued':>7}  {'pool':>6}  {'busy':>5}  {'stall':>5}  "]
    bar_width = max(width - len(rows[0]) - 1, 10)
    deepest = max((rt.depth for rt in snap.runtimes.values()), default=0.0) or 1.0
    for runtime, rt in sorted(snap.runtimes.items()):
        busy, stall = _shares(rt, previous.runtimes.get(runtime) if previous else None)
        bar = "#" * round(bar_width * rt.depth / deepest)
        rows.append(
            f"{runtime:>7}  {rt.role:<9}  {rt.depth:>7.0f}  {rt.pool_parts:>6.0f}  {busy:>5}  {stall:>5}  {bar}"
        )
    total = sum(rt.depth for rt in snap.runtimes.values())
    rows.append(f"{'total':>7}  {'':<9}  {total:>7.0f}")
    return rows


def _shares(rt: RuntimeQueues, before: RuntimeQueues | None) -> tuple[str, str]:
    """Busy and stall share of the runtime's time between the reports two frames show ("-" on the first, or
    when no new report came): on the runtime's clock, as reports arrive a heartbeat apart, not with each frame."""
    if before is None or rt.uptime_s <= before.uptime_s:
        return "-", "-"
    elapsed = rt.uptime_s - before.uptime_s
    busy = max(rt.busy_s - before.busy_s, 0.0) / elapsed
    stall = max(rt.idle_s - before.idle_s, 0.0) / elapsed
    return f"{min(busy, 1):.0%}", f"{min(stall, 1):.0%}"


def _grid(cells: dict[tuple[int, int], float], prefix: str, width: int) -> list[str]:
    blocks = sorted({b for b, _ in cells})
    columns = sorted({c for _, c in cells})
    cell = max(5, len(f"{max(cells.values(), default=0):.0f}") + 1, len(f"{prefix}{columns[-1]}") + 1)
    if 6 + cell * len(columns) > width:  # too wide: list the deepest queues instead
        deepest = sorted(cells.items(), key=lambda kv: (-kv[1], kv[0]))[:_MAX_ROWS_LISTED]
        return [f"  block {b:>3} {prefix}{c:<4} {v:>7.0f}" for (b, c), v in deepest if v > 0] or [
            "  all empty"
        ]
    rows = [f"{'block':>5} " + "".join(f"{prefix}{c}".rjust(cell) for c in columns)]
    for b in blocks:
        values = (cells.get((b, c)) for c in columns)
        rows.append(
            f"{b:>5} " + "".join(("." if v is None or v == 0 else f"{v:.0f}").rjust(cell) for v in values)
        )
    return rows
