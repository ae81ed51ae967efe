"""Pure-Python scheduling policies: the oracle the C++ scheduler is tested against and the bench baseline.

`depths[b][c]` is the number of rows waiting in queue (block b, column c). Each function returns the (b, c)
to drain, or None when every queue is empty; ties go to the lowest (b, c).
"""

from __future__ import annotations


def defrag(depths: list[list[int]], lookahead: int, decay: float) -> tuple[int, int] | None:
    """Algorithm 1 of the AMoE paper, as printed (K = lookahead, δ = decay, blocks wrap modulo N_B)."""
    num_blocks, num_cols = len(depths), len(depths[0])
    scores = [[0.0] * num_cols for _ in range(num_blocks)]
    for b in range(num_blocks):
        lscore = 0.0
        for k in range(1, lookahead + 1):
            total = sum(depths[(b + k) % num_blocks])
            lscore = lscore + (total / num_cols) * decay**k
        for e in range(num_cols):
            if depths[b][e] > 0:
                scores[b][e] = lscore + depths[b][e]
    return _argmax(depths, scores)


def mtfs(depths: list[list[int]]) -> tuple[int, int] | None:
    """Most tokens first."""
    return _argmax(depths, depths)


def flfs(depths: list[list[int]]) -> tuple[int, int] | None:
    """First layer first: the lowest block with waiting rows, and its deepest queue."""
    for b, row in enumerate(depths):
        if any(row):
            return b, max(range(len(row)), key=lambda c: (row[c], -c))
    return None


def wave(depths: list[list[int]], pending: list[int] | None = None) -> tuple[int, int] | None:
    """Blocks whole, compared by their total rows; a block with rows still out (pending[b] > 0) waits for them.
    Of the ready blocks the fullest, and its deepest queue; None when nothing is waiting or nothing is ready (a
    hold: the C++ scheduler's `holding`)."""
    pending = pending or [0] * len(depths)
    totals = [sum(row) if pending[b] == 0 else 0 for b, row in enumerate(depths)]
    if max(totals) == 0:
        return None
    b = totals.index(max(totals))
    row = depths[b]
    return b, max(range(len(row)), key=lambda c: (row[c], -c))


