"""What a live move does to the expert runtimes' steps, on the emulated executor (amoe's scheduling against its own
cost model, not a GPU): a closed loop of requests on emulated Mixtral (2 blocks, skewed routing; 2 attention + 3
expert runtimes, 2 redundant experts a block) while the bench moves every redundant replica to the third runtime
and back, again and again (joins, switch, drains: the Rebalancer's own path).

Every heartbeat of an expert runtime carries its emulated GPU's busy time and elapsed time (the clock's own, so
the host's scheduling noise moves the interval's edges, not its content); the busy fraction between two heartbeats
is what the runtime's steps did with that stretch of emulated time. Each interval is put in a class by where it
lies against the moves — `before` (the 0.5 emulated s before a move starts), `during`, `after` (the 0.5 s after it
ends), `away` (the rest) — and the classes' mean busy fractions and token rates are printed side by side. A move
that cost the expert side time would show as `during` / `after` below `away`.

Run: .venv/bin/python bench/move_steps.py [--moves 8] [--time-scale 8]
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from amoe.config import AmoeConfig
from amoe.expert_map import ExpertMap
from amoe.sampling_params import SamplingParams
from amoe.testing.cluster import ServedCluster

NEAR_S = 0.5  # emulated seconds before a move's start / after its end that count as `before` / `after`
POLL_S = 0.005  # wall seconds between the bench's looks at heartbeats and the move's phase


def config(args: argparse.Namespace) -> AmoeConfig:
    return AmoeConfig().replace(
        parallel={"mode": "aep", "attn_ranks": 2, "expert_ranks": 3}, device={"kind": "cpu"},
        executor={"kind": "emulated"}, eplb={"num_redundant_experts": 2},
        emulation={"profile": "mixtral-8x7b-mqa:2", "gpu": "a100-80g", "top_k": 2, "routing": "skew-exp:0.08",
                   "time_scale": args.time_scale, "seed": args.seed},
        scheduler={"attn_batch_cap": 512}, cache={"max_num_seqs": args.streams},
    )  # fmt: skip


def swapped(table: list, runtimes: list[int]) -> list:
    """Every second replica moved to the expert runtime that holds neither of the two."""
    out = []
    for row in table:
        new = []
        for where in row:
            if len(where) == 2:
                third = next(r for r in runtimes if r not in where)
                where = [where[0], third]
            new.append(sorted(where))
        out.append(new)
    return out


class Record:
    """The run's clock (emulated seconds since its start), heartbeats, move phases and token arrivals."""

    def __init__(self, time_scale: float) -> None:
        self.scale, self.start = time_scale, time.perf_counter()
        # runtime → (now, elapsed_s, busy_s, held_wall_s): the emulated clock's own counters
        self.beats: dict[int, list[tuple[float, float, float, float]]] = {}
        self.phases: list[tuple[float, str | None]] = []  # (now, the move's phase or None)
        self.tokens: list[tuple[float, int]] = []

    def now(self) -> float:
        return (time.perf_counter() - self.start) / self.scale


async def watch(cluster, record: Record) -> None:
    """Each expert runtime's heartbeats (a new stats dict each) and each change of the move's phase."""
    seen: dict[int, int] = {}
    phase = None
    while True:
        for r in cluster.runtimes:
            stats = r.stats
            if r.role != "expert" or stats is None or seen.get(r.id) == id(stats):
                continue
            seen[r.id] = id(stats)
            em = stats.get("emulated") or {}
            beat = (record.now(), em["elapsed_s"], em["busy_s"], em["held_wall_s"])
            record.beats.setdefault(r.id, []).append(beat)
        move = cluster.placement.move
        now_phase = None if move is None else move.phase
        if now_phase != phase:
            phase = now_phase
            record.phases.append((record.now(), phase))
        await asyncio.sleep(POLL_S)


async def drive(backend, args: argparse.Namespace, record: Record) -> list[str]:
    """The closed loop of requests, and the moves between the start-up map and its swap, one every
    `args.every_s` emulated seconds after the warm-up; the moves' outcomes."""
    rebalancer = backend.cluster.placement
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    end = args.warmup_s + (args.moves + 1) * args.every_s
    ids = iter(range(1, 10**9))

    async def stream(i: int) -> None:
        while record.now() < end:
            rid = next(ids)
            prompt = [3 + (rid + j) % 97 for j in range(64 + rid * 37 % 192)]
            async for delta in backend.generate(rid, prompt, params, rank=i % 2):
                record.tokens.append((record.now(), len(delta.token_ids)))

    tasks = [asyncio.ensure_future(stream(i)) for i in range(args.streams)]
    watcher = asyncio.ensure_future(watch(backend.cluster, record))
    start = rebalancer.map.table()
    tables = [swapped(start, rebalancer.expert_runtimes()), start]
    outcomes = []
    for k in range(args.moves):
        while record.now() < args.warmup_s + (k + 1) * args.every_s:
            await asyncio.sleep(POLL_S)
        epoch = rebalancer.start(ExpertMap.of(tables[k % 2]), "bench")
        outcomes.append(await rebalancer.wait(epoch))
    await asyncio.gather(*tasks)
    watcher.cancel()
    return outcomes


