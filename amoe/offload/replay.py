"""Trace replay: a cache of `capacity` experts driven by a routing trace, under any Policy, and Bélády's optimum.

Sequences run in lockstep batches (trace.batches): per step, per block, every running sequence's routing reaches
the policy (`routed`), then the experts any of them picked are accessed one after another, in expert order; each
access is a hit (resident) or a miss that loads the expert, evicting the policy's victim when the cache is full.
Then the batch's finished sequences `end`. An access needs only its own expert resident (experts of a block run
one after another), so the demand-paging replay is the classic paging problem and Bélády's rule — evict the expert
used again farthest in the future — is optimal for it: `belady` gives the ceiling no online policy can pass
(tests/test_offload_replay.py checks it against brute force).

`replay_timed` adds time and a link: each block computes for `block_s`, one copy at a time crosses the link at
`bandwidth` (MoE-Infinity §5.3: "one expert at a time"), an on-demand miss waits for the copy in flight and then its
own, and while the link is idle the store copies what `policy.wanted()` asks for (never evicting an expert the
queue ranks above the one it loads, never one the running block holds). Prefetch recall is the share of the
accesses needing a copy whose copy the prefetcher had finished before they came (§8.3's "recall of experts
activated covered by prefetching"; a copy still in flight counts as not covered).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from amoe.offload.policy import Key, Policy
from amoe.offload.trace import Trace, batches

END = -1  # an event's block when it ends sequences instead of running a block


@dataclass
class Event:
    """One block of one step of a batch (`routing`: per running sequence (seq, experts, tokens); `keys`: the
    experts accessed, in order), or the end of sequences (block END, `ended`)."""

    block: int
    routing: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)
    keys: list[Key] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    first: bool = False  # the step's first block (0, or the first decoder block after the encoder's step)


def events(trace: Trace, batch_size: int) -> list[Event]:
    """The replay's event list: the same for every policy, so they are compared on identical accesses."""
    out = []
    for batch in batches(trace, batch_size):
        longest = max(len(trace.sequences[s]) for s in batch)
        for i in range(longest):
            running = [s for s in batch if i < len(trace.sequences[s])]
            for b in range(trace.num_blocks):
                # A block no running sequence routed to this step (an encoder block after prefill) did not run:
                # no event, so no access, no policy call and, in the timed replay, no block time.
                routing = [
                    (s, *trace.sequences[s][i][b]) for s in running if len(trace.sequences[s][i][b][0])
                ]
                if not routing:
                    continue
                experts = np.unique(np.concatenate([r[1] for r in routing]))
                first = not out or out[-1].block == END or out[-1].block >= b
                out.append(Event(b, routing, [(b, int(e)) for e in experts], first=first))
        out.append(Event(END, ended=list(batch)))
    return out


def accesses(evs: list[Event]) -> list[Key]:
    return [key for ev in evs for key in ev.keys]


@dataclass
class CacheResult:
    policy: str
    capacity: int
    hits: int
    misses: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)


def replay(evs: list[Event], policy: Policy, capacity: int) -> CacheResult:
    """Demand paging: a miss loads its expert, evicting `policy.victim` when `capacity` experts are resident."""
    resident: set[Key] = set()
    hits = misses = 0
    for ev in evs:
        if ev.block == END:
            for seq in ev.ended:
                policy.end(seq)
            continue
        for seq, experts, tokens in ev.routing:
            policy.routed(seq, ev.block, experts, tokens)
        for key in ev.keys:
            if key in resident:
                hits += 1
            else:
                misses += 1
                if len(resident) >= capacity:
                    resident.remove(policy.victim(resident))
                resident.add(key)
            policy.used(key)
    return CacheResult(policy.name, capacity, hits, misses)


