"""Soak: steady load at ~80 % of the measured maximum for M minutes, no faults, on 2 attention + 3 expert runtimes
(the tiny model). Every response is checked against the single-process reference (a token lost or duplicated
shows as a different text); the RSS of every process is sampled each minute (its growth after warm-up must stay
within 5 %); p99 inter-token latency is reported per window, to show drift.

Run: .venv/bin/python bench/soak.py [--minutes 30]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.testing.checked_load import ClosedLoop, OpenLoop, reference_texts
from amoe.testing.servers import ServerProcess

MAX_TOKENS = 64
PROMPTS = [[1, 3 + i, 50 + 11 * i, 9, 200 + i] for i in range(32)]
PROBE_S = 45.0  # the closed-loop run that measures the maximum...
PROBE_WARM_S = 15.0  # ...counting completions only after this, once 48 requests are in flight
WARMUP_FRACTION = 0.15  # RSS growth is measured from the end of the warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--load", type=float, default=0.8, help="fraction of the measured maximum")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model("tiny", Path(tmp) / "soak", seed=0)
        references = reference_texts(str(model), PROMPTS, MAX_TOKENS)
        config = AmoeConfig().replace(
            model={"path": str(model)}, parallel={"attn_ranks": 2, "expert_ranks": 3}
        )
        server = ServerProcess(config)
        with server as url:
            probe_start = time.monotonic()
            with ClosedLoop(url, "soak", PROMPTS, references, MAX_TOKENS, workers=48) as probe:
                time.sleep(PROBE_S)
            # Steady state only: the first completions come a whole request latency after the start.
            window = (probe_start + PROBE_WARM_S, probe_start + PROBE_S)
            done = sum(1 for o in probe.outcomes if o.completed and window[0] <= o.ended <= window[1])
            max_rps = done / (PROBE_S - PROBE_WARM_S)
            rate = args.load * max_rps
            samples: list[tuple[float, dict[int, int]]] = []
            start = time.monotonic()
            with OpenLoop(url, "soak", PROMPTS, references, MAX_TOKENS, rate=rate) as load:
                while time.monotonic() - start < args.minutes * 60:
                    samples.append((time.monotonic() - start, rss(server.proc.pid)))
                    time.sleep(min(60.0, max(1.0, args.minutes * 60 / 30)))
            samples.append((time.monotonic() - start, rss(server.proc.pid)))
            health = httpx.get(f"{url}/health", timeout=10).json()
    report(load, probe, max_rps, rate, samples, start, args.minutes, health)


def rss(root_pid: int) -> dict[int, int]:
    """Resident bytes of the server and each of its runtimes."""
    root = psutil.Process(root_pid)
    out = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            out[proc.pid] = proc.memory_info().rss
        except psutil.Error:
            continue
    return out


def report(load, probe, max_rps, rate, samples, start, minutes, health) -> None:
    warm = [s for t, s in samples if t >= WARMUP_FRACTION * minutes * 60]
    first, last = (warm[0], warm[-1]) if warm else (samples[0][1], samples[-1][1])
    growth = {pid: last[pid] / first[pid] - 1 for pid in first if pid in last}
    windows = 5
    span = minutes * 60 / windows
    p99 = []
    for w in range(windows):
        lo, hi = start + w * span, start + (w + 1) * span
        gaps = [
            b - a for o in load.outcomes for a, b in zip(o.token_times, o.token_times[1:]) if lo <= b < hi
        ]
        p99.append(round(1000 * _quantile(gaps, 0.99), 1) if gaps else None)
    print(
        f"max {max_rps:.2f} req/s (closed loop, 48 in flight); soak at {rate:.2f} req/s for {minutes:g} min"
    )
    print(f"{'pid':>8} {'RSS MB start':>13} {'RSS MB end':>11} {'growth':>8}")
    for pid, g in sorted(growth.items()):
        print(f"{pid:>8} {first[pid] / 2**20:>13.1f} {last[pid] / 2**20:>11.1f} {100 * g:>7.1f}%")
    print("p99 ITL ms per window:", p99)
    tokens = sum(len(o.token_times) for o in load.outcomes)
    summary = {
        "minutes": minutes,
        "max_requests_per_s": round(max_rps, 2),
        "rate": round(rate, 2),
        "requests": len(load.outcomes),
        "lost": len(load.failed),
        "wrong_text": len(load.mismatched) + len(probe.mismatched),
        "tokens": tokens,
        "tokens_per_s": round(tokens / (minutes * 60), 1),
        "rss_growth_max_pct": round(100 * max(growth.values()), 2) if growth else None,
        "p99_itl_ms_per_window": p99,
        "health_at_end": health["status"],
    }
    summary["ok"] = (
        summary["lost"] == 0 and summary["wrong_text"] == 0 and health["status"] == "ok"
        and summary["rss_growth_max_pct"] is not None and summary["rss_growth_max_pct"] <= 5
    )  # fmt: skip
    print(json.dumps(summary))
    if not summary["ok"]:  # a failed run fails the command
        raise SystemExit(1)


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


if __name__ == "__main__":
    main()
