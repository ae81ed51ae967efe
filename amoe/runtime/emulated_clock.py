"""The emulated clock of one GPU: hold the runtime for a predicted duration × time scale, and account busy time.

Holding sleeps rather than spins: 8–16 runtimes share 2 cores, and a spinning runtime would steal the CPU the
others need. time.sleep overshoots by ~0.1–0.2 ms here (measured: median 103–160 µs for 0.5–30 ms sleeps), so
the clock asks for less than the target by its running estimate of the overshoot and carries what is left over
as debt into the next hold: single steps jitter by ~0.1 ms of wall time, the long-run busy time stays exact.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

MAX_DEBT_S = 0.05  # wall seconds of over- or under-sleep carried into later holds


@dataclass
class KindStats:
    """Per step kind (attention, head, expert): steps, rows and emulated busy seconds."""

    steps: int = 0
    rows: int = 0
    busy_s: float = 0.0


class EmulatedClock:
    """One emulated GPU's time: hold(seconds) blocks for seconds × time_scale of wall time."""

    def __init__(
        self,
        time_scale: float = 1.0,
        spin_s: float = 0.0,
        speed: float = 1.0,
        jitter=None,
        wall: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.time_scale = time_scale
        # Wall seconds and how to wait for them: the machine's, or a test's fake that advances when slept on.
        self._wall, self._sleep_for = wall, sleep
        # This GPU's step-time variance (amoe.perf.model.variance): its fixed slowdown, and a callable giving each
        # step's jitter factor (None: none).
        self.speed, self.jitter = speed, jitter
        self.spin_s = spin_s  # wall seconds to busy-wait at the end of a hold; 0 on shared machines
        self._start = wall()
        self._overshoot = 1e-4  # running estimate of time.sleep's lateness, seconds of wall time
        self._debt = 0.0  # wall seconds the previous holds ran over (negative: ended early)
        self._held_wall = 0.0
        # Wall seconds of the steps as this GPU runs them (cost model × speed × jitter × time scale), whatever the
        # host's sleeps and the Python around them took: what a barrier's peers wait for on this GPU.
        self.gpu_wall_s = 0.0
        self._kinds: dict[str, KindStats] = defaultdict(KindStats)
        self._lock = threading.Lock()  # stats() may be read from another thread while the loop holds

    def now(self) -> float:
        """Emulated seconds since the clock started."""
        return (self._wall() - self._start) / self.time_scale

    def hold(self, seconds: float, kind: str = "step", rows: int = 0) -> None:
        """Block for `seconds` of emulated time (seconds × time_scale of wall time) and account it as busy;
        `seconds` is the cost model's, which this GPU's speed and the step's jitter stretch or shrink."""
        # float(): a numpy scalar from the cost model would reach the runtime report's encoder.
        seconds = float(seconds) * self.speed * (self.jitter() if self.jitter is not None else 1.0)
        with self._lock:
            stats = self._kinds[kind]
            stats.steps += 1
            stats.rows += rows
            stats.busy_s += seconds
        self.gpu_wall_s += seconds * self.time_scale
        if seconds > 0:
            self._held_wall += self._sleep(seconds * self.time_scale)

    def stats(self) -> dict:
        """Emulated busy seconds per kind and in total, emulated elapsed time, and sleep accuracy."""
        with self._lock:
            kinds = {k: vars(s).copy() for k, s in self._kinds.items()}
        busy = sum(k["busy_s"] for k in kinds.values())
        elapsed = self.now()
        return {
            "time_scale": self.time_scale,
            "elapsed_s": elapsed,
            "busy_s": busy,
            "utilization": busy / elapsed if elapsed > 0 else 0.0,
            "held_wall_s": self._held_wall,
            "kinds": kinds,
        }

    def _sleep(self, wall_s: float) -> float:
        """Sleep ~wall_s minus carried debt; returns the wall time actually spent."""
        start = self._wall()
        target = max(0.0, wall_s - self._debt)
        deadline = start + target
        ask = target - self._overshoot - self.spin_s
        if ask > 0:
            self._sleep_for(ask)
            late = self._wall() - (start + ask)
            self._overshoot += 0.1 * (late - self._overshoot)  # EWMA: adapts to the machine's load
        while self.spin_s and self._wall() < deadline:
            pass
        spent = self._wall() - start
        # Bounded so one descheduled hold (a loaded machine) cannot shorten the next many holds to zero.
        self._debt = min(max(self._debt + spent - wall_s, -MAX_DEBT_S), MAX_DEBT_S)
        return spent