def belady(keys: list[Key], capacity: int) -> CacheResult:
    """Bélády's MIN on the access list: on a miss with a full cache, evict the resident expert whose next access
    is farthest away (or never comes)."""
    never = len(keys)
    next_use = [never] * len(keys)
    last: dict[Key, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        next_use[i] = last.get(keys[i], never)
        last[keys[i]] = i
    resident: dict[Key, int] = {}  # key -> its next access
    heap: list[tuple[int, Key]] = []  # (-next access, key), stale entries skipped
    hits = misses = 0
    for i, key in enumerate(keys):
        if key in resident:
            hits += 1
        else:
            misses += 1
            if len(resident) >= capacity:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) == -neg:
                        del resident[victim]
                        break
        resident[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return CacheResult("belady", capacity, hits, misses)


@dataclass
class TimedResult:
    policy: str
    capacity: int
    bandwidth: float
    hits: int = 0  # resident and arrived when accessed (cached or prefetched)
    prefetch_hits: int = 0  # of those, loaded by the prefetcher and not used since
    late: int = 0  # a prefetch still in flight when accessed: waited for it
    misses: int = 0  # on-demand copies
    prefetched: int = 0  # copies the prefetcher started
    stall_s: float = 0.0  # time blocks waited for copies
    time_s: float = 0.0
    steps: int = 0

    @property
    def recall(self) -> float:
        needed = self.prefetch_hits + self.late + self.misses
        return self.prefetch_hits / needed if needed else 1.0

    @property
    def hit_ratio(self) -> float:
        return self.hits / max(self.hits + self.late + self.misses, 1)


class _Link:
    """The store of the timed replay: what is resident, what is in flight, and the one link copies cross."""

    def __init__(self, policy: Policy, capacity: int, copy_s: float, result: TimedResult) -> None:
        self.policy, self.capacity, self.copy_s, self.r = policy, capacity, copy_s, result
        self.arrival: dict[Key, float] = {}  # resident or in flight -> when its copy lands
        self.fresh: set[Key] = set()  # loaded by the prefetcher, not used since
        self.free_at = 0.0  # when the link finishes its current copy
        self.pinned: set[Key] = set()

    def _evict_for(self, key: Key, now: float, rank: dict[Key, int] | None = None) -> bool:
        if len(self.arrival) < self.capacity:
            return True
        candidates = [k for k, t in self.arrival.items() if t <= now and k not in self.pinned]
        if not candidates and rank is None:
            # A step needing more experts than the budget holds runs them one after another: an on-demand copy may
            # evict one of the step's experts that already ran.
            candidates = [k for k, t in self.arrival.items() if t <= now and k != key]
        if not candidates:
            return False
        victim = self.policy.victim(candidates)
        if rank is not None and (
            rank.get(victim, len(rank)) < rank[key] or not self.policy.admits(key, victim)
        ):
            return False  # the queue wants the victim more than the expert it would make room for
        del self.arrival[victim]
        self.fresh.discard(victim)
        return True

    def pump(self, until: float) -> None:
        """Prefetch while the link is idle before `until`."""
        if self.free_at >= until:
            return
        wanted = self.policy.wanted(self.capacity)
        rank = {k: i for i, k in enumerate(wanted)}
        for key in wanted:
            if self.free_at >= until:
                break
            if key in self.arrival:
                continue
            if not self._evict_for(key, self.free_at, rank):
                break
            self.free_at += self.copy_s
            self.arrival[key] = self.free_at
            self.fresh.add(key)
            self.r.prefetched += 1

    def access(self, key: Key, now: float) -> float:
        """Make `key` usable; returns when it is."""
        r = self.r
        if key in self.arrival:
            landed = self.arrival[key]
            if landed <= now:
                r.hits += 1
                r.prefetch_hits += key in self.fresh
            else:
                r.late += 1
            self.fresh.discard(key)
            return max(now, landed)
        r.misses += 1
        start = max(now, self.free_at)  # the copy in flight finishes first (PCIe does not preempt)
        if not self._evict_for(key, start):
            raise RuntimeError("no evictable expert: capacity below one block's experts")
        self.free_at = start + self.copy_s
        self.arrival[key] = self.free_at
        return self.free_at


def replay_timed(
    evs: list[Event],
    policy: Policy,
    capacity: int,
    *,
    bandwidth: float,
    expert_bytes: float,
    block_s: float,
    latency_s: float = 0.0,
) -> TimedResult:
    """Replay with one link of `bandwidth` bytes/s and `block_s` of compute per block (module docstring)."""
    result = TimedResult(policy.name, capacity, bandwidth)
    link = _Link(policy, capacity, latency_s + expert_bytes / bandwidth, result)
    now = 0.0
    for ev in evs:
        if ev.block == END:
            for seq in ev.ended:
                policy.end(seq)
            continue
        link.pump(now)
        for seq, experts, tokens in ev.routing:
            policy.routed(seq, ev.block, experts, tokens)
        link.pinned = set(ev.keys)
        ready = now  # the block's experts run one after another: each waits for the ones before it
        for key in ev.keys:
            ready = link.access(key, ready)
            policy.used(key)
        result.stall_s += ready - now
        now = ready + block_s
        result.steps += ev.first
    result.time_s = now
    return result
