"""A runtime's side of the live placement (docs/rebalancing.md): joins and drains, never a pause.

Expert runtime (`ExpertReplicas`): a join's weights load on a thread of their own (the checkpoint read, or on an
emulated GPU the modelled copy); they land in the executor on the loop thread between two batches, and only then
does the engine take the layer's rows; ExpertsLoaded follows. A drain's end (DropExperts): the engine stops taking
the layer's rows at once, its weights are freed between two batches, ExpertsDropped follows.

Attention runtime (`AttentionReplicas`): SetExpertMap switches where rows go, entry by entry; rows already sent to
a retired replica are still answered by it, and once none is outstanding the runtime says Drained.

Threads: `apply` and `replies` run on the control thread, `between_batches` on the loop thread (run_loop's hook),
the loads on a thread each. What crosses between them goes through a lock-guarded list.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from amoe import core, wire
from amoe.expert_map import ExpertMap, Layer

logger = logging.getLogger(__name__)

Loader = Callable[[list[Layer]], dict[Layer, Any]]  # layers → their executor layers (weights loaded)


class ExpertReplicas:
    """The layers an expert runtime hosts, and its joins and drains."""

    def __init__(
        self,
        runtime: int,
        engine: core.Engine,
        executor: Any,
        loader: Loader,
        hosted: Iterable[Layer],
        shape: tuple[int, int],
    ) -> None:
        self.runtime, self.engine, self.executor, self.loader = runtime, engine, executor, loader
        self.hosted: set[Layer] = set(hosted)
        self.shape = shape  # (blocks, expert ids) of the model
        # Guards the hand-offs below: loads land from their threads, the loop thread applies, the control thread
        # sends the replies.
        self._lock = threading.Lock()
        self._landed: list[tuple[int, list[Layer], dict[Layer, Any] | BaseException]] = []
        self._freeing: list[tuple[int, list[Layer]]] = []
        self._replies: list[wire.Message] = []
        self._loading: dict[int, list[Layer]] = {}  # epoch → layers whose weights are on their way
        self._cancelled: set[int] = set()  # epochs whose joins were dropped before they landed
        self.loaded_layers = 0  # layers the joins have loaded so far, for the heartbeat (guarded by _lock)

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._loading or self._landed or self._freeing or self._replies)

    def apply(self, msg: wire.Message) -> None:
        """A placement command (control thread)."""
        if isinstance(msg, wire.LoadExperts):
            self._load(msg.epoch, [tuple(layer) for layer in msg.layers])
        elif isinstance(msg, wire.DropExperts):
            self._drop(msg.epoch, [tuple(layer) for layer in msg.layers])
        else:
            self._reply(wire.PlacementFailed(self.runtime, msg.epoch, "an expert runtime routes no rows"))

    def _load(self, epoch: int, layers: list[Layer]) -> None:
        bad = [layer for layer in layers if not self._in_model(layer)]
        if bad:
            self._reply(
                wire.PlacementFailed(self.runtime, epoch, f"(block, expert) {bad[0]} is outside the model")
            )
            return
        new = [layer for layer in layers if layer not in self.hosted]
        with self._lock:
            self._loading[epoch] = new
        threading.Thread(
            target=self._fetch, args=(epoch, new), name=f"amoe-join-{epoch}", daemon=True
        ).start()

    def _fetch(self, epoch: int, layers: list[Layer]) -> None:
        """The load itself, off the loop and the control thread, a layer at a time: each one counts in
        `loaded_layers`, the progress the coordinator watches (a join is judged by its stalls, not its size)."""
        try:
            start = time.monotonic()
            result: dict[Layer, Any] | BaseException = {}
            for layer in layers:
                result.update(self.loader([layer]))
                with self._lock:
                    self.loaded_layers += 1
            logger.info("runtime %d: %d layers of epoch %d loaded in %.2f s", self.runtime, len(layers), epoch,
                        time.monotonic() - start)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, which keeps the old map
            logger.exception("runtime %d: the join of epoch %d failed", self.runtime, epoch)
            result = exc
        with self._lock:
            self._landed.append((epoch, layers, result))

    def _drop(self, epoch: int, layers: list[Layer]) -> None:
        """Rows of these layers stop now; their weights go between two batches (a join still loading is
        cancelled)."""
        with self._lock:
            if epoch in self._loading:
                self._cancelled.add(epoch)
        gone = [layer for layer in layers if layer in self.hosted]
        dropped = sum(self.engine.unhost(b, e) for b, e in gone)
        if dropped:
            logger.info("runtime %d: %d second copies of drained rows dropped", self.runtime, dropped)
        self.hosted.difference_update(gone)
        with self._lock:
            self._freeing.append((epoch, gone))

    def between_batches(self) -> None:
        """The loop thread's turn: landed weights join the executor, then the engine; drained ones are freed."""
        with self._lock:
            landed, self._landed = self._landed, []
            freeing, self._freeing = self._freeing, []
        for epoch, layers, result in landed:
            self._land(epoch, layers, result)
        for epoch, layers in freeing:
            freed = self.executor.remove(layers)
            self._reply(wire.ExpertsDropped(self.runtime, epoch, [list(x) for x in layers], freed))

    def _land(self, epoch: int, layers: list[Layer], result: dict[Layer, Any] | BaseException) -> None:
        with self._lock:
            self._loading.pop(epoch, None)
            cancelled = epoch in self._cancelled
            self._cancelled.discard(epoch)
        if isinstance(result, BaseException):
            self._reply(wire.PlacementFailed(self.runtime, epoch, f"{type(result).__name__}: {result}"))
            return
        if cancelled:  # the coordinator gave this join up: the weights never serve
            logger.info("runtime %d: the cancelled join of epoch %d landed; discarded", self.runtime, epoch)
            return
        loaded = self.executor.add(
            result
        )  # the weights first: a row of the layer may come as soon as it is hosted
        for b, e in layers:
            self.engine.host(b, e)
        self.hosted.update(layers)
        self._reply(wire.ExpertsLoaded(self.runtime, epoch, [list(x) for x in layers], loaded))

    def settle(self, hosted: Iterable[Layer]) -> None:
        """Before the engine starts (a replacement told what its rank hosts now): load what is missing, drop
        what is not wanted, synchronously."""
        want = set(hosted)
        missing = sorted(want - self.hosted)
        if missing:
            self.executor.add(self.loader(missing))
            for b, e in missing:
                self.engine.host(b, e)
        extra = sorted(self.hosted - want)
        for b, e in extra:
            self.engine.unhost(b, e)
        if extra:
            self.executor.remove(extra)
        self.hosted = want
        if missing or extra:
            logger.info("runtime %d: %d layers loaded, %d freed to match the live placement", self.runtime,
                        len(missing), len(extra))  # fmt: skip

    def replies(self) -> list[wire.Message]:
        with self._lock:
            out, self._replies = self._replies, []
        return out

    def _reply(self, msg: wire.Message) -> None:
        with self._lock:
            self._replies.append(msg)

    def _in_model(self, layer: Layer) -> bool:
        return 0 <= layer[0] < self.shape[0] and 0 <= layer[1] < self.shape[1]


