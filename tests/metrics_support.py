"""Test-only helpers of the metrics tests: a Backend over InProcessCluster (virtual runtimes in one process, with
real `Engine.stats()` reports), a server process around it, and a steady load generator.

The live metrics test prefers the real `amoe serve` (runtime processes); it falls back to `python
tests/metrics_support.py serve ...` — the same coordinator (AmoeServer, create_app, /metrics) over this backend —
when the C++ core in this checkout has no ZeroMQ communicator yet.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from amoe.errors import EngineDeadError
from amoe.runtime.report import BATCH_ROWS_BUCKETS
from coordinator.backend import Backend, RankKV, TokenDelta

REPO = Path(__file__).resolve().parent.parent


class InProcBackend(Backend):
    """The coordinator's Backend over InProcessCluster; runtime_stats() reads every runtime's live report."""

    def __init__(self, model_dir: str | Path, num_attn_ranks: int, num_expert_ranks: int, **cluster: Any):
        self._args = (model_dir, num_attn_ranks, num_expert_ranks)
        self._cluster_kwargs = cluster
        self._block_size = cluster.get("block_size", 16)
        self.cluster: Any = None
        self.reporters: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._status = "created"
        self._wire_ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue] = {}  # wire id -> deltas; event-loop thread only
        self._ids: dict[str, tuple[int, int]] = {}  # request id -> (rank, wire id)

    @property
    def block_size(self) -> int:
        return self._block_size

    async def start(self) -> None:
        from amoe.runtime.inproc import InProcessCluster
        from amoe.runtime.report import RuntimeReporter

        self._loop = asyncio.get_running_loop()
        self.cluster = await asyncio.to_thread(InProcessCluster, *self._args, **self._cluster_kwargs)
        for runtime, (engine, executor) in enumerate(zip(self.cluster.engines, self.cluster.executors)):
            self.reporters.append(RuntimeReporter(runtime, engine, executor))
            if hasattr(executor, "on_output"):
                executor.on_output = self._post_outputs
        self.cluster.executors[:] = self.reporters  # the loops run the reporters, which run the executors
        self.cluster.start()
        self._status = "ok"

    @property
    def attention(self) -> list[Any]:
        return [self.reporters[r].executor for r in self.cluster.placement.attn_runtime]

    async def shutdown(self) -> None:
        if self.cluster is not None and self._status == "ok":
            self._status = "stopped"
            await asyncio.to_thread(self.cluster.stop)
        for queue in self._streams.values():
            queue.put_nowait(TokenDelta(finish_reason="abort"))

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: Any, rank: int = 0
    ) -> AsyncIterator[TokenDelta]:
        if self._status != "ok":
            raise EngineDeadError(f"not serving ({self._status})")
        wire_id = next(self._wire_ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[wire_id], self._ids[request_id] = queue, (rank, wire_id)
        self.attention[rank].add_request(wire_id, prompt_token_ids, sampling_params)
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.is_finished
                yield delta
        finally:
            self._streams.pop(wire_id, None)
            if not finished:
                self.abort(request_id)
            self._ids.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        rank, wire_id = self._ids.pop(request_id, (None, None))
        if wire_id is not None:
            self.attention[rank].abort(wire_id)

    def health(self) -> dict[str, Any]:
        return {"status": self._status}

    def kv_usage(self) -> list[RankKV]:
        if self.cluster is None:
            return []
        return [RankKV(ex.blocks.num_free_blocks, ex.blocks.num_total_blocks) for ex in self.attention]

    def runtime_stats(self) -> list[dict]:
        return [reporter.report() for reporter in self.reporters]

    def _post_outputs(self, outputs: list[tuple[int, list[int], str | None]]) -> None:
        # Called on a runtime's loop thread after a head step: hand the deltas to the event loop.
        self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[tuple[int, list[int], str | None]]) -> None:
        for wire_id, tokens, reason in outputs:
            queue = self._streams.get(wire_id)
            if queue is not None:
                queue.put_nowait(TokenDelta(list(tokens), reason))


def serve_inproc(argv: list[str]) -> int:
    """`amoe serve`'s coordinator over InProcBackend: same flags, same start-up line."""
    import argparse

    from amoe.config import add_config_flags, config_from_args
    from amoe.log import setup_logging
    from amoe.serve import AmoeServer
    from amoe.tokenizer import Tokenizer
    from coordinator.validation import ModelInfo

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    config = config_from_args(parser.parse_args(argv))
    setup_logging()

    class Server(AmoeServer):
        async def _start_backend(self, model_dir: Path):
            par, cache = self.config.parallel, self.config.cache
            backend = InProcBackend(
                model_dir,
                par.attn_ranks,
                par.expert_ranks,
                kv_blocks=cache.num_blocks,
                block_size=cache.block_size,
            )
            self.backend = backend
            await backend.start()
            cfg = backend.cluster.model_config
            max_len = min(cfg.max_position_embeddings, cache.num_blocks * cache.block_size)
            return Tokenizer.from_dir(model_dir), backend, ModelInfo(model_dir.name, max_len, cfg.vocab_size)

    asyncio.run(Server(config).run())
    return 0


def cluster_available() -> bool:
    """Whether `amoe serve` can start runtime processes in this checkout (the C++ core has the communicator)."""
    from amoe import _core

    return (REPO / "amoe" / "backends" / "cluster.py").exists() and hasattr(_core, "ZmqCommunicator")


class ServerProcess:
    """A coordinator process (the real `amoe serve`, or the in-process fallback); `url` once it listens."""

    def __init__(self, model_dir: Path, *flags: str, real: bool | None = None) -> None:
        self.real = cluster_available() if real is None else real
        prog = ["-m", "amoe", "serve"] if self.real else [str(REPO / "tests" / "metrics_support.py"), "serve"]
        cmd = [sys.executable, *prog, "--model", str(model_dir), "--port", "0", *flags]
        env = {**os.environ, "AMOE_LOG_LEVEL": "INFO", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = ""

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for_url(self, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                match = re.search(r"amoe serve: listening on (http://\S+)$", line)
                if match:
                    self.url = match.group(1)
                    return self.url
            if self.proc.poll() is not None:
                raise AssertionError("server exited early:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.05)
        raise AssertionError("no listening line:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the runtimes it spawned too
                self.proc.wait(10)


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
    requests = 120  # the request metrics: a fixed set
    return per_runtime * runtimes + queues + routing + 2 * num_attn + requests


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


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    sys.exit(serve_inproc(sys.argv[2:]))
