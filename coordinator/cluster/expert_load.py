"""Expert load over a sliding window of steps, from the attention runtimes' heartbeats (docs/rebalancing.md).

Each attention runtime reports, cumulatively, the tokens its router sent to each (block, expert) (`routed`) and the
head steps it ran (the batches of its layer ATTN (num_blocks, rank)). A step of the cluster is the mean of the
ranks' head steps; the window's load is what was routed since the snapshot `window_size` steps back. A replaced
runtime (another `incarnation` in its report) starts its counters from zero again; its old totals are kept, so
neither series ever goes back.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np


class ExpertLoad:
    """Routed tokens per (block, expert) over the last `window_size` steps."""

    def __init__(self, window_size: int, num_blocks: int, num_experts: int) -> None:
        self.window_size = window_size
        self.shape = (num_blocks, num_experts)
        self._routed: dict[
            int, list[np.ndarray]
        ] = {}  # runtime → [last raw, carried over from old processes]
        self._steps: dict[int, list[float]] = {}  # runtime → [last raw, carried over]
        self._incarnation: dict[int, Any] = {}  # runtime → its process's (RuntimeReporter.incarnation)
        # (steps, total) snapshots, ascending; the first is at or before the window's start (or the start itself)
        self._history: collections.deque[tuple[float, np.ndarray]] = collections.deque(
            [(0.0, np.zeros(self.shape))]
        )

    def report(self, runtime: int, stats: dict[str, Any]) -> None:
        """An attention runtime's heartbeat report (its layer maps unflattened)."""
        routed = np.asarray(stats.get("routed") or np.zeros(self.shape), dtype=np.float64)
        if routed.shape != self.shape:
            return  # not this model's grid: nothing to learn from it
        batches = stats.get("batches") or {}
        steps = float(
            sum(n for (kind, block, _), n in batches.items() if kind == "attn" and block == self.shape[0])
        )
        incarnation = stats.get("incarnation")
        restarted = self._incarnation.get(runtime, incarnation) != incarnation  # a new process of its rank
        self._incarnation[runtime] = incarnation
        _monotonic(self._routed, runtime, routed, restarted)
        _monotonic(self._steps, runtime, steps, restarted)
        now = self.steps
        if now > self._history[-1][0]:
            self._history.append((now, self.total()))
        while len(self._history) > 1 and self._history[1][0] <= now - self.window_size:
            self._history.popleft()

    @property
    def steps(self) -> float:
        """Steps so far: the attention ranks' head steps, on average."""
        if not self._steps:
            return 0.0
        return sum(last + carried for last, carried in self._steps.values()) / len(self._steps)

    def total(self) -> np.ndarray:
        """float64 [B, E]: every token routed so far."""
        out = np.zeros(self.shape)
        for last, carried in self._routed.values():
            out += last + carried
        return out

    def window(self) -> np.ndarray:
        """float64 [B, E]: the tokens routed over the last `window_size` steps (all of them while fewer)."""
        return self.total() - self._history[0][1]


def _monotonic(series: dict[int, list], runtime: int, raw, restarted: bool) -> None:
    """Keep `raw` as runtime's last value; a new process (another incarnation, or a value below the last one)
    counts from zero, so the old one's last value is carried over."""
    state = series.get(runtime)
    if state is None:
        series[runtime] = [raw, raw * 0]
        return
    last, carried = state
    if restarted or np.any(np.asarray(raw) < np.asarray(last)):
        carried = carried + last
    series[runtime] = [raw, carried]
