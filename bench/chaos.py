"""Chaos under a steady request rate: 2 attention + 3 expert runtimes (the tiny model) serve streaming greedy
requests whose every answer is checked against the single-process reference, while every ~10 s a runtime of either
kind is killed (SIGKILL), and every fifth fault is a runtime stopped (SIGSTOP) for 20 s instead.

Reports requests completed / failed / wrong, the time from each fault to the replacement serving and to the first
token after it (goal <= 10 s), and tokens/s before, during and after the faults.

Run: .venv/bin/python bench/chaos.py [--minutes 10] [--rate 4]
"""

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.testing.checked_load import OpenLoop, reference_texts
from amoe.testing.servers import ServerProcess

MAX_TOKENS = 64
PROMPTS = [[1, 3 + i, 50 + 11 * i, 9, 200 + i] for i in range(32)]
QUIET_S = 20.0  # before the first fault and after the last: the baselines


class HealthWatch:
    """Polls /health every 0.1 s: when each runtime's process changed and when it was ready again."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ready_at: dict[tuple[int, int], float] = {}  # (runtime, pid) -> first seen ready
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(0.1):
                try:
                    for r in client.get(f"{self.url}/health").json()["runtimes"]:
                        if r["ready"] and r["alive"]:
                            self.ready_at.setdefault((r["runtime"], r["pid"]), time.monotonic())
                except httpx.HTTPError:
                    continue

    def runtimes(self) -> list[dict]:
        return httpx.get(f"{self.url}/health", timeout=5).json()["runtimes"]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model("tiny", Path(tmp) / "chaos", seed=0)
        references = reference_texts(str(model), PROMPTS, MAX_TOKENS)
        config = AmoeConfig().replace(
            model={"path": str(model)},
            parallel={"attn_ranks": 2, "expert_ranks": 3},
            server={"max_restarts": 1000},
        )
        with ServerProcess(config) as url:
            watch = HealthWatch(url)
            faults = []
            start = time.monotonic()
            end = start + args.minutes * 60
            with OpenLoop(url, "chaos", PROMPTS, references, MAX_TOKENS, rate=args.rate) as load:
                time.sleep(QUIET_S)
                n = 0
                while time.monotonic() < end - QUIET_S - 20:
                    faults.append(fault(watch, rng, stop=n % 5 == 4, kind=("expert", "attention")[n % 2]))
                    n += 1
                    time.sleep(max(0.0, faults[-1]["at"] + 10 - time.monotonic()))
                last_fault = time.monotonic()
                time.sleep(max(0.0, end - time.monotonic()))
            health = httpx.get(f"{url}/health", timeout=10).json()
            watch.stop()
    report(load, faults, watch, start, last_fault, health)


def fault(watch: HealthWatch, rng: random.Random, stop: bool, kind: str) -> dict:
    victim = rng.choice([r for r in watch.runtimes() if r["role"] == kind])
    at = time.monotonic()
    if stop:
        os.kill(victim["pid"], signal.SIGSTOP)
        threading.Timer(20, lambda: _cont(victim["pid"])).start()
    else:
        os.kill(victim["pid"], signal.SIGKILL)
    return {
        "at": at,
        "runtime": victim["runtime"],
        "pid": victim["pid"],
        "kind": kind,
        "how": "stop" if stop else "kill",
    }


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # replaced (killed) meanwhile, as it should be
        os.kill(pid, signal.SIGCONT)


def report(
    load: OpenLoop, faults: list[dict], watch: HealthWatch, start: float, last_fault: float, health: dict
) -> None:
    tokens = sorted(t for o in load.outcomes for t in o.token_times)
    for f in faults:  # when its replacement was first seen ready, and the first token after that
        back = [
            t
            for (rt, pid), t in watch.ready_at.items()
            if rt == f["runtime"] and pid != f["pid"] and t > f["at"]
        ]
        f["replaced_s"] = min(back) - f["at"] if back else None
        after = next((t for t in tokens if back and t > min(back)), None)
        f["first_token_s"] = after - f["at"] if after is not None else None
    first_fault = faults[0]["at"] if faults else last_fault

    def rate(lo: float, hi: float) -> float:
        return sum(1 for t in tokens if lo <= t < hi) / max(hi - lo, 1e-9)

    end = max(tokens) if tokens else last_fault
    phases = {
        "before": rate(start + 5, first_fault),
        "during": rate(first_fault, last_fault),
        "after": rate(last_fault + 10, end),
    }
    print(f"{'fault':>6} {'how':>5} {'kind':>10} {'runtime':>8} {'replaced s':>11} {'first token s':>14}")
    for i, f in enumerate(faults):
        print(
            f"{i:>6} {f['how']:>5} {f['kind']:>10} {f['runtime']:>8} {_s(f['replaced_s']):>11} {_s(f['first_token_s']):>14}"
        )
    print(
        f"tokens/s before {phases['before']:.0f}, during {phases['during']:.0f}, after {phases['after']:.0f}"
    )
    kills = [f["first_token_s"] for f in faults if f["how"] == "kill" and f["first_token_s"] is not None]
    stops = [f["first_token_s"] for f in faults if f["how"] == "stop" and f["first_token_s"] is not None]
    summary = {
        "requests": len(load.outcomes),
        "completed": sum(o.completed for o in load.outcomes),
        "failed": len(load.failed),
        "wrong_text": len(load.mismatched),
        "kills": sum(f["how"] == "kill" for f in faults),
        "stops": sum(f["how"] == "stop" for f in faults),
        "replaced_s": _dist([f["replaced_s"] for f in faults if f["replaced_s"] is not None]),
        "kill_to_first_token_s": _dist(kills),
        "stop_to_first_token_s": _dist(
            stops
        ),  # a stopped runtime is noticed only after the heartbeat timeout
        "tokens_per_s": {k: round(v, 1) for k, v in phases.items()},
        "health_at_end": health["status"],
        "kv_all_free_at_end": all(kv["free_blocks"] == kv["total_blocks"] for kv in health["kv"]),
    }
    summary["ok"] = (
        summary["failed"] == 0 and summary["wrong_text"] == 0 and summary["health_at_end"] == "ok"
        and summary["kv_all_free_at_end"] and all(t <= 10 for t in kills)
    )  # fmt: skip
    print(json.dumps(summary))
    if not summary["ok"]:  # a failed run fails the command
        raise SystemExit(1)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _dist(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)
    return {
        "n": len(values),
        "min": round(values[0], 2),
        "median": round(statistics.median(values), 2),
        "p90": round(values[int(0.9 * (len(values) - 1))], 2),
        "max": round(values[-1], 2),
    }


if __name__ == "__main__":
    main()
