"""The stop-the-world rebalance of the synchronous modes: what a lock-step engine must do to change its expert map
(docs/rebalancing.md, "The stop-the-world baseline"). Every rank takes part in every all-to-all, so every rank stops
at the same step boundary, the weights move, and only then does anyone go on — vLLM's EPLB rearrangement.

Every `step_interval` working iterations (a count every device agrees on: the BEGIN barrier says whether an
iteration works), at the boundary after BEGIN:

1. **Load**: each device sends every peer what its router sent to each (block, expert) over the last
   `window_size` iterations, and sums what it gathers (an all-reduce, on the barrier exchange's tagged signals).
2. **Plan**: each device computes DeepSeek's EPLB map for that load (ExpertMap.rebalanced: the same code and the
   same integers everywhere, so the same map; replicas stay where EPLB allows).
3. **Move**: each expert device loads the layers it gains — on an emulated GPU it holds for their bytes over the
   link from a peer (the cost model's link time), on the torch executor it reads them from the checkpoint — and
   frees the ones it lost.
4. **Resume**: a barrier; the new slot table routes the next iteration's rows.

The pause is the wall time from the boundary to the barrier's end, on every device (SyncStats.rebalance_s).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from amoe import core
from amoe.config import EplbSection
from amoe.errors import ConfigError
from amoe.expert_map import ExpertMap, Layer, expected_load
from amoe.perf.model.gpus import LinkProfile
from amoe.perf.model.links import runtime_nodes, weights_copy_time
from amoe.runtime.sync.exchange import BEGIN
from amoe.runtime.sync.slots import SlotMap

logger = logging.getLogger(__name__)

SIGNAL_MAX = 2**31 - 1  # a signal's info is an int32 on the wire (RowMeta.position)
SNAPSHOTS = 64  # load snapshots kept over a window: the window starts within window_size / 64 iterations


class EmulatedMover:
    """An emulated GPU's move: hold for the joined layers' bytes over `link` from a peer, then (no weights to
    hold) account them."""

    def __init__(self, executor, link: LinkProfile) -> None:
        self.executor, self.link = executor, link

    def move(self, joins: list[Layer], drains: list[Layer]) -> int:
        nbytes = self.executor.layer_bytes(joins)
        if joins:
            self.executor.clock.hold(weights_copy_time(self.link, nbytes), "rebalance")
        self.executor.add(dict.fromkeys(joins))
        self.executor.remove(drains)
        return nbytes


class TorchMover:
    """A torch device's move: the joined layers read from the checkpoint (`load`), the lost ones freed."""

    def __init__(self, executor, load: Callable[[list[Layer]], dict]) -> None:
        self.executor, self.load = executor, load

    def move(self, joins: list[Layer], drains: list[Layer]) -> int:
        moved = self.executor.add(self.load(joins)) if joins else 0
        self.executor.remove(drains)
        return moved


