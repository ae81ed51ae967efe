"""Every attention rank's own requests of a trace, as the simulations at scale price attention on a trace workload:
each rank's attention step reads its own requests' contexts, not a mean (docs/simulation.md "The barrier tax").

A deployment at a fixed number of requests per rank (the plan's, `--cache-max-num-seqs`) on a trace, decode only:

* **It starts in its steady state**: its first requests are drawn as a running deployment holds them
  (amoe.perf.model.traces.steady_state: by output length, part-way through), so the contexts are the steady
  state's from the first step, and bound to ranks one by one as the coordinator binds arrivals (below).
* **Each decode step** adds a token to the context of every request it ran and takes one from what it has left.
* **A request that ends is replaced** by the trace's next request (in arrival order, from a seeded starting
  point), as a saturated deployment's queue replaces it: the coordinator binds a request to the rank with the most
  free KV blocks among those with room for one more (coordinator/requests/load_balancer.py), reserving its input
  plus output tokens in blocks; when no freed rank has the blocks, it waits and its slot stays empty.

Slots are [ranks, per_rank], contiguous groups of them the micro-batches (ping-pong, two-batch overlap) or waves
(AEP) of a rank.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from amoe.perf.model.traces import RequestDraw, RequestTrace, steady_state

BLOCK_SIZE = 16  # tokens per KV block, amoe.config's cache.block_size default: what a reservation counts in


def initial_requests(trace: RequestTrace, n: int, seed: int) -> tuple[RequestDraw, int]:
    """The `n` requests a deployment starts with (steady_state, seeded) and the trace's request the queue goes on
    from: what the simulation holds and what `amoe bench barrier-tax` sends the runtime, alike."""
    rng = np.random.default_rng([seed, 58])
    draw = steady_state(trace, n, rng)
    return draw, int(rng.integers(len(trace)))


class TraceLoads:
    """`per_rank` requests on each of `ranks` ranks, from `trace` (module docstring); `kv_blocks`: each rank's KV
    blocks (0: no limit). The first requests (initial_requests) are bound one by one as the coordinator binds
    them on arrival, then each ended one is replaced from the trace."""

    def __init__(self, trace: RequestTrace, ranks: int, per_rank: int, seed: int, kv_blocks: int = 0) -> None:
        self.trace, self.kv_blocks = trace, kv_blocks
        draw, self.next = initial_requests(trace, ranks * per_rank, seed)
        self.context = np.zeros((ranks, per_rank))
        self.left = np.zeros((ranks, per_rank), dtype=np.int64)
        self.reserve = np.zeros((ranks, per_rank), dtype=np.int64)  # blocks each slot's request reserved
        self.reserved = np.zeros(ranks, dtype=np.int64)
        self.queue = deque(zip(draw.context.tolist(), draw.left.tolist(), self._blocks(draw.index).tolist()))
        self.ended = 0
        self._fill()

    def _blocks(self, index: np.ndarray) -> np.ndarray:
        t = self.trace
        return -(-(t.input_tokens[index] + t.output_tokens[index]) // BLOCK_SIZE)

    @property
    def shape(self) -> tuple[int, int]:
        return self.context.shape

    def loads(self, groups: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """[ranks, groups] rows and context tokens of each rank's `groups` contiguous groups of slots (a decode row
        attends its whole context: the context sum is also what it attends)."""
        ranks, per = self.shape
        size = math.ceil(per / groups)
        held = self.left > 0
        pad = size * groups - per
        rows = np.pad(held, ((0, 0), (0, pad))).reshape(ranks, groups, size).sum(2).astype(np.float64)
        ctx = np.pad(np.where(held, self.context, 0.0), ((0, 0), (0, pad))).reshape(ranks, groups, size)
        return rows, ctx.sum(2)

    def decode(self, ranks: np.ndarray | None = None, slots: slice = slice(None)) -> None:
        """One decode step of the requests in `slots` of `ranks` (None: every rank); those that end are
        replaced."""
        where = np.zeros(self.shape, dtype=bool)
        where[slice(None) if ranks is None else ranks, slots] = True
        where &= self.left > 0
        self.context[where] += 1
        self.left[where] -= 1
        ended = where & (self.left == 0)
        if ended.any():
            self.ended += int(ended.sum())
            self.reserved -= np.where(ended, self.reserve, 0).sum(1)
            self.reserve[ended] = 0
            self._fill()

    def _fill(self) -> None:
        """Hand each free slot, in the queue's order (then the trace's), its next request: to the rank with the
        most free blocks of those with a free slot and room for it (ties: the lowest rank), in its first free
        slot. When no such rank has the blocks, the request waits and the slots stay empty."""
        free = list(zip(*np.nonzero(self.left == 0)))
        t = self.trace
        while free:
            if not self.queue:
                index = self.next % len(t)
                self.queue.append((t.input_tokens[index], t.output_tokens[index], int(self._blocks(index))))
                self.next += 1
            context, left, need = self.queue[0]
            room = [
                k for k, (r, _) in enumerate(free)
                if not self.kv_blocks or self.reserved[r] + need <= self.kv_blocks
            ]  # fmt: skip
            if not room:
                return
            k = min(room, key=lambda k: (self.reserved[free[k][0]], free[k]))
            r, slot = free.pop(k)
            self.context[r, slot], self.left[r, slot], self.reserve[r, slot] = context, left, need
            self.reserved[r] += need
            self.queue.popleft()
