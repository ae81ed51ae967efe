"""Test-only helpers of the metrics tests: the real `amoe serve` as a child process, a steady load generator, and
prepared runtime reports for a backend that hands them out."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from factories import config_of

from amoe.runtime.report import BATCH_ROWS_BUCKETS
from amoe.testing.servers import ServerProcess
from coordinator.requests.backend import RankKV

REPO = Path(__file__).resolve().parent.parent


def serve_model(model_dir: Path, *flags: str) -> ServerProcess:
    """The real `amoe serve` of `model_dir` as a child process in a session of its own (its runtimes with it),
    started; `wait_for_url()` once it listens."""
    env = {"AMOE_LOG_LEVEL": "INFO", "PYTHONPATH": str(REPO)}
    config = config_of("--model", str(model_dir), *flags)
    return ServerProcess(config, startup_timeout_s=90, env=env, new_session=True, cwd=str(REPO)).start()


class FakeBackend:
    """Hands out prepared reports, as a cluster backend hands out its runtimes' latest heartbeats."""

    def __init__(self, reports: list[dict], num_ranks: int = 1) -> None:
        self.reports = reports
        self.num_ranks = num_ranks

    def runtime_stats(self) -> list[dict]:
        return copy.deepcopy(self.reports)

    def kv_usage(self) -> list[RankKV]:
        return [RankKV(free_blocks=10, total_blocks=16)] * self.num_ranks


def attention_report(runtime=0, incarnation="a", scale=1, num_blocks=2, num_experts=2, comm=True) -> dict:
    layers = [("attn", b, 0) for b in range(num_blocks + 1)]
    report = {
        "runtime": runtime,
        "role": "attention",
        "incarnation": incarnation,
        "depth": {layer: 1 for layer in layers},
        "batches": {layer: 2 * scale for layer in layers},
        "rows": {layer: 5 * scale for layer in layers},
        "pool_entries": 1,
        "pool_parts": 3,
        "tokens_in": 10 * scale,
        "tokens_out": 10 * scale,
        "messages_out": 4 * scale,
        "dispatch_pending": 0,
        "errors": 0,
        "dropped": {"bad_message": 0, "misrouted": scale, "bad_row": 0, "duplicate": 0},
        "idle_s": 1.5 * scale,
        "busy_s": 0.5 * scale,
        "kv_used_blocks": 6,
        "kv_total_blocks": 16,
        "routed": [[3 * scale] * num_experts for _ in range(num_blocks)],
        "batch_rows": {
            "buckets": list(BATCH_ROWS_BUCKETS),
            "counts": {
                "attn": [scale] + [0] * len(BATCH_ROWS_BUCKETS),
                "head": [0] * (len(BATCH_ROWS_BUCKETS) + 1),
            },
            "sum": {"attn": scale, "head": 0},
        },
    }
    if comm:
        report["comm"] = {
            "plane": "inline", "messages_in": 4 * scale, "messages_out": 4 * scale, "bytes_in": 100 * scale,
            "bytes_out": 100 * scale, "dropped": {"garbage": 0, "truncated": scale, "version": 0, "inconsistent": 0},
            "timeouts": 0, "failed_peers": [],
        }  # fmt: skip
    return report


def series_bound(
    num_blocks: int, num_experts: int, num_attn: int, num_expert_ranks: int, per_layer: bool
) -> int:
    """What the docs promise: a constant per runtime, 3 per queue (or per runtime), routing per (block,) expert."""
    runtimes = num_attn + num_expert_ranks
    layers = num_attn * (num_blocks + 1) + num_blocks * num_experts
    # Up to 40 plain series per runtime, plus up to two histograms of 15 series (13 buckets, sum, count).
    per_runtime = 40 + 2 * 15
    queues = 3 * (layers if per_layer else runtimes)
    routing = num_experts * (num_blocks if per_layer else 1)
    # The live placement (aep): replicas per (block,) expert, balancedness per block (or one), a fixed dozen more.
    placement = routing + (num_blocks if per_layer else 1) + 12
    requests = 120  # the request metrics: a fixed set
    return per_runtime * runtimes + queues + routing + placement + 2 * num_attn + requests


class Load:
    """`clients` threads sending streamed completions back to back until stopped."""

    def __init__(self, url: str, model: str, clients: int = 4, max_tokens: int = 24) -> None:
        self._body = {
            "model": model,
            "prompt": "the expert queue",
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        self._url = url
        self._stop = threading.Event()
        self.completed = 0
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _client(self) -> None:
        with httpx.Client(base_url=self._url, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    with client.stream(
                        "POST", "/v1/completions", json={**self._body, "stream": True}
                    ) as reply:
                        reply.raise_for_status()
                        for _ in reply.iter_lines():
                            pass
                    self.completed += 1
                except httpx.HTTPError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.1)