class StopTheWorld:
    """One device's side of the stop-the-world rebalance; `device.slots` is what it changes."""

    def __init__(
        self,
        device,
        eplb: EplbSection,
        slots: SlotMap,
        mover: EmulatedMover | TorchMover | None,
        nodes: Sequence[int] = (),
        num_groups: int = 1,
    ) -> None:
        self.device, self.eplb, self.mover = device, eplb, mover
        self.map = slots.map
        self.nodes = [nodes[d] if d < len(nodes) else 0 for d in slots.devices]
        self.num_groups = num_groups
        device.slots = slots
        self.steps = 0  # working iterations so far
        self._stride = max(1, eplb.window_size // SNAPSHOTS)
        self._shape = (device.cfg.num_blocks, device.cfg.num_expert_ids)
        self._history: collections.deque = collections.deque([(0, np.zeros(self._shape, dtype=np.int64))])
        # (perf_counter at the boundary, seconds paused, bytes brought) of each rebalance that moved layers
        self.events: collections.deque = collections.deque(maxlen=1024)

    def after_begin(self, ex: core.BarrierExchange, it: int) -> None:
        """A working iteration `it` is agreed: count it, and stop the world here when a rebalance is due."""
        if self.steps % self._stride == 0:
            self._history.append((self.steps, self._routed()))
            while len(self._history) > 1 and self._history[1][0] <= self.steps - self.eplb.window_size:
                self._history.popleft()
        self.steps += 1
        if self.eplb.enable and self.steps > 1 and (self.steps - 1) % self.eplb.step_interval == 0:
            self.rebalance(ex, it)

    def rebalance(self, ex: core.BarrierExchange, it: int) -> None:
        """Every device at once: gather the load, plan, move, barrier, switch."""
        start = time.perf_counter()
        load = self._all_load(ex, it)
        target = self.map.rebalanced(
            load, self.eplb.num_redundant_experts, self.device.slots.devices, self.nodes, self.num_groups
        )
        if target == self.map:  # every device computed the same: nobody moves, nobody waits
            return
        joins, drains = self.map.moves(target)
        rank = self.device.rank
        moved = self.mover.move(joins.get(rank, []), drains.get(rank, [])) if self.mover else 0
        self._barrier(ex, it)
        self.map, self.device.slots = target, self.device.slots.with_map(target)
        pause = time.perf_counter() - start
        self.device.stats.add_rebalance(pause, moved)
        self.events.append((start, pause, moved))
        logger.info("[sync] device %d: stop-the-world rebalance at iteration %d: %d layers in, %d out, %.1f MB, "
                    "paused %.3f s", rank, it, len(joins.get(rank, [])), len(drains.get(rank, [])), moved / 1e6,
                    pause)  # fmt: skip

    def _routed(self) -> np.ndarray:
        attention = self.device.attention  # None on a pingpong expert device: it routes nothing
        return (
            attention.routed.numpy().copy()
            if attention is not None
            else np.zeros(self._shape, dtype=np.int64)
        )

    def _all_load(self, ex: core.BarrierExchange, it: int) -> np.ndarray:
        """float64 [B, E]: every device's routed tokens over the window, summed (tags: BEGIN phase, block 1 + b,
        micro e of the iteration, which no other exchange uses)."""
        mine = np.minimum(self._routed() - self._history[0][1], SIGNAL_MAX)
        peers = list(self.device.all_devices)
        total = np.zeros(mine.shape)
        for b, e in np.ndindex(*mine.shape):
            for peer in peers:
                ex.signal(peer, it, 1 + b, BEGIN, e, int(mine[b, e]), 0)
        for b, e in np.ndindex(*mine.shape):
            total[b, e] = sum(info for info, _ in ex.gather_info(it, 1 + b, BEGIN, e, peers).values())
        return total

    def _barrier(self, ex: core.BarrierExchange, it: int) -> None:
        """Nobody resumes before every device's weights have landed."""
        peers = list(self.device.all_devices)
        tag_block = 1 + self.device.cfg.num_blocks
        for peer in peers:
            ex.signal(peer, it, tag_block, BEGIN, 0, 0, 0)
        ex.gather_info(it, tag_block, BEGIN, 0, peers)


def start_map(expert_map: ExpertMap, num_redundant: int, devices: Sequence[int], cfg) -> ExpertMap:
    """The start-up map: each expert at home plus `num_redundant` replicas a block by the expected load, as aep
    places them (ExpertMap.with_redundant)."""
    if not num_redundant:
        return expert_map
    prior = expected_load(cfg.num_blocks, cfg.num_experts, cfg.num_shared_experts, cfg.top_k)
    return expert_map.with_redundant(num_redundant, prior, devices)


def stop_the_world(devices: list, eplb: EplbSection, place, cfg, mode: str, emulation, load) -> None:
    """Give `devices` (of one synchronous group: all of them in process, or a runtime's one) the stop-the-world
    rebalance: emulated devices move weights for the link's time between their nodes (emulation.gpus_per_node),
    torch ones read them with `load(layers)`. ConfigError for fewer than 2 expert devices."""
    if len(place.hosts) < 2:
        raise ConfigError("the stop-the-world rebalance needs 2 or more expert devices")
    gpus_per_node = emulation.config.gpus_per_node if emulation is not None else 0
    num_expert = len(place.hosts) if mode == "pingpong" else 0
    nodes = runtime_nodes(mode, len(place.attn_runtime), num_expert, gpus_per_node)
    movers = {}
    for d in devices:
        if d.experts is None:
            continue
        if emulation is not None:
            movers[d.rank] = EmulatedMover(d.experts, link_between(emulation.expert_gpu, nodes, place.hosts))
        else:
            movers[d.rank] = TorchMover(d.experts, load)
    attach(devices, eplb, place, cfg, nodes, movers)


def attach(devices: list, eplb: EplbSection, place, cfg, nodes: Sequence[int], movers: dict) -> None:
    """Give every device of a synchronous group its stop-the-world rebalancer, over the slots of the start-up
    map (`place`'s homes plus eplb's redundant replicas); `movers`: the mover of each expert device. Each device
    loads, unpriced, the start-up replicas it holds beyond its homes (as start-up loads any weights)."""
    hosts = list(place.hosts)
    expert_map = start_map(ExpertMap.homes(place, cfg.num_blocks), eplb.num_redundant_experts, hosts, cfg)
    slots = SlotMap.start(hosts, expert_map, eplb.num_redundant_experts)
    homes = ExpertMap.homes(place, cfg.num_blocks)
    groups = (
        cfg.router.num_groups if cfg.num_shared_experts == 0 else 1
    )  # as aep's runtimes tell the coordinator
    for device in devices:
        mover = movers.get(device.rank)
        extra = sorted(expert_map.hosted_by(device.rank) - homes.hosted_by(device.rank))
        if extra and mover is not None:
            _unpriced(mover, extra)
        device.rebalancer = StopTheWorld(device, eplb, slots, mover, nodes, groups)


def _unpriced(mover, layers: list[Layer]) -> None:
    if isinstance(mover, EmulatedMover):
        mover.executor.add(dict.fromkeys(layers))
    else:
        mover.executor.add(mover.load(layers))


def link_between(gpu, nodes: Sequence[int], devices: Sequence[int]) -> LinkProfile:
    """The link weights cross between expert devices: NVLink when they share a node, else the network."""
    where = {nodes[d] if d < len(nodes) else 0 for d in devices}
    return gpu.nvlink if len(where) == 1 else gpu.network
