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


class Waves:
    """The `waves` rule (docs/scheduler.md) as the C++ scheduler keeps it, with its state: the grid's rows and
    parts out (`add`, `add_pending`), each wave's position (the block it was picked at, one on once that cell
    is drained empty) and the readiness stamps. `wave_cols`: the columns are an attention runtime's waves;
    otherwise (an expert runtime) the oldest non-empty block is run — with `set_rank_barrier`, the oldest
    block no attention rank is on its way to (the straggler wait and the meeting block: `arrived` / `served`
    notes, `now` in seconds); with `set_wave_groups` too, the oldest (block, group) cell none of its group's
    waves is on its way to (group cells)."""

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
        self.groups = 0  # group cells' wave groups (set_wave_groups)
        self.release_at = float("inf")

    def set_rank_barrier(self, num_ranks: int, max_hold_s: float, meet_span: int = 1) -> None:
        self.num_ranks, self.max_hold_s = num_ranks, max_hold_s
        self.meet_span = min(meet_span, max(1, self.num_blocks - 1))  # the meeting block's span
        self.groups, self.num_waves, self.group_waves, self.per_group = 0, 1, 1, 0
        self._notes(num_ranks)

    def set_wave_groups(self, num_waves: int, group_waves: int, cols_per_group: int) -> None:
        """Group cells: notes per (rank, wave); the columns are groups of `cols_per_group`; a pick is a (block,
        group) cell waiting for its group's waves on their way (block 0: served anywhere before it)."""
        self.num_waves, self.group_waves, self.per_group = num_waves, group_waves, cols_per_group
        self.groups = -(-num_waves // group_waves)
        self.cell_stamp = [[None] * self.groups for _ in range(self.num_blocks)]
        self._notes(self.num_ranks * num_waves)

    def _notes(self, n: int) -> None:
        never = float("-inf")
        self.served_at = [[never] * self.num_blocks for _ in range(n)]
        self.arrived_at = [[never] * self.num_blocks for _ in range(n)]
        self.turn = [-1.0] * n

    def _note(self, r: int, wave: int) -> int | None:
        if not 0 <= r < self.num_ranks:
            return None
        if not self.groups:
            return r
        return r * self.num_waves + wave if 0 <= wave < self.num_waves else None

    def arrived(self, b: int, r: int, now: float, wave: int = 0) -> None:
        self.now = now
        if (v := self._note(r, wave)) is not None:
            served = self.served_at[v][(b - 1) % self.num_blocks]
            if served > self.arrived_at[v][b]:  # it was on its way here: its turn-around
                self.turn[v] = max(0.0, now - served)
            self.arrived_at[v][b] = now

    def served(self, b: int, r: int, now: float, wave: int = 0) -> None:
        self.now = now
        if (v := self._note(r, wave)) is not None:
            self.served_at[v][b] = now

    def _wait(self, v: int, b: int, span: int) -> float:
        """Until when block b waits for note v: the nearest of the `span` blocks before b that served it since it
        last arrived at b."""
        if self.turn[v] < 0:
            return float("-inf")
        for d in range(1, span + 1):
            served = self.served_at[v][(b - d) % self.num_blocks]
            if served > self.arrived_at[v][b]:
                return served + min(2.0 * d * self.turn[v], self.max_hold_s)
        return float("-inf")

    def waits_until(self, b: int) -> float:
        span = self.meet_span if b == 0 else 1
        return max((self._wait(r, b, span) for r in range(self.num_ranks)), default=float("-inf"))

    def group_waits_until(self, b: int, g: int) -> float:
        span = self.num_blocks - 1 if b == 0 else 1
        waves = range(g * self.group_waves, min(self.num_waves, (g + 1) * self.group_waves))
        notes = [r * self.num_waves + w for r in range(self.num_ranks) for w in waves]
        return max((self._wait(v, b, span) for v in notes), default=float("-inf"))

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

    def _pick_group(self, force: bool) -> tuple[int, int] | None:
        per = self.per_group
        cells = [(b, g) for b in range(self.num_blocks) for g in range(self.groups)]
        for b, g in cells:
            self._stamp(self.cell_stamp[b], g, any(self.depths[b][g * per : (g + 1) * per]))
        live = [(b, g) for b, g in cells if self.cell_stamp[b][g] is not None]
        waits = {cell: self.group_waits_until(*cell) for cell in live}
        ready = [cell for cell in live if waits[cell] <= self.now]
        self.release_at = min((w for w in waits.values() if w > self.now), default=float("inf"))
        if not ready and not force:
            self.holding = True
            return None
        b, g = min(ready or live, key=lambda cell: self.cell_stamp[cell[0]][cell[1]])
        row = self.depths[b]
        return b, max(range(g * per, (g + 1) * per), key=lambda c: (row[c], -c))

    def pick(self, force: bool = False, now: float | None = None) -> tuple[int, int] | None:
        self.holding = False
        if now is not None:
            self.now = now
        depths, pending = self.depths, self.pending
        if not any(map(any, depths)):
            return None
        if not self.wave_cols and self.groups:
            return self._pick_group(force)
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


def pick(policy: str, depths: list[list[int]], lookahead: int, decay: float) -> tuple[int, int] | None:
    """The stateless policies' pick (`waves` keeps state: the Waves class)."""
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
