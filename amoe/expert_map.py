"""The live expert map (docs/rebalancing.md): which expert runtimes serve each (block, expert) — its replicas — and
how one map becomes another as joins and drains.

An expert of a block is a μ-queue; a replica is a second queue of it on another expert runtime. The attention
runtimes route each row to one replica of its expert (cpp/dispatch.h, "The rule"); the coordinator owns the map's
epoch and changes it only by joins (weights landed, then rows) and drains (no new rows, outstanding ones answered,
then weights freed). Start-up places `--num-redundant-experts` replicas per block by an expected load
(`with_redundant`); a rebalance recomputes the whole map with DeepSeek's EPLB (amoe.eplb) on the measured load
(`rebalanced`), keeping as many replicas where they are as the result allows.

Torch-free: the coordinator plans with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from amoe import eplb
from amoe.errors import ConfigError
from amoe.placement import Placement

Layer = tuple[int, int]  # (block, expert)
Replicas = tuple[int, ...]  # ascending runtime ids


@dataclass(frozen=True)
class ExpertMap:
    """replicas[b][e]: the expert runtimes serving expert e of block b, ascending, at least one."""

    replicas: tuple[tuple[Replicas, ...], ...]

    def __post_init__(self) -> None:
        if not self.replicas or not self.replicas[0]:
            raise ConfigError("an expert map needs at least one block and one expert")
        width = len(self.replicas[0])
        for b, row in enumerate(self.replicas):
            if len(row) != width:
                raise ConfigError(f"block {b} of the expert map has {len(row)} experts, not {width}")
            for e, where in enumerate(row):
                if not where or list(where) != sorted(set(where)) or where[0] < 0:
                    raise ConfigError(f"expert {e} of block {b}: replicas {where} must be distinct ids >= 0")

    @classmethod
    def homes(cls, placement: Placement, num_blocks: int) -> ExpertMap:
        """One replica each: expert e of every block on its home runtime (the paper's placement, §3.3)."""
        row = tuple((r,) for r in placement.expert_runtime)
        return cls(tuple(row for _ in range(num_blocks)))

    @classmethod
    def of(cls, table: Sequence[Sequence[Sequence[int]]]) -> ExpertMap:
        """From nested lists (the wire's shape), normalised to ascending ids; ConfigError if malformed."""
        try:
            return cls(
                tuple(tuple(tuple(sorted(set(int(r) for r in where))) for where in row) for row in table)
            )
        except (TypeError, ValueError):
            raise ConfigError(
                "an expert map is a list per block of a list per expert of runtime ids"
            ) from None

    @classmethod
    def from_hosted(
        cls, hosted: Mapping[int, Iterable[Layer]], num_blocks: int, num_experts: int
    ) -> ExpertMap:
        """The map the runtimes' hosted layers make (each runtime's Hello); ConfigError if a layer has no host."""
        table: list[list[list[int]]] = [[[] for _ in range(num_experts)] for _ in range(num_blocks)]
        for runtime, layers in sorted(hosted.items()):
            for b, e in layers:
                if not (0 <= b < num_blocks and 0 <= e < num_experts):
                    raise ConfigError(f"runtime {runtime} hosts ({b}, {e}), outside the model")
                table[b][e].append(runtime)
        missing = [(b, e) for b in range(num_blocks) for e in range(num_experts) if not table[b][e]]
        if missing:
            raise ConfigError(f"no expert runtime hosts (block, expert) {missing[0]}")
        return cls.of(table)

    @property
    def num_blocks(self) -> int:
        return len(self.replicas)

    @property
    def num_experts(self) -> int:
        return len(self.replicas[0])

    def table(self) -> list[list[list[int]]]:
        """Nested lists, the wire's shape."""
        return [[list(where) for where in row] for row in self.replicas]

    def hosted_by(self, runtime: int) -> frozenset[Layer]:
        return frozenset(
            (b, e) for b, row in enumerate(self.replicas) for e, where in enumerate(row) if runtime in where
        )

    def runtimes(self) -> tuple[int, ...]:
        """Every runtime that serves a replica, ascending."""
        return tuple(sorted({r for row in self.replicas for where in row for r in where}))

    def counts(self) -> np.ndarray:
        """int64 [blocks, experts]: replicas of each."""
        return np.array([[len(where) for where in row] for row in self.replicas], dtype=np.int64)

    def moves(self, target: ExpertMap) -> tuple[dict[int, list[Layer]], dict[int, list[Layer]]]:
        """(joins, drains) per runtime that turn this map into `target`: the layers it must load, the ones it
        must drain and free."""
        joins: dict[int, list[Layer]] = {}
        drains: dict[int, list[Layer]] = {}
        for r in sorted(set(self.runtimes()) | set(target.runtimes())):
            mine, theirs = self.hosted_by(r), target.hosted_by(r)
            if theirs - mine:
                joins[r] = sorted(theirs - mine)
            if mine - theirs:
                drains[r] = sorted(mine - theirs)
        return joins, drains

    def changed(self, target: ExpertMap) -> list[tuple[int, int, Replicas]]:
        """The (block, expert, replicas) entries of `target` that differ from this map."""
        return [
            (b, e, target.replicas[b][e])
            for b in range(self.num_blocks)
            for e in range(self.num_experts)
            if target.replicas[b][e] != self.replicas[b][e]
        ]

    def balancedness(self, load: np.ndarray, runtimes: Sequence[int]) -> list[float]:
        """Per block, vLLM's balancedness (mean / max) of the `runtimes`' loads, each expert's `load` [B, E] split
        evenly over its replicas."""
        out = []
        for b, row in enumerate(self.replicas):
            per = dict.fromkeys(runtimes, 0.0)
            for e, where in enumerate(row):
                for r in where:
                    per[r] = per.get(r, 0.0) + float(load[b][e]) / len(where)
            out.append(eplb.balancedness(list(per.values())))
        return out

    def with_redundant(self, num_redundant: int, prior: np.ndarray, runtimes: Sequence[int]) -> ExpertMap:
        """This map plus `num_redundant` replicas in every block, for a load known only in expectation (`prior`
        [B, E]): one at a time, to the expert with the most expected load per replica that some runtime does not
        host yet (ties: the lowest id), on the least-loaded such runtime (ties: the lowest id)."""
        table = self.table()
        for b, row in enumerate(table):
            for _ in range(num_redundant):
                free = [e for e in range(len(row)) if len(row[e]) < len(runtimes)]
                if not free:
                    raise ConfigError(
                        f"{num_redundant} redundant experts a block exceed one replica of each expert on each of "
                        f"the {len(runtimes)} expert runtimes"
                    )
                e = max(free, key=lambda x: (float(prior[b][x]) / len(row[x]), -x))
                share = _runtime_loads(row, prior[b], runtimes)
                r = min((r for r in runtimes if r not in row[e]), key=lambda r: (share[r], r))
                row[e] = sorted([*row[e], r])
        return ExpertMap.of(table)

    def rebalanced(
        self,
        load: np.ndarray,
        num_redundant: int,
        runtimes: Sequence[int],
        nodes: Sequence[int],
        num_groups: int,
    ) -> ExpertMap:
        """EPLB's placement for `load` [B, E] over the expert `runtimes` (on `nodes`, one per runtime), E +
        `num_redundant` replicas a block; each block's devices are matched to runtimes so that as many replicas
        as possible stay where they are (devices of one node are interchangeable: the balance is the same)."""
        order = sorted(range(len(runtimes)), key=lambda i: (nodes[i], runtimes[i]))
        ordered = [runtimes[i] for i in order]
        node_of = [nodes[i] for i in order]
        even = len(set(node_of)) > 0 and all(node_of.count(n) == node_of.count(node_of[0]) for n in node_of)
        num_nodes = len(set(node_of)) if even else 1
        plan = eplb.rebalance_experts(
            load, self.num_experts + num_redundant, num_groups, num_nodes, len(ordered), distinct=True
        )
        table = []
        for b, packs in enumerate(plan):
            hosts = _match(packs, ordered, node_of, self.replicas[b])
            row = [[] for _ in range(self.num_experts)]
            for pack, r in zip(packs, hosts):
                for e in set(pack):  # two replicas of one expert on one device are one queue
                    row[e].append(r)
            table.append(row)
        return ExpertMap.of(table)


def _runtime_loads(row: list[list[int]], load: np.ndarray, runtimes: Sequence[int]) -> dict[int, float]:
    """Each runtime's share of one block's load, every expert's split evenly over its replicas."""
    share = dict.fromkeys(runtimes, 0.0)
    for e, where in enumerate(row):
        for r in where:
            share[r] = share.get(r, 0.0) + float(load[e]) / len(where)
    return share


def _match(
    packs: list[list[int]], runtimes: list[int], nodes: list[int], current: tuple[Replicas, ...]
) -> list[int]:
    """The runtime of each device of one block: within each node, devices and runtimes paired greedily by the
    replicas a runtime already holds of the device's experts (most first; ties: the lower device, then runtime)."""
    hosts = list(runtimes)
    for node in sorted(set(nodes)):
        members = [i for i, n in enumerate(nodes) if n == node]
        pairs = sorted(
            ((sum(runtimes[j] in current[e] for e in set(packs[i])), i, j) for i in members for j in members),
            key=lambda t: (-t[0], t[1], t[2]),
        )
        taken_d, taken_r = set(), set()
        for _, i, j in pairs:
            if i not in taken_d and j not in taken_r:
                hosts[i] = runtimes[j]
                taken_d.add(i)
                taken_r.add(j)
    return hosts


def expected_load(num_blocks: int, num_experts: int, num_shared: int, top_k: int) -> np.ndarray:
    """float64 [B, E + shared]: a token's expected rows per expert before any is measured — top_k / E for each
    routed expert, 1 for a shared one (every token visits it)."""
    row = [top_k / num_experts] * num_experts + [1.0] * num_shared
    return np.array([row] * num_blocks, dtype=np.float64)
