"""The runtime report of docs/CONTRACTS.md ("Runtime stats"): `Engine.stats()` plus what only Python knows.

`RuntimeReporter` wraps a runtime's executor (it is itself an executor, so `run_loop(engine, reporter, ...)`):
it times each layer (`busy_s`) and counts the rows of each executed batch (`batch_rows`, a histogram); an attention
rank's routing counts (`routed`) and KV use come from its executor. `report()` is cheap and may be called from another thread (the
heartbeat). On the wire the layer maps travel flattened (`amoe.wire.flatten_stats`).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from typing import Any

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
        self.attention = executor if isinstance(executor, AttentionExecutor) else None
        # A new value per start: the coordinator tells a restart from a counter that merely stalled.
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self._started = time.monotonic()
        self._busy_s = 0.0
        kinds = ("attn", "head") if self.attention is not None else ("expert",)
        self._hist = {kind: [0] * (len(BATCH_ROWS_BUCKETS) + 1) for kind in kinds}  # last: overflow
        self._hist_sum = dict.fromkeys(kinds, 0)
        # Guards the counters above: the loop thread writes them, the heartbeat thread reads a consistent set.
        self._lock = threading.Lock()

    def run(self, batch: core.Batch):
        """Run the wrapped executor on `batch`, counting its time and rows."""
        start = time.perf_counter()
        out = self.executor.run(batch)
        busy = time.perf_counter() - start
        rows = int(batch.request_ids.shape[0])
        with self._lock:
            self._busy_s += busy
            self._hist[batch.kind][bisect.bisect_left(BATCH_ROWS_BUCKETS, rows)] += 1
            self._hist_sum[batch.kind] += rows
        return out

    def report(self) -> dict[str, Any]:
        """The CONTRACTS runtime report, plus `incarnation` and `batch_rows`."""
        stats = self.engine.stats()
        with self._lock:
            stats.update(
                runtime=self.runtime,
                role="attention" if self.attention is not None else "expert",
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
        if self.attention is not None:
            stats["routed"] = self.attention.routed.tolist()  # only grows: a racing read sees old or new
            blocks = self.attention.requests.blocks
            stats["kv_total_blocks"] = blocks.num_total_blocks
            stats["kv_used_blocks"] = blocks.num_total_blocks - blocks.num_free_blocks
        if self.comm is not None:
            stats["comm"] = self.comm.stats()
        return stats