class Waves:
    """The `waves` rule (docs/engine.md "The waves rule") as the C++ scheduler keeps it, with its state: the grid's
    rows and parts out (`add`, `add_pending`), each wave's position (the block it was picked at, one on once that
    cell is drained empty) and the readiness stamps. `wave_cols`: the columns are an attention runtime's waves;
    otherwise (an expert runtime) the oldest non-empty block is run — with `set_rank_barrier`, the oldest block no
    attention rank is on its way to (items 9-10: `arrived` / `served` notes, `now` in seconds)."""

    def __init__(self, num_blocks: int, num_cols: int, wave_cols: bool) -> None:
        self.num_blocks, self.num_cols, self.wave_cols = num_blocks, num_cols, wave_cols
        self.depths = [[0] * num_cols for _ in range(num_blocks)]
        self.pending = [[0] * num_cols for _ in range(num_blocks)]
        self.position = [0] * num_cols
        self.wave_stamp = [None] * num_cols
        self.block_stamp = [None] * num_blocks
        self.next_stamp = 0
        self.holding = False
        self.num_ranks, self.max_hold_s, self.now = 0, 0.0, 0.0
        self.release_at = float("inf")

    def set_rank_barrier(self, num_ranks: int, max_hold_s: float, meet_span: int = 1) -> None:
        never = float("-inf")
        self.num_ranks, self.max_hold_s = num_ranks, max_hold_s
        self.meet_span = min(meet_span, max(1, self.num_blocks - 1))  # block 0 looks this far back (item 10)
        self.served_at = [[never] * self.num_blocks for _ in range(num_ranks)]
        self.arrived_at = [[never] * self.num_blocks for _ in range(num_ranks)]
        self.turn = [-1.0] * num_ranks

    def arrived(self, b: int, r: int, now: float) -> None:
        self.now = now
        if 0 <= r < self.num_ranks:
            served = self.served_at[r][(b - 1) % self.num_blocks]
            if served > self.arrived_at[r][b]:  # it was on its way here: its turn-around
                self.turn[r] = max(0.0, now - served)
            self.arrived_at[r][b] = now

    def served(self, b: int, r: int, now: float) -> None:
        self.now = now
        if 0 <= r < self.num_ranks:
            self.served_at[r][b] = now

    def waits_until(self, b: int) -> float:
        until = float("-inf")
        for r in range(self.num_ranks):
            if self.turn[r] < 0:
                continue
            for d in range(1, (self.meet_span if b == 0 else 1) + 1):  # the nearest block that served r since
                served = self.served_at[r][(b - d) % self.num_blocks]
                if served > self.arrived_at[r][b]:
                    until = max(until, served + min(2.0 * d * self.turn[r], self.max_hold_s))
                    break
        return until

    def add(self, b: int, c: int, delta: int) -> None:
        old = self.depths[b][c]
        self.depths[b][c] = old + delta
        if self.wave_cols and old > 0 and old + delta == 0 and self.position[c] == b:
            self.position[c] = (b + 1) % self.num_blocks  # the wave left this block

    def add_pending(self, b: int, delta: int, c: int = 0) -> None:
        self.pending[b][c] += delta

    def _stamp(self, stamps: list, i: int, ready: bool) -> None:
        if not ready:
            stamps[i] = None
        elif stamps[i] is None:
            stamps[i] = self.next_stamp
            self.next_stamp += 1

    def pick(self, force: bool = False, now: float | None = None) -> tuple[int, int] | None:
        self.holding = False
        if now is not None:
            self.now = now
        depths, pending = self.depths, self.pending
        if not any(map(any, depths)):
            return None
        if not self.wave_cols:
            for b, row in enumerate(depths):
                self._stamp(self.block_stamp, b, any(row))
            live = [b for b in range(self.num_blocks) if self.block_stamp[b] is not None]
            waits = {b: self.waits_until(b) for b in live} if self.num_ranks else {}
            ready = [b for b in live if waits.get(b, float("-inf")) <= self.now]
            self.release_at = min((w for w in waits.values() if w > self.now), default=float("inf"))
            if not ready and not force:
                self.holding = True
                return None
            b = min(ready or live, key=lambda b: self.block_stamp[b])
            row = depths[b]
            return b, max(range(len(row)), key=lambda c: (row[c], -c))
        fronts = {}
        for w in range(self.num_cols):
            ring = [(self.position[w] + i) % self.num_blocks for i in range(self.num_blocks)]
            front = next((b for b in ring if depths[b][w] or pending[b][w]), None)
            ready = front is not None and depths[front][w] > 0 and pending[front][w] == 0
            self._stamp(self.wave_stamp, w, ready)
            if ready:
                fronts[w] = front
        if fronts:
            w = min(fronts, key=lambda w: self.wave_stamp[w])
            b = fronts[w]
        elif not force:
            self.holding = True
            return None
        else:
            cells = [(depths[b][c], -b, -c) for b in range(self.num_blocks) for c in range(self.num_cols)]
            _, nb, nc = max(cells)
            b, w = -nb, -nc
        self.position[w] = b
        return b, w


def pick(
    policy: str, depths: list[list[int]], lookahead: int, decay: float, pending: list[int] | None = None
) -> tuple[int, int] | None:
    if policy == "wave":
        return wave(depths, pending)
    if policy == "defrag":
        return defrag(depths, lookahead, decay)
    if policy == "mtfs":
        return mtfs(depths)
    if policy == "flfs":
        return flfs(depths)
    raise ValueError(f"unknown policy {policy!r}")


def _argmax(depths, scores) -> tuple[int, int] | None:
    best, arg = None, None
    for b, row in enumerate(scores):
        for c, s in enumerate(row):
            if depths[b][c] > 0 and (best is None or s > best):
                best, arg = s, (b, c)
    return arg
