"""The runtime report of docs/CONTRACTS.md ("Runtime stats"): `Engine.stats()` plus what only Python knows.

`RuntimeReporter` wraps a runtime's executor (it is itself an executor, so `run_loop(engine, reporter, stop)`):
it times each layer (`busy_s`), counts the tokens the router sends to each (block, expert) (`routed`) and the rows
of each executed batch (`batch_rows`, a histogram). `report()` is cheap and may be called from another thread (the
heartbeat). On the wire the layer maps travel flattened (`amoe.wire.flatten_stats`).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from typing import Any

import torch

from amoe import core
from amoe.runtime.executors import AttentionExecutor

# Upper bounds of the rows-per-batch histogram; attn_cap / expert_cap default to 256 / 512.
BATCH_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class RuntimeReporter:
    """An executor wrapper that keeps the counters of the runtime report."""

    def __init__(self, runtime: int, engine: core.Engine, executor: Any, comm: Any = None) -> None:
        self.runtime = runtime
        self.engine = engine
        self.executor = executor
        self.comm = comm
        self.is_attention = isinstance(executor, AttentionExecutor)
        # A new value per start: the coordinator tells a restart from a counter that merely stalled.
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self._started = time.monotonic()
        self._num_blocks = executor.cfg.num_blocks if self.is_attention else None
        num_experts = executor.cfg.num_experts if self.is_attention else 0
        # The attention executor may count routing itself (`routed`); then it is read, not counted twice.
        self._own_routed = self.is_attention and not hasattr(executor, "routed")
        self._routed = torch.zeros(self._num_blocks or 0, num_experts, dtype=torch.int64)  # [blocks, experts]
        self._busy_s = 0.0
        kinds = ("attn", "head") if self.is_attention else ("expert",)
        self._hist = {kind: [0] * (len(BATCH_ROWS_BUCKETS) + 1) for kind in kinds}  # last: overflow
        self._hist_sum = dict.fromkeys(kinds, 0)
        # Guards the counters above: the loop thread writes them, the heartbeat thread reads a consistent set.
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        """Everything else is the wrapped executor's (add_request, abort, blocks...): a drop-in replacement."""
        if name == "executor":  # not set yet (during __init__)
            raise AttributeError(name)
        return getattr(self.executor, name)

    def run(self, batch: core.Batch):
        """Run the wrapped executor on `batch`, counting its time, rows and routing."""
        start = time.perf_counter()
        out = self.executor.run(batch)
        busy = time.perf_counter() - start
        rows = int(batch.request_ids.shape[0])
        kind = self._kind(batch)
        routed = None
        if kind == "attn" and self._own_routed:  # out = (residual, moe_input, topk_ids [N, K], topk_weights)
            routed = torch.bincount(out[2].reshape(-1), minlength=self._routed.shape[1])  # [experts]
        with self._lock:
            self._busy_s += busy
            self._hist[kind][bisect.bisect_left(BATCH_ROWS_BUCKETS, rows)] += 1
            self._hist_sum[kind] += rows
            if routed is not None:
                self._routed[batch.block] += routed
        return out

    def report(self) -> dict[str, Any]:
        """The CONTRACTS runtime report, plus `incarnation` and `batch_rows`."""
        stats = self.engine.stats()
        with self._lock:
            stats.update(
                runtime=self.runtime,
                role="attention" if self.is_attention else "expert",
                incarnation=self.incarnation,
                busy_s=self._busy_s,
                # Read with busy_s: Δbusy_s / Δuptime_s between two reports is the busy fraction, exact however
                # late the reports travel (a scraper's own clock would add the heartbeat period's jitter).
                uptime_s=time.monotonic() - self._started,
                batch_rows={
                    "buckets": list(BATCH_ROWS_BUCKETS),
                    "counts": {kind: list(counts) for kind, counts in self._hist.items()},
                    "sum": dict(self._hist_sum),
                },
            )
            if self._own_routed:
                stats["routed"] = self._routed.tolist()
        if self.is_attention:
            if not self._own_routed:  # its counts only grow: a read racing an update sees the old or new one
                stats["routed"] = self.executor.routed.tolist()
            blocks = self.executor.blocks
            stats["kv_total_blocks"] = blocks.num_total_blocks
            stats["kv_used_blocks"] = blocks.num_total_blocks - blocks.num_free_blocks
        if self.comm is not None:
            stats["comm"] = self.comm.stats()
        return stats

    def _kind(self, batch: core.Batch) -> str:
        if batch.kind == "expert":
            return "expert"
        return "head" if batch.block == self._num_blocks else "attn"
