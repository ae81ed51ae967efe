"""Per-device accounting of the synchronous modes: busy vs waiting at a barrier (the stall fraction of AMoE
Figure 4b), idle polling, iterations and their wall times, rows per expert per block."""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager

import torch

RECENT_ITERATIONS = 4096  # iteration times kept for stats(); older ones only count in the totals


class SyncStats:
    """Wall seconds by state; written by the loop thread, read by any thread through snapshot()."""

    def __init__(self, num_blocks: int, num_experts: int) -> None:
        self._lock = threading.Lock()  # snapshot() copies the deque while the loop thread appends
        self.busy_s = 0.0  # running layers (attention, head, experts)
        self.wait_s = 0.0  # waiting at a barrier inside a working iteration
        self.idle_s = 0.0  # no device had work: polling between iterations
        self.iterations = 0
        self.polls = 0  # passes of the loop, idle ones included: its progress, which liveness checks
        self.dropped = 0  # barrier messages dropped (no tag row, or a duplicate)
        self.iteration_wall_s = 0.0
        self.rebalances = 0  # stop-the-world rebalances (amoe.runtime.sync.rebalance)
        self.rebalance_s = 0.0  # wall seconds they paused this device
        self.moved_bytes = 0  # weight bytes they brought to this device
        self.recent: deque[tuple[float, int]] = deque(maxlen=RECENT_ITERATIONS)  # (wall seconds, rows)
        self.expert_rows = torch.zeros(num_blocks, num_experts, dtype=torch.int64)  # rows run per (block, e)

    @contextmanager
    def busy(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._add("busy_s", time.perf_counter() - start)

    @contextmanager
    def waiting(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._add("wait_s", time.perf_counter() - start)

    def add_idle(self, seconds: float) -> None:
        with self._lock:
            self.idle_s += seconds
            self.polls += 1

    def add_wait(self, seconds: float) -> None:
        self._add("wait_s", seconds)

    def end_iteration(self, wall_s: float, rows: int) -> None:
        with self._lock:
            self.iterations += 1
            self.polls += 1
            self.iteration_wall_s += wall_s
            self.recent.append((wall_s, rows))

    def add_rebalance(self, seconds: float, moved_bytes: int) -> None:
        with self._lock:
            self.rebalances += 1
            self.rebalance_s += seconds
            self.moved_bytes += moved_bytes

    def add_dropped(self, count: int) -> None:
        with self._lock:
            self.dropped += count

    def count_expert_rows(self, block: int, expert: int, rows: int) -> None:
        self.expert_rows[block, expert] += rows  # loop thread only; snapshot() copies

    def snapshot(self) -> dict:
        """busy/wait/idle seconds, stall fraction = wait / (busy + wait), iterations, recent iteration times."""
        with self._lock:
            busy, wait = self.busy_s, self.wait_s
            return {
                "busy_s": busy,
                "wait_s": wait,
                "idle_s": self.idle_s,
                "stall_fraction": wait / (busy + wait) if busy + wait > 0 else 0.0,
                "iterations": self.iterations,
                "polls": self.polls,
                "dropped": self.dropped,
                "iteration_wall_s": self.iteration_wall_s,
                "rebalances": self.rebalances,
                "rebalance_s": self.rebalance_s,
                "moved_bytes": self.moved_bytes,
                "iteration_s": [t for t, _ in self.recent],
                "iteration_rows": [n for _, n in self.recent],
                "expert_rows": self.expert_rows.tolist(),
            }

    def _add(self, name: str, seconds: float) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + seconds)
