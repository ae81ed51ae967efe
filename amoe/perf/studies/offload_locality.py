"""Set the routing model's access locality from the paper's ORACLE, Bélády only.

    amoe bench offload-locality [--models switch-large-128,nllb-moe-128] [--bound]

The rule (docs/offload-policy.md "Access locality set from the paper's ORACLE", written before this ran): per
shape, Bélády's hit ratio at the paper's cache size and batch 16 must equal the paper's ORACLE (Figure 11)
within ±2 pt. First `spread` alone, upward from the sourced value on a 0.05 grid to 1.0 (a 0.01 grid inside
the last step if it jumps past the band); only if spread 1.0 does not reach it, `zipf` downward on a 0.25 grid
at spread 1.0. A value that reaches the target must keep §3's ranges at batches 1-32 on the training sample,
or it is rejected. No other policy is replayed here: the search sees only the optimum, a property of the
trace. One JSON line per candidate, then a summary line.

`--bound` instead prints, for the sourced constants and the grid's far corner (spread 1.0, zipf 0), a floor
under Bélády that needs no search: a policy that empties the cache at each batch's start misses at most the
batch's distinct experts when they fit, so Bélády >= 1 - sum(distinct per batch) / accesses (when every batch
fits) — and §3's statistics at the corner.

`--lengths` prints Bélády for the sourced constants with generated lengths 1-20 beside 8-32: the authors'
example script caps generation at 20 new tokens (a cap, not a mean). Exploratory, outside the rule; it sets
nothing.

`--enc-dec` (the rule: docs/offload-policy.md "The shapes as the encoder–decoder models they are", written
before it ran): the sourced constants unchanged, the shapes as the encoder-decoder models they are
(Switch-large-128 12 + 12 MoE blocks, NLLB-MoE-128 6 + 6; encoder blocks routed once per sequence, at
prefill). Per shape one line: Bélády at the paper's cache size (batch 16, the target, and batch 1), the
per-batch floor, §3's statistics on the whole model (the check) and on the decoder part (for reading), and
whether the rule lets the hit part run.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from amoe.errors import ConfigError
from amoe.offload import replay as rp
from amoe.offload.trace import TaskRouting, stats
from amoe.perf.studies.offload_replay import MODELS

TOLERANCE = 0.02  # ±2 pt around the paper's ORACLE
TARGET_BATCH = 16  # the paper's batcher's largest batch (§8.2); batch 1 is reported beside
SECTION3_BATCHES = (1, 4, 16, 32)
N_TRAIN, N_TEST = 300, 160  # offload_replay's samples (seeds 1 and 2)


def section3_ok(model: TaskRouting, first_block: int = 0) -> tuple[bool, list[dict]]:
    train = model.generate(N_TRAIN, seed=1)
    rows = []
    for b in SECTION3_BATCHES:
        s = stats(train, b, first_block)
        rows.append({"batch": b, "activated": round(s["activated"], 4), "reused": round(s["reused"], 4)})
    ok = all(0.03 <= r["activated"] <= 0.20 and 0.30 <= r["reused"] <= 0.46 for r in rows)
    return ok, rows


def evaluate(name: str, params: dict) -> dict:
    """Bélády at the paper's cache size (batch 16, the target, and batch 1) for one candidate; §3 only if it is in
    the band (the rule rejects it otherwise anyway)."""
    m = MODELS[name]
    model = TaskRouting(num_blocks=m.blocks, num_experts=m.experts, top_k=m.top_k, **params)
    test = model.generate(N_TEST, seed=2)
    row = {"model": name, **{k: params[k] for k in ("spread", "zipf") if k in params}}
    for batch in (TARGET_BATCH, 1):
        keys = rp.accesses(rp.events(test, batch))
        row[f"belady_b{batch}"] = round(rp.belady(keys, m.capacity).hit_ratio, 4)
    oracle = m.paper["oracle"]
    row["oracle"] = oracle
    row["in_band"] = abs(row[f"belady_b{TARGET_BATCH}"] - oracle) <= TOLERANCE
    row["section3_ok"] = None  # measured only in the band (outside it the rule rejects the value anyway)
    if row["in_band"]:
        row["section3_ok"], row["section3"] = section3_ok(model)
    print(json.dumps(row), flush=True)
    return row


def search(name: str) -> dict:
    m = MODELS[name]
    base = {"spread": TaskRouting.spread, "zipf": TaskRouting.zipf, **m.routing}
    oracle = m.paper["oracle"]
    tried: list[dict] = []

    def accept(params: dict) -> dict | None:
        """Evaluate; the candidate if it is in the band and keeps §3's ranges."""
        tried.append(evaluate(name, params))
        return tried[-1] if tried[-1]["in_band"] and tried[-1]["section3_ok"] else None

    def sweep(knob: str, values, fixed: dict, step: float) -> dict | None:
        prev = fixed[knob]
        for v in values:
            found = accept({**fixed, knob: round(float(v), 4)})
            if found:
                return found
            if tried[-1][f"belady_b{TARGET_BATCH}"] < oracle - TOLERANCE:
                # Jumped past the band: the finer grid strictly between the last two values, from the old side.
                inner = np.arange(min(prev, v) + step, max(prev, v) - step / 2, step)
                for w in inner if v > prev else inner[::-1]:
                    found = accept({**fixed, knob: round(float(w), 4)})
                    if found:
                        return found
                return None
            prev = v
        return None

    spreads = np.round(np.arange(base["spread"] + 0.05, 1.0 + 1e-9, 0.05), 2)
    found = sweep("spread", spreads, base, 0.01)
    last = tried[-1] if tried else {}
    if found is None and last.get("spread") == 1.0 and last[f"belady_b{TARGET_BATCH}"] > oracle + TOLERANCE:
        zipfs = np.round(np.arange(base["zipf"] - 0.25, -1e-9, -0.25), 2)
        found = sweep("zipf", zipfs, {**base, "spread": 1.0}, 0.05)
    return {"model": name, "oracle": oracle, "sourced": base, "found": found, "candidates": len(tried)}


