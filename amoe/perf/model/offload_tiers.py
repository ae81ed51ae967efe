"""Emulated expert offloading: device ← host ← SSD tiers in the cost model (MoE-Infinity §5.3 and §6).

An emulated expert runtime with an offload budget keeps at most `device_experts` experts in device memory; the
rest sit in host memory (up to `host_experts`, then on SSD). Experts first fill the device block by block, then the
host, as the paper's initial placement does. When a step needs an expert that is not on the device, the step waits
for its copy: one copy at a time crosses PCIe (host → device) and one the NVMe link (SSD → host), each a
LinkProfile of gpus.py, pipelined (an SSD expert's PCIe copy starts when its host copy lands). While PCIe is
idle, the tiers copy what the policy's queue wants (`Policy.wanted`), never evicting an expert the queue ranks
above the one they load, nor one the running step holds. With the LRU policy and no prefetching this is
on-demand fetching, the paper's PyTorch-UM baseline.

Time is the emulated GPU's (seconds); `acquire` returns when an expert is usable, and the executor holds its step
until then (executor.EmulatedExpertExecutor).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from amoe.errors import ConfigError
from amoe.offload.policy import Key, Policy
from amoe.perf.model import cost_model
from amoe.perf.model.gpus import NVME_GEN4, PCIE4_X16, LinkProfile

logger = logging.getLogger(__name__)


@dataclass
class TierStats:
    device_hits: int = 0  # usable on the device when asked for
    late: int = 0  # a prefetch still in flight: waited for it
    host_misses: int = 0  # copied host → device on demand
    ssd_misses: int = 0  # copied SSD → host → device on demand
    prefetched: int = 0  # PCIe copies the prefetcher started
    prefetch_hits: int = 0  # device hits on experts the prefetcher loaded and nobody used since
    pcie_bytes: float = 0.0
    nvme_bytes: float = 0.0
    stall_s: float = 0.0  # time steps waited for copies

    @property
    def recall(self) -> float:
        needed = self.prefetch_hits + self.late + self.host_misses + self.ssd_misses
        return self.prefetch_hits / needed if needed else 1.0


class EmulatedTiers:
    """Which experts are on the device, in host memory or on SSD, and when the copies in flight land."""

    def __init__(
        self,
        policy: Policy,
        num_blocks: int,
        num_experts: int,
        expert_bytes: float,
        device_experts: int,
        host_experts: int | None = None,
        pcie: LinkProfile = PCIE4_X16,
        nvme: LinkProfile = NVME_GEN4,
        prefetch: bool = True,
    ) -> None:
        if device_experts < 1:
            raise ConfigError(f"the offload budget must hold at least one expert; got {device_experts}")
        self.policy, self.expert_bytes, self.prefetch = policy, expert_bytes, prefetch
        self.device_experts = device_experts
        self.host_experts = num_blocks * num_experts if host_experts is None else host_experts
        order = [(b, e) for b in range(num_blocks) for e in range(num_experts)]  # topological: block by block
        self.device: dict[Key, float] = dict.fromkeys(order[:device_experts], 0.0)  # key -> when usable
        self.host: dict[Key, float] = dict.fromkeys(
            order[device_experts : device_experts + self.host_experts], 0.0
        )
        self.pcie_s = cost_model.transfer_time(expert_bytes, pcie)
        self.nvme_s = cost_model.transfer_time(expert_bytes, nvme)
        self.pcie_free = self.nvme_free = 0.0
        self.fresh: set[Key] = set()
        self.pinned: set[Key] = set()
        self.stats = TierStats()

    def routed(self, seq: int, block: int, experts: Iterable[int], counts: Iterable[int]) -> None:
        self.policy.routed(seq, block, list(experts), list(counts))

    def end(self, seq: int) -> None:
        self.policy.end(seq)

    def acquire(self, key: Key, now: float) -> float:
        """When `key` is usable on the device, copying it there if it is not (the caller holds until then)."""
        if self.prefetch:
            self._pump(now)
        s = self.stats
        if key in self.device:
            ready = max(now, self.device[key])
            if self.device[key] <= now:
                s.device_hits += 1
                s.prefetch_hits += key in self.fresh
            else:
                s.late += 1
        else:
            was_on_host = key in self.host and self.host[key] <= now
            on_host = self._to_host(key, now)
            s.host_misses += was_on_host
            s.ssd_misses += not was_on_host
            start = max(on_host, self.pcie_free)  # the copy in flight finishes first: PCIe does not preempt
            if not self._make_room(key, start, None):
                raise ConfigError("every device expert is held by the running step: raise the offload budget")
            ready = self.pcie_free = start + self.pcie_s
            self.device[key] = ready
            s.pcie_bytes += self.expert_bytes
        self.fresh.discard(key)
        self.policy.used(key)
        s.stall_s += ready - now
        return ready

    def _to_host(self, key: Key, now: float) -> float:
        """When `key` is in host memory, reading it from SSD if needed."""
        if key in self.host:
            return max(now, self.host[key])
        start = max(now, self.nvme_free)
        landed = self.nvme_free = start + self.nvme_s
        if len(self.host) >= self.host_experts:
            victims = [k for k, t in self.host.items() if t <= now]
            if victims:
                del self.host[self.policy.victim(victims)]
        self.host[key] = landed
        self.stats.nvme_bytes += self.expert_bytes
        return landed

    def _make_room(self, key: Key, now: float, rank: dict[Key, int] | None) -> bool:
        if len(self.device) < self.device_experts:
            return True
        candidates = [k for k, t in self.device.items() if t <= now and k not in self.pinned]
        if not candidates and rank is None:
            # A step needing more experts than the budget holds runs them one after another: an on-demand copy may
            # evict one of the step's experts that already ran.
            candidates = [k for k, t in self.device.items() if t <= now and k != key]
        if not candidates:
            return False
        victim = self.policy.victim(candidates)
        if rank is not None and (
            rank.get(victim, len(rank)) < rank[key] or not self.policy.admits(key, victim)
        ):
            return False  # the queue wants the victim more than what would replace it
        del self.device[victim]
        self.fresh.discard(victim)
        return True

    def _pump(self, until: float) -> None:
        """Prefetch over PCIe while it is idle before `until` (SSD experts are staged to host on the way)."""
        if self.pcie_free >= until:
            return
        wanted = self.policy.wanted(self.device_experts)
        rank = {k: i for i, k in enumerate(wanted)}
        for key in wanted:
            if self.pcie_free >= until:
                break
            if key in self.device:
                continue
            on_host = self._to_host(key, self.pcie_free)
            if not self._make_room(key, self.pcie_free, rank):
                break
            start = max(on_host, self.pcie_free)
            self.device[key] = self.pcie_free = start + self.pcie_s
            self.fresh.add(key)
            self.stats.prefetched += 1
            self.stats.pcie_bytes += self.expert_bytes


# The expert runtime never hears that a request finished; the tiers end the sequence seen longest ago past this many.
MAX_ACTIVE_SEQUENCES = 256


@dataclass(frozen=True)
class OffloadSpec:
    """An emulated offload budget: device bytes for experts, the policy by name, its EAMC, host bytes (None: every
    expert fits in host memory, as on the paper's 1 TB testbed)."""

    budget_bytes: float
    policy: str = "activation"
    eamc_path: str | None = None
    host_bytes: float | None = None
    prefetch: bool = True


class SequenceTracker:
    """Routing of an expert step reaches the policy per request; the oldest of too many requests is ended."""

    def __init__(self, tiers: EmulatedTiers) -> None:
        self.tiers = tiers
        self._seen: dict[int, None] = {}  # insertion-ordered: oldest first

    def routed(self, block: int, expert: int, request_ids) -> None:
        counts: dict[int, int] = {}
        for rid in request_ids:
            counts[rid] = counts.get(rid, 0) + 1
        for rid, n in counts.items():
            self._seen.pop(rid, None)
            self._seen[rid] = None
            self.tiers.routed(rid, block, [expert], [n])
        while len(self._seen) > MAX_ACTIVE_SEQUENCES:
            oldest = next(iter(self._seen))
            del self._seen[oldest]
            self.tiers.end(oldest)


def build_tiers(spec: OffloadSpec, model, expert_bytes: float) -> EmulatedTiers:
    """The tiers of one emulated expert runtime holding every block of `model`'s routed experts."""
    from amoe.offload.choose import make_policy  # noqa: PLC0415 - the activation policy loads numpy files

    device_experts = int(spec.budget_bytes // expert_bytes)
    if device_experts < 1:
        raise ConfigError(
            f"offload budget {spec.budget_bytes:.3g} B holds no expert: the minimum is one expert, {expert_bytes:.3g} B"
        )
    total = model.num_blocks * model.num_experts
    if device_experts >= total:
        logger.info("[offload] the budget holds all %d experts: nothing is offloaded", total)
    host = None if spec.host_bytes is None else int(spec.host_bytes // expert_bytes)
    policy = make_policy(spec.policy, model.num_blocks, model.num_experts, spec.eamc_path)
    return EmulatedTiers(
        policy, model.num_blocks, model.num_experts, expert_bytes, min(device_experts, total), host,
        prefetch=spec.prefetch,
    )  # fmt: skip
