"""The host's CPU in EP decode with and without the expert pipeline (docs/findings.md "EPS-MoE"): the
emulated EP group in one process (amoe.runtime.sync.group, a thread per device, the loopback hub) at a time scale
so small that every GPU and link hold is ~0, so what is left is the runtime's host work. For each setting, decode
requests (`--requests` per device, 8-token prompts, `--tokens` each) are sent at once; the process's CPU time per
iteration (CPU time, not wall: other sessions' load on this host stretches wall time, not the work) is the least
over `--repeats` runs. `auto`'s pipeline number is priced as the served runtime prices it, at `--time-scale`
(its chunks' host cost counts then), and the CPU of pricing one new iteration total (what every device's process
pays once per total it has not seen) is measured apart, over `--totals`. Prints a line per setting and a final
JSON line.

    python bench/eps_decode_cpu.py [--devices 8] [--settings none,1,auto] [--repeats 3] [--time-scale 150]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from amoe.config import AmoeConfig, EmulationSection, ExecutorSection
from amoe.runtime import build
from amoe.runtime.emulated import Emulation
from amoe.sampling_params import SamplingParams
from amoe.testing.sync_inproc import SyncCluster

PROFILE, GPU = "deepseek-v2:2", "h800"


def pipeline_for(setting: str, devices: int, time_scale: float, em: Emulation):
    """`none`: EP without the pipeline; otherwise `--ep-pipelines setting --ep-kernel auto`, priced at
    `time_scale` (the emulation itself runs at ~0)."""
    if setting == "none":
        return None
    ex = replace(em.config, time_scale=time_scale)
    parallel = {"mode": "ep", "attn_ranks": devices, "ep_pipelines": setting, "ep_kernel": "auto"}
    config = AmoeConfig(executor=ExecutorSection("emulated"), emulation=ex).replace(parallel=parallel)
    return build.ep_pipeline(
        config, build.placement(config, em.model_config.num_expert_ids), em.model_config, em
    )


def decode_cpu(args, setting: str, em: Emulation) -> dict:
    """Least CPU seconds per iteration of one decode run over the repeats, and the iterations it took."""
    pipeline = pipeline_for(setting, args.devices, args.time_scale, em)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    best, iterations = float("inf"), 0
    with SyncCluster(
        mode="ep", num_devices=args.devices, emulation=em, pipeline=pipeline, num_kv_blocks=4096
    ) as cluster:
        for _ in range(args.repeats):
            before = cluster.stats()[0]["iterations"]
            start = time.process_time()
            reqs = [
                cluster.submit([1] + [3 + (i * 7919 + j * 104729) % 900 for j in range(7)], params, rank=d)
                for i in range(args.requests)
                for d in range(args.devices)
            ]
            cluster.wait(reqs, timeout=600)
            cpu = time.process_time() - start
            iterations = cluster.stats()[0]["iterations"] - before
            best = min(best, cpu / iterations)
    return {"setting": setting, "cpu_ms_per_iteration": round(1e3 * best, 2), "iterations": iterations}


def chooser_cpu(args, em: Emulation) -> dict:
    """CPU of `auto`'s choice for each total of `--totals` the first time it is asked (its memo then answers)."""
    pipeline = pipeline_for("auto", args.devices, args.time_scale, em)
    totals = [int(t) for t in args.totals.split(",")]
    first, again, picks = [], [], []
    for total in totals:
        for out in (first, again):
            start = time.process_time()
            pn = pipeline.pipelines_for(total)
            out.append(time.process_time() - start)
        picks.append(pn)
    return {
        "totals": totals, "picks": picks,
        "first_ms": [round(1e3 * t, 2) for t in first], "first_mean_ms": round(1e3 * sum(first) / len(first), 2),
        "again_mean_us": round(1e6 * sum(again) / len(again), 1),
    }  # fmt: skip


def pieces_cpu(args, em: Emulation) -> dict:
    """µs of CPU per call of what PN 1 with `--ep-kernel auto` does per block and device beyond EP without the
    pipeline, at decode's rows (`--requests` a device, the emulated wire's width): the split of the copies into
    one chunk and the gather back (what PN 1 once did), the kernel choice, and the chunk's pricing by the
    kernel curves against the grouped step's."""
    import numpy as np
    import torch

    from amoe.perf.model import cost_model, ep_block, kernels
    from amoe.runtime.sync.eps import expert_groups, split_routed
    from amoe.runtime.sync.moe import Routed

    model, gpu, host = em.profile, em.expert_gpu, em.host
    cfg = em.model_config
    n, k = args.requests, cfg.experts_per_token
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(np.stack([rng.choice(cfg.num_experts, k, replace=False) for _ in range(n)]))
    routed = Routed(
        torch.zeros(n, 16), ids, torch.rand(n, k), torch.arange(n), torch.zeros(n, dtype=torch.int64)
    )
    group = expert_groups(tuple(e % args.devices for e in range(cfg.num_expert_ids)), 1)
    hosted = list(range(0, cfg.num_expert_ids, args.devices))  # device 0's experts, the shared one included
    rows = [max(1, round(args.devices * n * k / cfg.num_experts))] * (len(hosted) - 1) + [args.devices * n]
    choose = ep_block.kernel_chooser(model, gpu)
    curves = kernels.curves_for(gpu)

    def split_gather():
        (part,) = split_routed(routed, group, 1)
        out = routed.moe_input.new_empty(n, k, 16)
        out[part.rows, part.slots] = part.routed.moe_input

    def curves_price():
        for kern, inter, r in (("grouped", model.expert_intermediate, rows[:-1]), ("dense", 3072, rows[-1:])):
            kernels.experts_time(gpu, curves.curve(kern), kern, r, model.hidden_size, inter)

    calls = {
        "split_and_gather": split_gather,
        "kernel_choice": lambda: choose(rows[:-1]),
        "price_chunk_curves": curves_price,
        "price_grouped_step": lambda: cost_model.grouped_expert_time(model, gpu, rows, host, hosted),
    }
    out = {}
    for name, fn in calls.items():
        start, loops = time.thread_time(), 2000
        for _ in range(loops):
            fn()
        out[name] = round(1e6 * (time.thread_time() - start) / loops, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--settings", default="none,1,auto")
    p.add_argument("--requests", type=int, default=32, help="decode requests per device")
    p.add_argument("--tokens", type=int, default=16, help="tokens each decode request generates")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=150.0, help="the served runtime's, for auto's pricing")
    p.add_argument("--totals", default="8,64,200,255,256,1000,2048,2056")
    args = p.parse_args()
    ex = EmulationSection(profile=PROFILE, gpu=GPU, time_scale=1e-6, routing="uniform")
    em = Emulation(ex)
    rows = []
    for setting in args.settings.split(","):
        rows.append(decode_cpu(args, setting, em))
        print(rows[-1], flush=True)
    chooser = chooser_cpu(args, em)
    pieces = pieces_cpu(args, em)
    print(f"per block and device, µs of CPU: {pieces}", flush=True)
    print(
        f"auto's choice: {chooser['first_mean_ms']} ms CPU per new total, {chooser['again_mean_us']} µs again",
        flush=True,
    )
    print(
        json.dumps(
            {
                "bench": "eps_decode_cpu",
                "args": vars(args),
                "rows": rows,
                "chooser": chooser,
                "pieces_us": pieces,
            }
        )
    )


if __name__ == "__main__":
    main()