def floor(test, batch: int, capacity: int) -> dict:
    """The per-batch floor under Bélády (module docstring), with what it rests on."""
    distinct, accesses, largest, seen = 0, 0, 0, set()
    for ev in rp.events(test, batch):
        if ev.block == rp.END:
            distinct, largest, seen = distinct + len(seen), max(largest, len(seen)), set()
        else:
            seen.update(ev.keys)
            accesses += len(ev.keys)
    return {"accesses": accesses, "distinct_summed_over_batches": distinct, "largest_batch_distinct": largest,
            "every_batch_fits": largest <= capacity, "floor": round(1 - distinct / accesses, 4)}  # fmt: skip


def enc_dec(name: str) -> dict:
    """The sourced constants on the encoder-decoder structure; Bélády, the floor and §3 only."""
    m = MODELS[name]
    params = {"spread": TaskRouting.spread, "zipf": TaskRouting.zipf, **m.routing}
    model = TaskRouting(
        num_blocks=m.blocks, num_experts=m.experts, top_k=m.top_k, encoder_blocks=m.encoder_blocks, **params
    )
    test = model.generate(N_TEST, seed=2)
    row = {"model": name, "encoder_blocks": m.encoder_blocks, "decoder_blocks": m.blocks - m.encoder_blocks,
           **params, "capacity": m.capacity, "oracle": m.paper["oracle"]}  # fmt: skip
    for batch in (TARGET_BATCH, 1):
        evs = rp.events(test, batch)
        row[f"belady_b{batch}"] = round(rp.belady(rp.accesses(evs), m.capacity).hit_ratio, 4)
    row[f"floor_b{TARGET_BATCH}"] = floor(test, TARGET_BATCH, m.capacity)
    row["in_band"] = abs(row[f"belady_b{TARGET_BATCH}"] - row["oracle"]) <= TOLERANCE
    row["above_band_pt"] = round(100 * (row[f"belady_b{TARGET_BATCH}"] - row["oracle"] - TOLERANCE), 1)
    row["section3_ok"], row["section3"] = section3_ok(model)
    row["section3_decoder_part"] = section3_ok(model, m.encoder_blocks)[1]  # for reading, not the check
    row["run_hit_part"] = row["in_band"] and row["section3_ok"]
    print(json.dumps(row), flush=True)
    return row


def batch_bound(name: str, extra: dict) -> dict:
    m = MODELS[name]
    params = {"spread": TaskRouting.spread, "zipf": TaskRouting.zipf, **m.routing, **extra}
    model = TaskRouting(num_blocks=m.blocks, num_experts=m.experts, top_k=m.top_k, **params)
    test = model.generate(N_TEST, seed=2)
    row = {"model": name, **params, "capacity": m.capacity}
    for batch in (1, TARGET_BATCH):
        row[f"b{batch}"] = floor(test, batch, m.capacity)
    if extra:
        row["section3_ok"], row["section3"] = section3_ok(model)
    print(json.dumps(row), flush=True)
    return row


def lengths(name: str) -> None:
    m = MODELS[name]
    for output in ((8, 32), (1, 20)):
        model = TaskRouting(
            num_blocks=m.blocks, num_experts=m.experts, top_k=m.top_k, output=output, **m.routing
        )
        test = model.generate(N_TEST, seed=2)
        row = {"model": name, "output": output, "note": "exploratory, outside the search rule; sets nothing"}
        for batch in (TARGET_BATCH, 1):
            row[f"belady_b{batch}"] = round(
                rp.belady(rp.accesses(rp.events(test, batch)), m.capacity).hit_ratio, 4
            )
        print(json.dumps(row), flush=True)


def main(args: argparse.Namespace) -> int:
    """`amoe bench offload-locality` (its flags: amoe.perf.studies.commands)."""
    models = args.models.split(",") if args.models else list(MODELS)
    unknown = [name for name in models if name not in MODELS]
    if unknown:
        raise ConfigError(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.enc_dec:
        for name in models:
            enc_dec(name)
        return 0
    if args.lengths:
        for name in models:
            lengths(name)
        return 0
    if args.bound:
        for name in models:
            batch_bound(name, {})
            batch_bound(name, {"spread": 1.0, "zipf": 0.0})
        return 0
    start = time.time()
    out = {"bench": "offload_locality", "tolerance": TOLERANCE, "target_batch": TARGET_BATCH, "results": []}
    for name in models:
        base = {"spread": TaskRouting.spread, "zipf": TaskRouting.zipf, **MODELS[name].routing}
        evaluate(name, base)  # the sourced constants, for the record
        out["results"].append(search(name))
        print(json.dumps(out["results"][-1]), flush=True)
    out["wall_s"] = round(time.time() - start, 1)
    print(json.dumps(out))
    return 0
