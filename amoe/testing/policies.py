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
