"""Per-device accounting of the synchronous modes: busy vs waiting at a barrier (the stall fraction of AMoE
Figure 4b), idle polling, iterations and their wall times, rows per expert per block, and the barrier tax: the
time this device's steps waited for a slower peer's (docs/simulation.md "The barrier tax").

A step, as the barrier tax counts it, is the GPU's: on emulated GPUs what their clocks held (`gpu_wall_s`), not the
wall time around the holds. That wall time also holds the emulator's own Python (the routing override, batch
assembly) and, with 8-16 runtimes on 2 host cores, their wait for a core, which no GPU's step holds; its spread
across the runtimes lengthened every wait (at twice the time scale, where it is half the share of a step, the
measured idle fraction fell from 1.25 to 1.05 of the simulation's on 8 GPUs: experiments/2026-11-29-barrier-tax).
Without a GPU clock (torch executors) the step is the wall time of its busy sections."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager

import torch

from amoe.runtime.emulated_clock import EmulatedClock

RECENT_ITERATIONS = 4096  # iteration times kept for stats(); older ones only count in the totals


def gpu_clock(*executors) -> Callable[[], float] | None:
    """The device's GPU seconds so far, in wall time: the sum over its executors' emulated clocks (an attention
    executor's compute's, an expert executor's own); None when none keeps one."""
    clocks = []
    for executor in executors:
        clock = getattr(getattr(executor, "compute", executor), "clock", None)
        if isinstance(clock, EmulatedClock) and all(clock is not c for c in clocks):
            clocks.append(clock)
    if not clocks:
        return None
    return lambda: sum(c.gpu_wall_s for c in clocks)


class SyncStats:
    """Wall seconds by state; written by the loop thread, read by any thread through snapshot(). `gpu_wall_s`:
    the device's GPU seconds so far in wall time (its emulated clocks' sum), which a step is measured by; None:
    the wall time of its busy sections."""

    def __init__(
        self, num_blocks: int, num_experts: int, gpu_wall_s: Callable[[], float] | None = None
    ) -> None:
        self._lock = threading.Lock()  # snapshot() copies the deque while the loop thread appends
        self.busy_s = 0.0  # running layers (attention, head, experts)
        self.wait_s = 0.0  # waiting at a barrier inside a working iteration
        self.idle_s = 0.0  # no device had work: polling between iterations
        # Of the waits at barriers, the part a slower peer's step caused: at each barrier the slowest peer's step
        # before it less this device's own (its attention step or head, its expert step), excluding the transfer.
        self.barrier_idle_s = 0.0
        self.attention_idle_s = 0.0  # ... at the barriers after attention steps and heads
        self._step_s = 0.0  # loop thread only: busy seconds since the last take_step()
        self._gpu_wall_s = gpu_wall_s
        self._gpu_mark = (
            gpu_wall_s() if gpu_wall_s is not None else 0.0
        )  # loop thread: its value at that take
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
            seconds = time.perf_counter() - start
            self._step_s += seconds
            self._add("busy_s", seconds)

    def take_step(self) -> float:
        """The busy seconds since the last call (this device's step before a barrier), and start counting anew:
        the GPU's where it has a clock (module docstring). Loop thread."""
        seconds, self._step_s = self._step_s, 0.0
        if self._gpu_wall_s is not None:
            mark = self._gpu_wall_s()
            seconds, self._gpu_mark = mark - self._gpu_mark, mark
        return seconds

    def waited_for_slower(self, own_s: float, slowest_s: float, attention: bool) -> None:
        """At a barrier: the slowest peer's step took `slowest_s`, this device's `own_s` (both measured by their
        devices before they sent); the difference is its wait for a slower step."""
        idle = max(0.0, slowest_s - own_s)
        with self._lock:
            self.barrier_idle_s += idle
            if attention:
                self.attention_idle_s += idle

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
                "barrier_idle_s": self.barrier_idle_s,
                "attention_idle_s": self.attention_idle_s,
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
