"""Scheduler and receptor benchmark: µs per scheduling decision (C++ vs the pure-Python policy on the same
queue states) and tokens/s through receptor -> token pool -> μ-queue -> assembled batch.

Run: .venv/bin/python bench/scheduler.py [--policy defrag] [--hidden 128]
"""

import argparse
import json
import random
import statistics
import time

import torch

from amoe import core
from amoe.config import POLICIES, SchedulerSection
from amoe.placement import Placement
from amoe.testing import policies

SIZES = [(32, 8), (56, 8), (61, 256)]


def queue_states(num_blocks, num_cols, count, rng):
    """A walk of queue states: random depths, then per step the picked queue drains and a few queues grow."""
    grid = [[rng.choice([0, 0, rng.randint(1, 64)]) for _ in range(num_cols)] for _ in range(num_blocks)]
    updates = []
    for _ in range(count):
        step = [(rng.randrange(num_blocks), rng.randrange(num_cols), rng.randint(1, 16)) for _ in range(4)]
        updates.append(step)
    return grid, updates


def bench_decisions(policy, num_blocks, num_cols, lookahead, decay, count, seed):
    rng = random.Random(seed)
    grid, updates = queue_states(num_blocks, num_cols, count, rng)
    sched = core.Scheduler(num_blocks, num_cols, policy, lookahead, decay)
    sched.set_depths(grid)
    cpp_ns, py_ns = [], []
    for step in updates:
        t0 = time.perf_counter_ns()
        picked = sched.pick()
        t1 = time.perf_counter_ns()
        want = policies.pick(policy, grid, lookahead, decay)
        t2 = time.perf_counter_ns()
        assert picked == want, (picked, want)
        cpp_ns.append(t1 - t0)
        py_ns.append(t2 - t1)
        if picked is not None:  # the executor drains the picked queue
            b, c = picked
            sched.add(b, c, -grid[b][c])
            grid[b][c] = 0
        for b, c, n in step:  # arrivals
            sched.add(b, c, n)
            grid[b][c] += n
    # Medians: on a shared 2-core machine one descheduling would dominate a mean of sub-microsecond calls.
    return statistics.median(cpp_ns) / 1e3, statistics.median(py_ns) / 1e3


def fragment_messages(num_tokens, per_message, top_k, num_experts, hidden, rng, wave=1024):
    """One-token decode fragments for ATTN (1, 0) as they arrive: per wave of tokens (one attention batch) the
    residuals kept locally, then each token's top_k expert outputs from the expert runtimes, the senders'
    messages (per_message rows of interleaved requests) arriving in random order."""
    messages = []
    for first in range(0, num_tokens, wave):
        reqs = list(range(first, min(first + wave, num_tokens)))
        experts = {r: rng.sample(range(num_experts), top_k) for r in reqs}
        parts = [[(r, 0, -1) for r in reqs]]
        for slot in range(1, top_k + 1):
            chosen = [(r, slot, experts[r][slot - 1]) for r in reqs]
            rng.shuffle(chosen)
            parts.append(chosen)
        chunks = [p[lo : lo + per_message] for p in parts for lo in range(0, len(p), per_message)]
        rng.shuffle(chunks)
        for chunk in chunks:
            req, slot, expert = (list(c) for c in zip(*chunk))
            n = len(req)
            messages.append(
                core.make_message(
                    torch.randn(n, hidden),
                    request_id=req,
                    kind=[core.ATTN] * n,
                    block=[1] * n,
                    index=[0] * n,
                    position=[7] * n,
                    slot=slot,
                    expert_id=expert,
                )
            )
    return messages


def bench_receptor(num_tokens, per_message, top_k, hidden, cap, seed):
    rng = random.Random(seed)
    num_experts = 8
    placement = Placement.disaggregated(1, 1, num_experts)
    hub = core.LoopbackHub(placement.num_runtimes)
    cfg = core.engine_config(
        0, placement, num_blocks=4, num_experts=num_experts, top_k=top_k, hidden=hidden,
        scheduler=SchedulerSection(attn_batch_cap=cap),
    )  # fmt: skip
    engine = core.Engine(cfg, hub.communicator(0))
    for msg in fragment_messages(num_tokens, per_message, top_k, num_experts, hidden, rng):
        hub.send(0, msg)
    got = 0
    t0 = time.perf_counter()
    with engine:
        while got < num_tokens:
            batch = engine.next_batch(timeout=5.0)
            assert batch is not None, "receptor stalled"
            got += len(batch)
    seconds = time.perf_counter() - t0
    assert engine.stats()["pool_entries"] == 0
    return num_tokens / seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = SchedulerSection()  # the served defaults, but for the policy:
    # the decisions are timed against the Python oracle's pick of the same queue states, which exists for the
    # stateless policies only (waves keeps state between picks: tests/test_waves.py checks it step by step).
    stateless = [p for p in POLICIES if p != "waves"]
    ap.add_argument("--policy", default="defrag", choices=stateless)
    ap.add_argument("--lookahead", type=int, default=default.lookahead)
    ap.add_argument("--decay", type=float, default=default.decay)
    ap.add_argument("--decisions", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--per-message", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--cap", type=int, default=256)
    args = ap.parse_args()

    decision_us, python_us = {}, {}
    print(f"policy={args.policy} lookahead={args.lookahead} decay={args.decay}")
    print(f"{'blocks x experts':>18} {'C++ us/decision':>16} {'Python us/decision':>19} {'speedup':>8}")
    for nb, ne in SIZES:
        count = args.decisions if nb * ne < 5000 else max(20, args.decisions // 10)
        cpp, py = bench_decisions(args.policy, nb, ne, args.lookahead, args.decay, count, seed=nb * ne)
        key = f"{nb}x{ne}"
        decision_us[key], python_us[key] = round(cpp, 3), round(py, 1)
        print(f"{key:>18} {cpp:>16.3f} {py:>19.1f} {py / cpp:>7.0f}x")
    speedup_min = min(python_us[k] / decision_us[k] for k in decision_us)

    tps = bench_receptor(args.tokens, args.per_message, 2, args.hidden, args.cap, seed=1)
    print(
        f"receptor -> pool -> queue -> batch: {tps:,.0f} tokens/s "
        f"(one-token fragments, top-2, {args.per_message} parts/message, hidden {args.hidden}, cap {args.cap})"
    )
    print(
        json.dumps(
            {
                "decision_us": decision_us,
                "python_decision_us": python_us,
                "speedup_min": round(speedup_min, 1),
                "tokens_per_s": round(tps),
            }
        )
    )


if __name__ == "__main__":
    main()