class AttentionReplicas:
    """Where an attention runtime routes each (block, expert), and the drains it owes an answer about."""

    def __init__(self, runtime: int, engine: core.Engine, expert_map: ExpertMap, num_runtimes: int) -> None:
        self.runtime, self.engine, self.map = runtime, engine, expert_map
        self.num_runtimes = num_runtimes
        self._draining: dict[int, list[tuple[int, int, int]]] = {}  # epoch → (runtime, block, expert) retired
        self._replies: list[wire.Message] = []

    @property
    def busy(self) -> bool:
        return bool(self._draining or self._replies)

    def apply(self, msg: wire.Message) -> None:
        """A placement command (control thread)."""
        if not isinstance(msg, wire.SetExpertMap):
            self._replies.append(
                wire.PlacementFailed(self.runtime, msg.epoch, "an attention runtime hosts no experts")
            )
            return
        error = self._check(msg.entries)
        if error is not None:
            self._replies.append(wire.PlacementFailed(self.runtime, msg.epoch, error))
            return
        retired = []
        table = self.map.table()
        for b, e, where in msg.entries:
            new = sorted(set(where))
            retired += [(r, b, e) for r in table[b][e] if r not in new]
            self.engine.set_replicas(b, e, new)
            table[b][e] = new
        self.map = ExpertMap.of(table)
        self._draining[msg.epoch] = retired
        logger.info("runtime %d: routing by the map of epoch %d (%d entries changed, %d replicas retired)",
                    self.runtime, msg.epoch, len(msg.entries), len(retired))  # fmt: skip

    def settle(self, table: list[list[list[int]]]) -> None:
        """Before the engine starts: route by the live map (the coordinator's, which may differ from the
        start-up one)."""
        target = ExpertMap.of(table)
        for b, e, where in self.map.changed(target):
            self.engine.set_replicas(b, e, list(where))
        self.map = target

    def replies(self) -> list[wire.Message]:
        """Drained for every epoch whose retired replicas owe nothing any more, and any failures."""
        for epoch in sorted(self._draining):
            if self.engine.outstanding(self._draining[epoch]) == 0:
                del self._draining[epoch]
                self._replies.append(wire.Drained(self.runtime, epoch))
        out, self._replies = self._replies, []
        return out

    def between_batches(self) -> None:
        """Nothing to do on the loop thread: the map changes under the engine's own lock."""

    def _check(self, entries: list) -> str | None:
        for b, e, where in entries:
            if not (0 <= b < self.map.num_blocks and 0 <= e < self.map.num_experts):
                return f"(block, expert) ({b}, {e}) is outside the model"
            if not where or any(not 0 <= r < self.num_runtimes for r in where):
                return f"({b}, {e}): replicas {where} must be runtimes of this cluster"
        return None
