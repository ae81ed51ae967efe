"""The host's wall time per EP pipeline chunk (docs/eps.md, eps.CHUNK_HOST_CPU_S): the emulated EP
group in one process (amoe.runtime.sync.group, a thread per device, the loopback hub) at a time scale so small that
every GPU and link hold is ~0, so what is left is the runtime's host work — routing, the split of the copies into
chunks, one message per peer each way per chunk, the expert step's bookkeeping, the gather. One prefill of
`--tokens` per device with PN 1 and with each other PN; the slope of the process's CPU time over the chunks run is
the host's cost of one more chunk, summed over the devices (CPU time, not wall: other sessions' load on this host
stretches wall time, not the work). Divided by the devices it is one device's CPU per chunk. Prints a line per PN
and a final JSON line.

    python bench/eps_chunk_cost.py [--devices 8] [--tokens 1024,4096] [--pipelines 1,5,20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from amoe.config import AmoeConfig, EmulationSection, ExecutorSection
from amoe.runtime import build
from amoe.runtime.emulated import Emulation
from amoe.sampling_params import SamplingParams
from amoe.testing.sync_inproc import SyncCluster


def measure(devices: int, tokens: int, pn: int, repeats: int) -> tuple[float, float]:
    """(least CPU seconds of one prefill of `tokens` per device, over the repeats; chunks per device in it)."""
    ex = EmulationSection(profile="deepseek-v2:2", gpu="h800", time_scale=1e-6, routing="uniform")
    em = Emulation(ex)
    parallel = {"mode": "ep", "attn_ranks": devices, "ep_pipelines": pn, "ep_kernel": "grouped"}
    config = AmoeConfig(executor=ExecutorSection("emulated"), emulation=ex).replace(parallel=parallel)
    pipeline = build.ep_pipeline(
        config, build.placement(config, em.model_config.num_expert_ids), em.model_config, em
    )
    prompt = list(range(3, 3 + tokens))
    params = SamplingParams(temperature=0, max_tokens=1)
    best = float("inf")
    with SyncCluster(
        mode="ep",
        num_devices=devices,
        emulation=em,
        pipeline=pipeline,
        num_kv_blocks=4096,
        max_batch_rows=tokens,
    ) as cluster:
        for _ in range(repeats):
            start = time.process_time()
            cluster.wait([cluster.submit(prompt, params, rank=r) for r in range(devices)], timeout=300)
            best = min(best, time.process_time() - start)
        holds = cluster.stats()[0]["emulated"]["experts"]["kinds"]["expert"]["steps"]
    return best, holds / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--pipelines", default="1,5,20")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    out = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        points = [
            (pn, *measure(args.devices, tokens, pn, args.repeats))
            for pn in map(int, args.pipelines.split(","))
        ]
        for pn, wall, chunks in points:
            print(f"tokens {tokens} PN {pn}: {1e3 * wall:.1f} ms CPU, {chunks:.1f} chunks per device")
        slope = float(np.polyfit([c for _, _, c in points], [w for _, w, _ in points], 1)[0])
        out.append({
            "tokens_per_device": tokens, "cpu_s_per_chunk": round(slope, 6),
            "cpu_s_per_chunk_per_device": round(slope / args.devices, 7),
        })  # fmt: skip
    print(json.dumps({"bench": "eps_chunk_cost", "devices": args.devices, "points": out}))


if __name__ == "__main__":
    main()
