"""Runtime health, loss and replacement: the cluster manager's watchdog.

Every `_WATCH_S` it polls each runtime's process, the age of its last message (the control thread is alive) and of
its loop's last progress (the loop is alive: a heartbeat alone proves nothing), and whether control messages to it
are still being delivered. A runtime that died, stopped or cannot be reached is lost: it is killed if still there
and started again in the same role (self-healing, where the configuration can heal), while the restart budget
lasts; otherwise the cluster fails and its backend is told.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time

from coordinator.cluster.control_plane import ControlPlane
from coordinator.cluster.launcher import Launcher, exit_text
from coordinator.cluster.runtimes import ClusterEvents, RestartBudget, RuntimeProc

logger = logging.getLogger(__name__)

WATCH_S = 0.1  # how often processes are polled: a killed runtime is noticed within this


class RuntimeWatch:
    """Loss and replacement of the runtimes in `runtimes` (the cluster manager's table, shared)."""

    def __init__(
        self,
        runtimes: list[RuntimeProc],
        events: ClusterEvents,
        *,
        heals: bool,
        budget: RestartBudget,
        heartbeat_timeout_s: float,
        startup_timeout_s: float,
    ) -> None:
        self.runtimes = runtimes
        self._events = events
        self.heals = heals
        self.budget = budget
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.plane: ControlPlane | None = None  # set by the cluster manager's start(), with the launcher
        self.launch: Launcher | None = None
        self.started = (
            False  # every runtime served once: from now on a loss is healed or fatal, not a start error
        )
        self.stopping = False
        self.failure: str | None = None
        self.recoveries: list[float] = []  # seconds from each loss to its replacement serving

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            if not self.stopping and self.failure is None:
                self.check(time.monotonic())

    def check(self, now: float) -> None:
        """One watchdog pass."""
        self.plane.flush()
        undelivered = set(self.plane.overdue(self.heartbeat_timeout_s, now))
        self.launch.tick(now)  # multi-node: a silent node's runtimes end here, and are replaced below
        for r in self.runtimes:
            if r.retired:
                continue  # stopped on purpose (scaled in): its exit is no loss
            code = r.proc.poll()
            if code is not None:
                self.lost(r, f"{r.name} (pid {r.proc.pid}) {exit_text(code)}")
            elif r.lost is not None:
                if now - r.lost_at > self.startup_timeout_s:
                    self.lost(
                        r, f"{r.name}'s replacement did not start within {self.startup_timeout_s:.0f} s"
                    )
            elif r.identity in undelivered:
                self.lost(
                    r, f"{r.name}: control messages to it went undelivered for {self.heartbeat_timeout_s:g} s"
                )
            elif r.joining and r.endpoint is None and now - r.last_seen > self.startup_timeout_s:
                # A joiner loads no weights before its Hello (its replicas come by a rebalance, whose progress
                # is watched there): this bounds a process start, not a model load.
                self.lost(r, f"{r.name} did not say hello within {self.startup_timeout_s:.0f} s")
            elif (
                r.ready or (r.joining and r.endpoint is not None)
            ) and now - r.last_seen > self.heartbeat_timeout_s:
                self.lost(r, f"{r.name} (pid {r.proc.pid}) sent nothing for {now - r.last_seen:.1f} s")
            elif r.ready and now - r.progressed > self.heartbeat_timeout_s:
                # Heartbeats come from the control thread; only the loop's own counter shows it still runs.
                self.lost(
                    r,
                    f"{r.name} (pid {r.proc.pid}): its loop made no progress for {now - r.progressed:.1f} s",
                )

    def lost(self, runtime: RuntimeProc, reason: str) -> None:
        """A runtime died, stopped, failed or cannot be reached: replace it while the budget lasts, else the
        cluster fails."""
        if self.failure is not None or self.stopping or runtime.retired:
            return
        # A joiner never served: its join fails, nothing is healed (coordinator/cluster/scaling.py).
        if runtime.joining:
            if runtime.join_error is not None:
                return  # told already
            logger.warning("%s: its join failed", reason)
            runtime.join_error = reason
            if runtime.proc.poll() is None:
                runtime.proc.kill()
            _reap_later(runtime.proc)
            if self.plane is not None:
                self.plane.forget(runtime.identity)
            return
        if not self.started or not self.heals or not self.budget.take():
            if runtime.proc.poll() is None:
                runtime.proc.kill()  # lost for good: a stopped or wedged process would not stop when asked
            if self.started and self.heals:
                reason += f"; no restart left ({self.budget.limit} in {self.budget.window_s:g} s already)"
            return self.fail(reason)
        logger.warning("%s: replacing it", reason)
        first = runtime.lost is None
        runtime.lost, runtime.lost_at = reason, runtime.lost_at if not first else time.monotonic()
        runtime.ready, runtime.stats = False, None
        dropped = self.plane.forget(runtime.identity) if self.plane is not None else 0
        if dropped:  # they were for the old process; what still matters is sent again (Welcome, re-admission)
            logger.info("%s: %d undelivered control messages dropped with it", runtime.name, dropped)
        if runtime.proc.poll() is None:
            runtime.proc.kill()  # a stopped (SIGSTOP) or wedged process too: SIGKILL needs no cooperation
        _reap_later(runtime.proc)
        runtime.spawned += 1
        runtime.proc = self.launch.spawn(runtime.id, runtime.role, generation=runtime.spawned)
        runtime.last_seen = runtime.progressed = time.monotonic()
        runtime.polls = 0
        if first:
            self._events.on_lost(runtime, reason)

    def rejoined(self, runtime: RuntimeProc) -> None:
        seconds = time.monotonic() - runtime.lost_at
        logger.info("%s is back (pid %d) after %.1f s", runtime.name, runtime.proc.pid, seconds)
        runtime.lost = None
        runtime.restarts += 1
        self.recoveries.append(seconds)
        self._events.on_rejoined(runtime)

    def fail(self, reason: str) -> None:
        if self.failure is not None or self.stopping:
            return
        self.failure = reason
        # During start-up `amoe serve` reports it as its one error line; afterwards the log is the report.
        logger.log(logging.ERROR if self.started else logging.DEBUG, "%s", reason)
        self._events.on_death(reason)


def _reap_later(proc: subprocess.Popen) -> None:
    """Wait for a killed process off the event loop, so it leaves no zombie."""
    if proc.poll() is None:
        asyncio.get_running_loop().run_in_executor(None, proc.wait)
