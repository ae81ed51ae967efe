"""The coordinator's side of the live placement (docs/rebalancing.md): it owns the expert map and its epoch and
changes the map one rebalance at a time, as joins, a switch and drains — never a pause.

1. **Join**: each expert runtime that gets new replicas loads their weights in the background (LoadExperts) and
   answers ExpertsLoaded once its queues take their rows. Nobody routes to them yet.
2. **Switch**: every attention runtime is told the new map (SetExpertMap); its rows go to the new replicas from
   then on, while the rows it already sent are answered where they went.
3. **Drain**: each attention runtime answers Drained once every row it sent to a replica the new map retired has
   come back; when all have, the retired replicas free their weights (DropExperts → ExpertsDropped).

A rebalance that fails before the switch (a weight load that raised, a joining runtime lost, join_timeout_s
passed) cancels its joins and leaves the old map serving; one that fails after (an attention runtime that could
not take the map) goes back to the old map by the same switch and drain. Either way it is logged and counted. A
replacement runtime starts from the map and the layers its rank holds now (Welcome's PlacementState), so healing is
the same join.

The API others build on (elastic runtimes reuse it: a runtime that joins is replicas landing on it, one that
leaves is its replicas draining): `start(target, reason)` begins a move to any valid map, `wait(epoch)` resolves
when it ends, `report()` says where things stand. Everything runs on the API's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from amoe import wire
from amoe.config import AmoeConfig
from amoe.errors import AmoeError, ConfigError
from amoe.expert_map import ExpertMap, Layer
from coordinator.cluster.expert_load import ExpertLoad
from coordinator.cluster.runtimes import RuntimeProc

logger = logging.getLogger(__name__)

OUTCOMES = ("started", "completed", "failed", "unchanged")  # amoe_placement_rebalances_total{outcome}


class RebalanceBusy(AmoeError):
    """A rebalance is under way, or the cluster is not all serving: a new one must wait."""


@dataclass
class Move:
    """One rebalance in flight: from `old` to `target` under `epoch`."""

    epoch: int
    old_epoch: int
    old: ExpertMap
    target: ExpertMap
    joins: dict[int, list[Layer]]
    drains: dict[int, list[Layer]]
    generations: dict[int, int]  # every runtime's at the start: a replacement shows as another
    reason: str
    started: float
    phase: str = "join"  # join | drain | free
    progressed: float | None = None  # when a joining runtime last reported another layer loaded
    loaded_layers: dict[int, int] = field(default_factory=dict)  # runtime → layers it reported loaded
    loaded: set[int] = field(default_factory=set)
    drained: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)


@dataclass
class Counters:
    """What /metrics exports of the placement (docs/metrics.md)."""

    rebalances: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    moved_bytes: int = 0  # weight bytes loaded by joins
    freed_bytes: int = 0  # weight bytes freed by drains
    joins: int = 0  # layers that joined (landed)
    drains: int = 0  # layers drained and freed


class Rebalancer:
    """The live expert map of one cluster (`runtimes`: the cluster manager's table), its rebalances, and the load
    they are computed from."""

    def __init__(
        self,
        config: AmoeConfig,
        runtimes: list[RuntimeProc],
        send: Callable[[int, wire.Message], bool],
        nodes: Sequence[int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.eplb = config, config.eplb
        self.clock = clock  # join_timeout_s is measured on it
        self.runtimes, self._send, self.nodes = runtimes, send, nodes
        self.map: ExpertMap | None = (
            None  # what the attention runtimes route by (after the switch: the target)
        )
        self.epoch = 0  # the map's
        self.hosted: dict[int, set[Layer]] = {}  # what each expert runtime holds or has been told to hold
        self.move: Move | None = None
        self.counters = Counters()
        self.load: ExpertLoad | None = None
        self.groups = 1
        self._last_epoch = 0  # epochs only grow, so a late answer to a failed move is never mistaken
        self._failed_epochs: set[int] = set()
        self._welcomed: dict[int, int] = {}  # runtime → the epoch of the map its (latest) Welcome carried
        self._last_steps = 0.0  # steps at the last rebalance (or start)
        self._logged_steps = 0.0
        self._planning = False
        self._waiters: dict[int, list[asyncio.Future]] = {}
        self.last_error: str | None = None
        # Set while runtimes join or leave (coordinator/cluster/scaling.py): a periodic plan then could place replicas
        # on a runtime about to stop, or leave out one about to serve; it waits for the scale to end.
        self.paused = False

    # ---- start-up

    def on_hello(self, runtime: RuntimeProc, msg: wire.Hello) -> None:
        """The model's expert grid, and at start-up what each expert runtime loaded."""
        if self.load is None and msg.num_blocks and msg.num_expert_ids:
            self.load = ExpertLoad(self.eplb.window_size, msg.num_blocks, msg.num_expert_ids)
            self.groups = msg.expert_groups
        if self.map is None and runtime.role == "expert":
            self.hosted[runtime.id] = {tuple(layer) for layer in msg.hosted}

    def welcome(self, runtime: RuntimeProc) -> wire.PlacementState | None:
        """What `runtime` starts from: the map, and the layers its rank holds now (a replacement's included)."""
        if self.map is None:
            if self.load is None:
                return None
            self.map = ExpertMap.from_hosted(self.hosted, *self.load.shape)
            logger.info("[placement] %d replicas of %d experts x %d blocks on %d expert runtimes", int(self.map.counts().sum()),
                        self.map.num_experts, self.map.num_blocks, len(self.hosted))  # fmt: skip
        move, r = self.move, runtime.id
        if move is not None and move.phase == "join" and r in move.joins and r not in move.loaded:
            self._fail(f"{runtime.name} was replaced during its join")
        elif move is not None and move.phase == "free" and r in move.drains:
            move.dropped.add(r)  # the replacement never loads what its rank was freeing
        self._welcomed[r] = self.epoch
        hosted = sorted(self.hosted.get(r, ())) if runtime.role == "expert" else []
        return wire.PlacementState(self.epoch, self.map.table(), [list(layer) for layer in hosted])

    # ---- serving

    def on_report(self, runtime: RuntimeProc, stats: dict[str, Any]) -> None:
        """An attention runtime's heartbeat: its routing counts feed the load window; a joining expert runtime's:
        its loads' progress."""
        move = self.move
        if move is not None and move.phase == "join" and runtime.id in move.joins:
            loaded = stats.get("loaded_layers", 0)
            if loaded > move.loaded_layers.setdefault(runtime.id, loaded):
                move.loaded_layers[runtime.id], move.progressed = loaded, self.clock()
        if self.load is None or runtime.role != "attention":
            return
        self.load.report(runtime.id, stats)
        steps = self.load.steps
        if self.eplb.log_balancedness and steps - self._logged_steps >= self.eplb.log_balancedness_interval:
            self._logged_steps = steps
            balance = self.balancedness()
            if balance:
                worst = int(np.argmin(balance))
                logger.info("[placement] balancedness %.4f (mean over blocks), block %d the worst at %.4f, step %.0f",
                            float(np.mean(balance)), worst, balance[worst], steps)  # fmt: skip

    def tick(self) -> None:
        """Every watchdog period: follow the move under way, or start a periodic one when it is due."""
        if self.move is not None:
            self._follow(self.move)
        elif self._due():
            self._plan()

    def _due(self) -> bool:
        return (
            self.eplb.enable
            and self.map is not None
            and self.load is not None
            and not self._planning
            and not self.paused
            and self.load.steps - self._last_steps >= self.eplb.step_interval
            and self._all_serving()
        )

    def _plan(self) -> None:
        self._planning = True
        asyncio.ensure_future(self.planned()).add_done_callback(self._planned)

    async def planned(self, runtimes: list[int] | None = None) -> ExpertMap:
        """EPLB's map for the window's load (E + num_redundant_experts replicas a block over the expert runtimes,
        or over `runtimes` — one leaving is not among them —, hierarchical over their nodes where the groups
        allow), computed off the event loop: a large model's plan takes a while."""
        if self.map is None or self.load is None:
            raise RebalanceBusy("the cluster has no expert map yet (still starting)")
        load, runtimes = self.load.window(), runtimes or self.expert_runtimes()
        nodes = [self.nodes[r] if r < len(self.nodes) else 0 for r in runtimes]
        return await asyncio.get_running_loop().run_in_executor(
            None, self.map.rebalanced, load, self.eplb.num_redundant_experts, runtimes, nodes, self.groups
        )

    def _planned(self, plan: asyncio.Future) -> None:
        self._planning = False
        self._last_steps = self.load.steps
        try:
            self.start(plan.result(), "periodic")
        except Exception as exc:  # noqa: BLE001 - a plan that cannot run is logged; the map serves on
            logger.error("[placement] the periodic rebalance could not start: %s", exc)

    def start(self, target: ExpertMap, reason: str) -> int:
        """Begin moving to `target` (joins first); the epoch it will have. RebalanceBusy while another move runs
        or a runtime is being replaced; ConfigError for a map this cluster cannot serve."""
        if self.map is None:
            raise RebalanceBusy("the cluster has no expert map yet (still starting)")
        if self.move is not None:
            raise RebalanceBusy(f"the rebalance to epoch {self.move.epoch} is under way ({self.move.phase})")
        if not self._all_serving():
            raise RebalanceBusy("a runtime is being replaced; rebalance once every runtime serves")
        self._check(target)
        if target == self.map:
            self.counters.rebalances["unchanged"] += 1
            logger.info(
                "[placement] %s rebalance: the map of epoch %d is already the best one", reason, self.epoch
            )
            return self.epoch
        return self._begin(target, reason)

    def _begin(self, target: ExpertMap, reason: str) -> int:
        self._last_epoch += 1
        have = {r: self.hosted.get(r, set()) for r in self.expert_runtimes()}
        joins = {
            r: sorted(target.hosted_by(r) - held) for r, held in have.items() if target.hosted_by(r) - held
        }
        drains = {
            r: sorted(held - target.hosted_by(r)) for r, held in have.items() if held - target.hosted_by(r)
        }
        gens = {r.id: r.spawned for r in self.runtimes}
        self.move = Move(
            self._last_epoch, self.epoch, self.map, target, joins, drains, gens, reason, self.clock()
        )
        self.counters.rebalances["started"] += 1
        logger.info("[placement] %s rebalance to epoch %d: %d layers join on runtimes %s, %d drain from %s", reason,
                    self._last_epoch, sum(map(len, joins.values())), sorted(joins), sum(map(len, drains.values())),
                    sorted(drains))  # fmt: skip
        for r, layers in joins.items():
            self._send(r, wire.LoadExperts(self._last_epoch, [list(x) for x in layers]))
        if not joins:
            self._switch(self.move)
        return self._last_epoch

    async def wait(self, epoch: int) -> str:
        """How the move to `epoch` ended: "completed" or "failed" (at once if it has)."""
        if self.move is None or self.move.epoch != epoch:
            return "failed" if epoch in self._failed_epochs else "completed"
        future = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(epoch, []).append(future)
        return await future

    def on_message(self, runtime: RuntimeProc, msg: wire.Message) -> bool:
        """A join or drain answer; False if it answers nothing asked (the caller drops and counts it)."""
        move = self.move
        if move is None or msg.epoch != move.epoch:
            return msg.epoch in self._failed_epochs or msg.epoch <= self.epoch  # late: harmless
        if isinstance(msg, wire.PlacementFailed):
            logger.error(
                "[placement] %s could not carry out epoch %d: %s", runtime.name, msg.epoch, msg.error
            )
            if move.phase == "join":
                self._fail(f"{runtime.name}: {msg.error}")
            elif move.phase == "drain":
                self._roll_back(move, f"{runtime.name}: {msg.error}")
            return True
        if isinstance(msg, wire.ExpertsLoaded) and move.phase == "join" and runtime.role == "expert":
            return self._loaded(move, runtime, msg)
        if isinstance(msg, wire.Drained) and move.phase == "drain" and runtime.role == "attention":
            move.drained.add(runtime.id)
            self._follow(move)
            return True
        if isinstance(msg, wire.ExpertsDropped) and move.phase == "free" and runtime.role == "expert":
            move.dropped.add(runtime.id)
            self.counters.freed_bytes += msg.bytes
            self._follow(move)
            return True
        return False

    def _loaded(self, move: Move, runtime: RuntimeProc, msg: wire.ExpertsLoaded) -> bool:
        layers = sorted(tuple(x) for x in msg.layers)
        if runtime.id not in move.joins or layers != move.joins[runtime.id]:
            return False
        self.hosted.setdefault(runtime.id, set()).update(layers)
        move.loaded.add(runtime.id)
        self.counters.moved_bytes += msg.bytes
        self.counters.joins += len(layers)
        if move.loaded == set(move.joins):
            self._switch(move)
        return True

    def _follow(self, move: Move) -> None:
        """Advance or fail `move` by what has happened since (answers, losses, deadlines)."""
        if move.phase == "join":
            # A stall, not a size: a large join keeps going while its layers keep landing.
            late = self.clock() - (move.progressed or move.started) > self.eplb.join_timeout_s
            lost = [r for r in move.joins if r not in move.loaded and self._replaced(move, r)]
            if lost:
                self._fail(f"{self.runtimes[lost[0]].name} was lost during its join")
            elif late:
                self._fail(
                    f"the joins loaded no layer for eplb.join_timeout_s ({self.eplb.join_timeout_s:g} s)"
                )
            return
        if move.phase == "drain":
            for r in self.attention_runtimes():
                if self._welcomed.get(r, -1) >= move.epoch:
                    move.drained.add(r)  # a replacement that started on this map sent nothing before it
            if move.drained >= set(self.attention_runtimes()):
                self._free(move)
            return
        if move.dropped >= set(move.drains):
            self._complete(move)

    def _switch(self, move: Move) -> None:
        """Every join landed: the attention runtimes route by the new map from now on."""
        move.phase = "drain"
        entries = [[b, e, list(where)] for b, e, where in self.map.changed(move.target)]
        self.map, self.epoch = move.target, move.epoch
        for r in self.attention_runtimes():
            self._send(r, wire.SetExpertMap(move.epoch, entries))
        self._follow(move)

    def _free(self, move: Move) -> None:
        """No retired replica owes a row: free their weights."""
        move.phase = "free"
        for r, layers in move.drains.items():
            self.hosted[r].difference_update(layers)
            self._send(r, wire.DropExperts(move.epoch, [list(x) for x in layers]))
            self.counters.drains += len(layers)
        self._follow(move)

    def _complete(self, move: Move) -> None:
        self.move = None
        self.counters.rebalances["completed"] += 1
        logger.info("[placement] epoch %d serves (%s rebalance, %.2f s); balancedness now %s", move.epoch, move.reason,
                    self.clock() - move.started, _fmt(self.balancedness()))  # fmt: skip
        self._resolve(move.epoch, "completed")

    def _fail(self, reason: str) -> None:
        """Before the switch: cancel the joins (whatever landed is freed); the old map serves on."""
        move, self.move = self.move, None
        self.counters.rebalances["failed"] += 1
        self._failed_epochs.add(move.epoch)
        self.last_error = reason
        logger.error("[placement] the rebalance to epoch %d failed: %s; the map of epoch %d serves on", move.epoch,
                     reason, self.epoch)  # fmt: skip
        for r, layers in move.joins.items():
            self.hosted.get(r, set()).difference_update(layers)
            if not self._replaced(move, r):
                self._send(r, wire.DropExperts(move.epoch, [list(x) for x in layers]))
        self._resolve(move.epoch, "failed")

    def _roll_back(self, move: Move, reason: str) -> None:
        """After the switch: back to the old map, by the same switch and drain (nothing to load: the old replicas
        were never freed)."""
        self.move = None
        self.counters.rebalances["failed"] += 1
        self._failed_epochs.add(move.epoch)
        self.last_error = reason
        self._resolve(move.epoch, "failed")
        if move.reason == "rollback":  # going back failed too: no third map; every replica stays hosted
            logger.error("[placement] going back to epoch %d failed as well: %s; no replica is freed", move.epoch,
                         reason)  # fmt: skip
            return
        logger.error("[placement] the rebalance to epoch %d failed after its switch: %s; going back to the map of "
                     "epoch %d", move.epoch, reason, move.old_epoch)  # fmt: skip
        self._begin(move.old, "rollback")  # even while a runtime is being replaced: it starts on the map then

    def _resolve(self, epoch: int, outcome: str) -> None:
        for future in self._waiters.pop(epoch, []):
            if not future.done():
                future.set_result(outcome)

    # ---- what others read

    def expert_runtimes(self) -> list[int]:
        return [r.id for r in self.runtimes if r.role == "expert" and not r.retired]

    def attention_runtimes(self) -> list[int]:
        return [r.id for r in self.runtimes if r.role == "attention" and not r.retired]

    def balancedness(self) -> list[float]:
        """Per block, vLLM's balancedness (mean / max expert-runtime load) of the window's load on the map."""
        if self.map is None or self.load is None:
            return []
        return self.map.balancedness(self.load.window(), self.expert_runtimes())

    def report(self) -> dict[str, Any]:
        """The placement for /admin/placement: epoch, the move under way, replicas, balancedness, counters."""
        move = self.move
        return {
            "epoch": self.epoch,
            "rebalancing": None
            if move is None
            else {"epoch": move.epoch, "phase": move.phase, "reason": move.reason},
            "replicas": None if self.map is None else self.map.table(),
            "balancedness": self.balancedness(),
            "steps": 0.0 if self.load is None else self.load.steps,
            "rebalances": dict(self.counters.rebalances),
            "moved_bytes": self.counters.moved_bytes,
            "last_error": self.last_error,
        }

    # ---- checks

    def _check(self, target: ExpertMap) -> None:
        if (target.num_blocks, target.num_experts) != (self.map.num_blocks, self.map.num_experts):
            raise ConfigError(
                f"the map has {target.num_blocks} blocks of {target.num_experts} experts; the model "
                f"{self.map.num_blocks} of {self.map.num_experts}"
            )
        stray = set(target.runtimes()) - set(self.expert_runtimes())
        if stray:
            raise ConfigError(f"runtime {min(stray)} is not an expert runtime of this cluster")

    def _all_serving(self) -> bool:
        return all(r.ready and r.lost is None for r in self.runtimes if not r.retired)

    def _replaced(self, move: Move, runtime: int) -> bool:
        r = self.runtimes[runtime]
        return r.lost is not None or r.spawned != move.generations.get(runtime, r.spawned)


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]" if values else "n/a"
