"""The cost of crossing hosts: the same workload on one host and on three namespaced hosts (tests' network
namespaces on a bridge: TCP + CURVE between runtimes instead of ipc), side by side in one run.

Layout: 1 attention + 2 expert runtimes of the tiny model. One host: all three on this machine. Three hosts: the
coordinator and the attention runtime on host 0, one expert runtime on each other host. A closed loop of W workers
streams greedy requests for S seconds per round; rounds alternate (1 host, 3 hosts, 1 host, ...) so drift on this
shared machine hits both alike. Every text is checked against the single-process reference.

Needs root (network namespaces). Run: .venv/bin/python bench/multinode.py [--seconds 30] [--rounds 2]
Prints a table and a final JSON line: tokens/s and ITL per setup, and the 3-host / 1-host ratios.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.testing.checked_load import ClosedLoop, reference_texts
from amoe.testing.netns import Hosts, MultiHost, write_secret
from amoe.testing.servers import ServerProcess

MAX_TOKENS = 32
PROMPTS = [[1, 3 + i, 50 + 11 * i, 9, 200 + i] for i in range(16)]


def measure(url: str, references: list[str], seconds: float, workers: int) -> dict:
    with ClosedLoop(url, "bench", PROMPTS, references, MAX_TOKENS, workers=workers) as load:
        time.sleep(seconds)
        start, end = load.outcomes[0].started if load.outcomes else 0.0, time.monotonic()
    done = [o for o in load.outcomes if o.completed and o.ended <= end]
    tokens = sum(len(o.token_times) for o in done)
    gaps = [b - a for o in done for a, b in zip(o.token_times, o.token_times[1:])]
    return {
        "tokens_per_s": tokens / max(1e-9, end - start),
        "itl_ms_median": 1e3 * statistics.median(gaps) if gaps else None,
        "itl_ms_p99": 1e3 * statistics.quantiles(gaps, n=100)[98] if len(gaps) > 100 else None,
        "completed": len(done),
        "failed": len(load.failed),
        "mismatched": len(load.mismatched),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds per round and setup")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8, help="concurrent streams")
    args = ap.parse_args()
    if not Hosts.available():
        raise SystemExit("bench/multinode.py needs root and iproute2 (network namespaces)")
    results: dict[str, list[dict]] = {"one_host": [], "three_hosts": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model("tiny", Path(tmp) / "bench", seed=0)
        references = reference_texts(str(model), PROMPTS, MAX_TOKENS)
        secret = write_secret(Path(tmp) / "secret", "b" * 64)
        for _ in range(args.rounds):
            config = AmoeConfig().replace(
                model={"path": str(model)}, parallel={"attn_ranks": 1, "expert_ranks": 2}
            )
            with ServerProcess(config) as url:
                results["one_host"].append(measure(url, references, args.seconds, args.workers))
            with Hosts(3) as hosts:
                cluster = MultiHost(hosts, model, secret)
                try:
                    results["three_hosts"].append(
                        measure(cluster.url, references, args.seconds, args.workers)
                    )
                finally:
                    cluster.stop()
    summary = {name: _median(runs) for name, runs in results.items()}
    one, three = summary["one_host"], summary["three_hosts"]
    out = {
        "bench": "multinode",
        "rounds": args.rounds,
        "seconds": args.seconds,
        "workers": args.workers,
        **{f"{name}_{k}": v for name, runs in summary.items() for k, v in runs.items()},
        "tokens_per_s_ratio": _ratio(three["tokens_per_s"], one["tokens_per_s"]),
        "itl_median_ratio": _ratio(three["itl_ms_median"], one["itl_ms_median"]),
        "all_exact": all(
            r["mismatched"] == 0 and r["failed"] == 0 for runs in results.values() for r in runs
        ),
    }
    print(f"{'setup':<12} {'tokens/s':>10} {'ITL p50 ms':>11} {'ITL p99 ms':>11}")
    for name, r in summary.items():
        print(
            f"{name:<12} {r['tokens_per_s']:>10.1f} {_fmt(r['itl_ms_median']):>11} {_fmt(r['itl_ms_p99']):>11}"
        )
    print(json.dumps(out))
    if not out["all_exact"]:  # a lost or wrong answer fails the command
        raise SystemExit(1)


def _median(runs: list[dict]) -> dict:
    keys = ("tokens_per_s", "itl_ms_median", "itl_ms_p99")
    med = {k: statistics.median([r[k] for r in runs if r[k] is not None] or [0.0]) for k in keys}
    med.update({k: sum(r[k] for r in runs) for k in ("completed", "failed", "mismatched")})
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in med.items()}


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
