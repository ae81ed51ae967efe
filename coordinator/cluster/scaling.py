"""Elastic runtimes (docs/rebalancing.md "Scaling"): expert runtimes added or removed while serving, one at a time.

A **join** starts a runtime in a free slot through the cluster's launcher (the one start-up and self-healing use),
hosting nothing; it says Hello and gets the peer table, every other runtime is told where it is (Reconnect: the
same two messages a replacement gets), and once its links are built it says Ready. Then the live placement takes
it in: a rebalance to EPLB's map over the expert runtimes, this one included — its replicas' weights land (a
join), then the attention runtimes route rows to it (the switch). Nothing waits on a deadline that grows with the
model: before its Hello the joiner loads no weights (startup_timeout_s bounds a process start), after it its
heartbeats show it alive, and its weights load under the rebalance's own progress watch.

A **drain** is a rebalance to EPLB's map over the other expert runtimes: the leaving runtime's replicas join
elsewhere, the attention runtimes switch, every row it was sent is answered (the drain), and its weights are
freed. Only then is it told to stop; it is forgotten and its id becomes a free slot. A rebalance that fails leaves
the runtime serving, and the scale reports the failure: nothing is lost either way.

Everything runs on the API's event loop, one scale at a time; a scale, a rebalance or a replacement under way
refuses another (ScaleBusy).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from amoe import wire
from amoe.errors import RequestError
from amoe.placement import runtime_slots
from amoe.scaling import check_count, target_count
from coordinator.cluster.health import WATCH_S
from coordinator.cluster.rebalance import RebalanceBusy
from coordinator.cluster.runtimes import RuntimeProc

logger = logging.getLogger(__name__)

ROLES = ("attention", "expert")


class ScaleBusy(RebalanceBusy):
    """A scale, a rebalance or a replacement is under way: a scale must wait."""


class ScaleFailed(Exception):
    """A join or drain that could not finish; the cluster serves on as it was."""


@dataclass
class ScaleCounters:
    """What /metrics and /health show of the joins and drains (docs/metrics.md "Placement")."""

    joins: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    drains: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    failed: dict[str, int] = field(default_factory=lambda: {"join": 0, "drain": 0})


class Scaler:
    """The joins and drains of one cluster's runtimes."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster  # the ClusterManager that owns this (not imported: it imports this module)
        self.slots = runtime_slots(cluster.config.parallel)
        self.counters = ScaleCounters()
        self.current: dict[str, Any] | None = None  # the step under way: action, role, runtime, phase
        self.last_error: str | None = None
        self._task: asyncio.Task | None = None

    def shape(self) -> dict[str, Any]:
        """The runtimes serving, the step under way, and the joins and drains so far."""
        serving = [r for r in self.cluster.active if not r.joining]
        return {
            "attention_runtimes": sum(r.role == "attention" for r in serving),
            "expert_runtimes": sum(r.role == "expert" for r in serving),
            "max_runtimes": self.slots,
            "scaling": None if self.current is None else dict(self.current),
            "joins": dict(self.counters.joins),
            "drains": dict(self.counters.drains),
            "failed": dict(self.counters.failed),
            "last_error": self.last_error,
        }

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    # ---- starting a scale

    def start(
        self, expert_runtimes: Any = None, attention_runtimes: Any = None, remove: list[int] | None = None
    ):
        """Check the request and begin its joins or drains; the task resolves to the final shape with "outcome"
        ("completed", "unchanged" or "failed"). RequestError naming the parameter for bad input; ScaleBusy while
        anything else moves."""
        if attention_runtimes is not None:
            raise RequestError(
                "'attention_runtimes': only expert runtimes join and leave while serving here; an attention "
                "runtime's requests would have to move with it", "attention_runtimes",
            )  # fmt: skip
        steps = self._steps(expert_runtimes, remove or [])
        self._check_idle()
        self._task = asyncio.ensure_future(self._run(steps))
        return self._task

    def _steps(self, wanted_value: Any, remove: list[int]) -> list[tuple[str, int | None]]:
        """("join", None) or ("drain", runtime) for each runtime to add or remove."""
        experts = [r.id for r in self.cluster.active if r.role == "expert" and not r.joining]
        if wanted_value is None and not remove:
            raise RequestError(
                "say how many expert runtimes: 'expert_runtimes' (\"+1\", -1 or a count)", "expert_runtimes"
            )
        wanted = (
            len(experts) - len(remove)
            if wanted_value is None
            else target_count(wanted_value, len(experts), "expert_runtimes")
        )
        room = self._room()
        check_count(wanted, len(experts), room, "expert_runtimes")
        bad = [r for r in remove if r not in experts]
        if bad:
            raise RequestError(
                f"'remove': runtime {bad[0]} is not a serving expert runtime (those: {experts})", "remove"
            )
        if remove and len(experts) - len(set(remove)) != wanted:
            raise RequestError(
                f"'remove' names {len(set(remove))} runtimes; 'expert_runtimes' asks for {wanted} of {len(experts)}",
                "remove",
            )
        if wanted < 2 and self.cluster.config.eplb.num_redundant_experts > 0:
            raise RequestError(
                "'expert_runtimes': redundant experts need 2 expert runtimes or more", "expert_runtimes"
            )
        if wanted >= len(experts):
            return [("join", None)] * (wanted - len(experts))
        # Without a list, the runtimes that joined last leave first (the highest ids), as elastic EP drops ranks.
        leaving = sorted(set(remove)) or sorted(experts)[wanted:]
        return [("drain", r) for r in leaving]  # fmt: skip

    def _check_idle(self) -> None:
        cluster, rebalancer = self.cluster, self.cluster.placement
        if self.busy:
            raise ScaleBusy(f"a scale is under way ({self.current})")
        if rebalancer is not None and rebalancer.move is not None:
            raise ScaleBusy(
                f"the rebalance to epoch {rebalancer.move.epoch} is under way ({rebalancer.move.phase})"
            )
        if cluster.replacing:
            raise ScaleBusy("a runtime is being replaced; scale once every runtime serves")

    async def _run(self, steps: list[tuple[str, int | None]]) -> dict[str, Any]:
        outcome = "unchanged" if not steps else "completed"
        self.cluster.placement.paused = True  # no periodic rebalance while the set of runtimes changes
        try:
            return await self._apply(steps, outcome)
        finally:
            self.cluster.placement.paused = False

    async def _apply(self, steps: list[tuple[str, int | None]], outcome: str) -> dict[str, Any]:
        for action, runtime in steps:
            try:
                await (self._join("expert") if action == "join" else self._drain(runtime))
            except Exception as exc:  # noqa: BLE001 - a launcher that cannot start a process, too: said, not raised
                self.counters.failed[action] += 1
                self.last_error = str(exc) if isinstance(exc, ScaleFailed) else f"{type(exc).__name__}: {exc}"
                logger.error("[scale] the %s failed: %s; the cluster serves on as it was", action, self.last_error,
                             exc_info=not isinstance(exc, ScaleFailed))  # fmt: skip
                outcome = "failed"
                break
            finally:
                self.current = None
        return {"outcome": outcome, **self.shape()}

    # ---- a join

    async def _join(self, role: str) -> None:
        runtime = self._start_runtime(self._free_slot(), role)
        self.current = {"action": "join", "role": role, "runtime": runtime.id, "phase": "warming up"}
        logger.info("[scale] %s joins (pid %d)", runtime.name, runtime.proc.pid)
        start = time.monotonic()
        await self._ready(runtime)
        self.current["phase"] = "placing"
        try:
            await self._rebalance(None)
        except ScaleFailed:
            await self._retire(runtime)  # it holds nothing: the failed rebalance cancelled its joins
            raise
        held = len(self.cluster.placement.hosted.get(runtime.id, ()))
        self.counters.joins[role] += 1
        logger.info("[scale] %s serves %d replicas, %.2f s after it was started", runtime.name, held,
                    time.monotonic() - start)  # fmt: skip

    def _room(self) -> int:
        """Runtimes that may still join: on one host, up to the slots; over several nodes (agents or Ray) only into
        slots the start-up placement made and a drain freed — a new id would have no node (an agent's runtime
        list, a Ray placement group's bundle) to start on."""
        retired = sum(r.retired for r in self.cluster.runtimes)
        if self.cluster.config.dist.multi_node:
            return retired
        return retired + self.slots - len(self.cluster.runtimes)

    def _start_runtime(self, slot: int, role: str) -> RuntimeProc:
        """A runtime started in `slot` by the launcher (a new id, or a retired one's as its next generation); it
        joins as a replacement does (Hello, then Welcome to it and Reconnect to the others: the cluster manager's
        `_hello`) and serves once Ready."""
        runtimes = self.cluster.runtimes
        generation = runtimes[slot].spawned + 1 if slot < len(runtimes) else 0
        proc = self.cluster.launch.spawn(slot, role, generation=generation)
        runtime = RuntimeProc(slot, role, proc, spawned=generation, generation=generation, joining=True)
        if slot < len(runtimes):
            runtimes[slot] = runtime
        else:
            runtimes.append(runtime)
        return runtime

    async def _retire(self, runtime: RuntimeProc) -> None:
        """Stop a runtime on purpose and forget it: its id becomes a free slot."""
        await stop_runtime(self.cluster, runtime, self.cluster.watch.heartbeat_timeout_s)

    def _free_slot(self) -> int:
        """The lowest id no runtime holds: a retired one's, or the next new one while slots last."""
        retired = [r.id for r in self.cluster.runtimes if r.retired]
        if retired:
            return min(retired)
        if self._room() <= 0:
            raise ScaleFailed(f"no free runtime slot (--max-runtimes {self.slots})")
        return len(self.cluster.runtimes)

    async def _ready(self, runtime: RuntimeProc) -> None:
        """Until it says Ready; the watchdog ends a joiner that dies, stays silent or never says Hello."""
        while not runtime.ready:
            if runtime.join_error is not None:
                await self._retire(runtime)
                raise ScaleFailed(runtime.join_error)
            if self.cluster.failure is not None or self.cluster.watch.stopping:
                raise ScaleFailed("the cluster is stopping")
            await asyncio.sleep(WATCH_S)

    # ---- a drain

    async def _drain(self, leaving: int) -> None:
        runtime = self.cluster.runtimes[leaving]
        self.current = {
            "action": "drain",
            "role": runtime.role,
            "runtime": leaving,
            "phase": "moving its replicas",
        }
        rebalancer = self.cluster.placement
        await self._rebalance([r for r in rebalancer.expert_runtimes() if r != leaving])
        if rebalancer.hosted.get(leaving):
            raise ScaleFailed(f"{runtime.name} still hosts {len(rebalancer.hosted[leaving])} replicas")
        self.current["phase"] = "stopping"
        await self._retire(runtime)
        self.counters.drains[runtime.role] += 1
        logger.info("[scale] %s drained and stopped; slot %d is free", runtime.name, leaving)

    # ---- both

    async def _rebalance(self, runtimes: list[int] | None) -> None:
        """EPLB's map over `runtimes` (None: every expert runtime), moved to and waited for; ScaleFailed if the
        rebalance failed (the old map serves on). A periodic rebalance under way is waited out first."""
        rebalancer = self.cluster.placement
        while True:
            if self.cluster.failure is not None or self.cluster.watch.stopping:
                raise ScaleFailed("the cluster is stopping")
            try:
                epoch = rebalancer.start(await rebalancer.planned(runtimes), "scale")
                break
            except RebalanceBusy:  # another move, or a replacement: it ends by its own watch
                await asyncio.sleep(WATCH_S)
        if rebalancer.move is None or rebalancer.move.epoch != epoch:
            return  # the map was already the one EPLB wants
        if await rebalancer.wait(epoch) != "completed":
            raise ScaleFailed(f"the rebalance to epoch {epoch} failed: {rebalancer.last_error}")


async def stop_runtime(cluster: Any, runtime: RuntimeProc, timeout_s: float) -> None:
    """Shutdown to one runtime, then its exit (a kill after `timeout_s`); the watchdog ignores it from the start."""
    runtime.retired, runtime.ready, runtime.stats = True, False, None
    cluster.send(runtime.id, wire.Shutdown())
    deadline = time.monotonic() + timeout_s
    while runtime.proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(WATCH_S / 5)
    if runtime.proc.poll() is None:
        logger.warning("%s (pid %d) did not stop; killing it", runtime.name, runtime.proc.pid)
        runtime.proc.kill()
        await asyncio.get_running_loop().run_in_executor(None, runtime.proc.wait)
    else:
        runtime.proc.kill()  # an ended process: nothing, but a Ray actor outlives its worker and holds its bundle
    if cluster.plane is not None:
        cluster.plane.forget(runtime.identity)
