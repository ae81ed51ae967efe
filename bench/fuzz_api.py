"""Fuzz a live `amoe serve` (2 attention + 2 expert runtimes, the tiny model) from its own OpenAPI schema: at
least 1000 generated requests, none may get a 5xx; the server must be healthy at the end with every KV block free.

Run: .venv/bin/python bench/fuzz_api.py [--examples 1200] [--seed 0]
"""

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import httpx

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.testing.fuzz import fuzz
from amoe.testing.servers import ServerProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Hypothesis may stop a strategy short of max_examples; 1200 asked for gives well over the 1000 required.
    ap.add_argument("--examples", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model("tiny", Path(tmp) / "fuzz-model", seed=0)
        # A short context keeps every generated request cheap (at most 64 tokens), whatever max_tokens it asks.
        config = AmoeConfig().replace(
            model={"path": str(model), "max_model_len": 64}, parallel={"attn_ranks": 2, "expert_ranks": 2}
        )
        with ServerProcess(config) as url:
            report = fuzz(url, args.examples, seed=args.seed)
            health, kv_free = settle(url)
    print(f"{'status':>8} {'responses':>10}")
    for status, n in sorted(report.by_status.items()):
        print(f"{status:>8} {n:>10}")
    for line in report.server_errors[:20]:
        print("5xx:", line)
    ok = report.ok and health == "ok" and kv_free and report.requests >= args.examples * 5 // 6
    print(
        json.dumps(
            {
                "requests": report.requests,
                "server_errors": len(report.server_errors),
                "by_status": {str(k): v for k, v in sorted(report.by_status.items())},
                "health_at_end": health,
                "kv_all_free_at_end": kv_free,
                "seconds": round(report.seconds, 1),
                "ok": ok,
            }
        )
    )
    if not ok:  # a failed fuzz run fails the command (and `make bench`)
        raise SystemExit(1)


def settle(url: str, timeout_s: float = 30.0) -> tuple[str, bool]:
    """The server's status once every request is done, and whether every KV block is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = httpx.get(url + "/health", timeout=10).json()
        free = all(kv["free_blocks"] == kv["total_blocks"] for kv in report.get("kv", []))
        if (free and report.get("running") == 0) or time.monotonic() > deadline:
            return report["status"], free
        time.sleep(0.2)


if __name__ == "__main__":
    main()
