"""Live rebalances while greedy streams run (tiny model on the CPU, 1 attention + 2 expert runtimes): for each move
— every layer on both runtimes, every home swapped, EPLB's map for the measured load, back to the start — how long
it takes from its start to its last drain, what it moved, and the streams' tokens/s while moves run against a run
without any. Then EPLB on emulated Mixtral with skewed routing (the emulated executor: amoe against its own cost
model, not a GPU): the balancedness of the start-up map and of the map EPLB computed for the measured load.

Run: .venv/bin/python bench/rebalance.py [--plane inline|gloo] [--rounds 3]
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from amoe.config import AmoeConfig
from amoe.expert_map import ExpertMap
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams
from amoe.testing.cluster import ServedCluster

PROMPTS = [[1, 5 + i, 60 + 11 * i, 9] for i in range(8)]
MAX_TOKENS = 96


async def streams_with_moves(backend, tables: list) -> tuple[float, list[dict]]:
    """Every prompt streamed at once while the moves to `tables` run one after another (None: EPLB's map); the
    streams' tokens/s and each move's record."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rebalancer, moves = backend.cluster.placement, []

    async def stream(i: int) -> int:
        return sum([len(d.token_ids) async for d in backend.generate(10_000 + i, PROMPTS[i], params, 0)])

    start = time.perf_counter()
    tasks = [asyncio.ensure_future(stream(i)) for i in range(len(PROMPTS))]
    for table in tables:
        target = await rebalancer.planned() if table is None else ExpertMap.of(table)
        joins, drains = rebalancer.map.moves(target)
        before = rebalancer.counters.moved_bytes
        t0 = time.perf_counter()
        epoch = rebalancer.start(target, "bench")
        outcome = await rebalancer.wait(epoch) if rebalancer.move is not None else "unchanged"
        moves.append({
            "move": "eplb" if table is None else f"table {len(moves) + 1}", "outcome": outcome,
            "seconds": time.perf_counter() - t0, "joins": sum(map(len, joins.values())),
            "drains": sum(map(len, drains.values())), "bytes": rebalancer.counters.moved_bytes - before,
        })  # fmt: skip
    tokens = sum(await asyncio.gather(*tasks))
    return tokens / (time.perf_counter() - start), moves


def cpu_moves(plane: str, rounds: int) -> tuple[list[dict], float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model("tiny", Path(tmp) / "tiny", seed=0)
        config = AmoeConfig().replace(
            parallel={"attn_ranks": 1, "expert_ranks": 2}, device={"kind": "cpu"}, transport={"plane": plane},
            eplb={"num_redundant_experts": 2},
        )  # fmt: skip
        with ServedCluster(model, config) as cluster:
            start = cluster.backend.placement()["replicas"]
            full = [[[1, 2] for _ in row] for row in start]
            swapped = [[[3 - w[0]] if len(w) == 1 else w for w in row] for row in start]
            cluster.call(
                streams_with_moves(cluster.backend, []), 300
            )  # warm-up: first prefills, first batches
            moves, quiet, busy = [], [], []
            for _ in range(rounds):  # alternated, so a drift of the shared machine hits both alike
                quiet.append(cluster.call(streams_with_moves(cluster.backend, []), 300)[0])
                tps, done = cluster.call(
                    streams_with_moves(cluster.backend, [full, swapped, None, start]), 300
                )
                moves += done
                busy.append(tps)
    return moves, sum(quiet) / len(quiet), sum(busy) / len(busy)


def emulated_balance() -> dict:
    config = AmoeConfig().replace(
        parallel={"attn_ranks": 1, "expert_ranks": 2}, device={"kind": "cpu"}, executor={"kind": "emulated"},
        emulation={"profile": "mixtral-8x7b-mqa:2", "top_k": 2, "routing": "skew-exp", "time_scale": 2},
        eplb={"num_redundant_experts": 2, "window_size": 1000},
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    with ServedCluster(None, config) as cluster:
        cluster.generate([[11, 12, 13, 14]] * 8, params, timeout=300)
        before = cluster.backend.placement()["balancedness"]
        after = cluster.call(cluster.backend.rebalance(None, wait=True), 120)["balancedness"]
    return {"before": before, "after": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plane", default="inline", choices=("inline", "gloo"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    moves, quiet, busy = cpu_moves(args.plane, args.rounds)
    print(f"{'move':<10} {'outcome':<10} {'seconds':>8} {'joins':>6} {'drains':>7} {'MB loaded':>10}")
    for m in moves:
        print(f"{m['move']:<10} {m['outcome']:<10} {m['seconds']:>8.3f} {m['joins']:>6} {m['drains']:>7} "
              f"{m['bytes'] / 1e6:>10.2f}")  # fmt: skip
    print(f"streams: {quiet:.0f} tokens/s without moves, {busy:.0f} tokens/s with four moves per run")
    balance = emulated_balance()
    print(f"emulated Mixtral, skew-exp: balancedness per block {balance['before']} -> {balance['after']}")
    print(json.dumps({"bench": "rebalance", "args": vars(args), "moves": moves, "tokens_per_s": {
        "without_moves": quiet, "with_moves": busy}, "emulated_balancedness": balance}))  # fmt: skip


if __name__ == "__main__":
    main()