def spans(phases: list[tuple[float, str | None]]) -> list[tuple[float, float]]:
    out, started = [], None
    for t, phase in phases:
        if phase is not None and started is None:
            started = t
        elif phase is None and started is not None:
            out.append((started, t))
            started = None
    return out


def classify(a: float, b: float, moves: list[tuple[float, float]]) -> str:
    """Where the interval [a, b) lies against the moves (the nearest class first)."""
    if any(a < end and b > start for start, end in moves):
        return "during"
    if any(end <= a < end + NEAR_S for _, end in moves):
        return "after"
    if any(start - NEAR_S < b <= start for start, _ in moves):
        return "before"
    return "away"


def summarise(record: Record, warmup_s: float, end_s: float) -> dict:
    """Busy fractions and token rates by class, over [warmup_s, end_s) (the streams stop taking new requests at
    end_s)."""
    moves = spans(record.phases)
    busy: dict[str, list[float]] = {"before": [], "during": [], "after": [], "away": []}
    late: dict[str, list[float]] = {k: [] for k in busy}
    covered: dict[str, float] = dict.fromkeys(busy, 0.0)
    tokens: dict[str, int] = dict.fromkeys(busy, 0)
    for beats in record.beats.values():
        for (t0, e0, b0, h0), (t1, e1, b1, h1) in zip(beats, beats[1:]):
            if t0 < warmup_s or t1 > end_s or e1 <= e0:
                continue
            kind = classify(t0, t1, moves)
            busy[kind].append((b1 - b0) / (e1 - e0))
            # The host's share: wall time the holds ran past their emulated length, per wall second.
            late[kind].append((h1 - h0 - (b1 - b0) * record.scale) / ((e1 - e0) * record.scale))
    edges = np.arange(warmup_s, end_s - 0.05, 0.05)
    for a in edges:  # token rate by the same classes, on 50 ms bins
        kind = classify(a, a + 0.05, moves)
        covered[kind] += 0.05
        tokens[kind] += sum(n for t, n in record.tokens if a <= t < a + 0.05)
    return {
        "moves": len(moves),
        "move_s": [round(b - a, 4) for a, b in moves],
        "busy_fraction": {k: float(np.mean(v)) if v else None for k, v in busy.items()},
        "intervals": {k: len(v) for k, v in busy.items()},
        "busy_sd": {k: float(np.std(v)) if v else None for k, v in busy.items()},
        "host_late": {k: float(np.mean(v)) if v else None for k, v in late.items()},
        "tokens_per_s": {k: tokens[k] / covered[k] if covered[k] else None for k in busy},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moves", type=int, default=8)
    ap.add_argument("--every-s", type=float, default=1.5, help="emulated seconds between moves")
    ap.add_argument("--warmup-s", type=float, default=1.5)
    ap.add_argument("--time-scale", type=float, default=8.0)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    record = Record(args.time_scale)
    with ServedCluster(None, config(args)) as cluster:
        record.start = time.perf_counter()
        outcomes = cluster.call(drive(cluster.backend, args, record), None)
    out = summarise(record, args.warmup_s, args.warmup_s + (args.moves + 1) * args.every_s)
    nan = float("nan")
    print(f"{'class':<8} {'intervals':>9} {'expert busy':>12} {'sd':>6} {'host late':>10} {'tokens/s':>9}")
    for k in ("away", "before", "during", "after"):
        b, sd, late, tps = (out[f][k] for f in ("busy_fraction", "busy_sd", "host_late", "tokens_per_s"))
        print(f"{k:<8} {out['intervals'][k]:>9} {b if b is not None else nan:>12.3f} {sd if sd is not None else nan:>6.3f} "
              f"{late if late is not None else nan:>10.3f} {tps if tps is not None else nan:>9.0f}")  # fmt: skip
    print(
        f"moves: {outcomes.count('completed')} completed of {len(outcomes)}; emulated seconds each {out['move_s']}"
    )
    print("(expert busy: the emulated GPU's busy fraction between heartbeats; host late: wall time its holds ran past "
          "their length, per wall second; emulated, not a GPU)")  # fmt: skip
    print(json.dumps({"bench": "move_steps", "args": vars(args), "outcomes": outcomes, **out}))


if __name__ == "__main__":
    main()
