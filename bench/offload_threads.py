"""Why the fully resident run of bench/offload.py was slower than the offloaded ones: torch's intra-op threads.

    .venv/bin/python bench/offload_threads.py [--dir /tmp/amoe-bench-offload] [--repeats 2]

One process per configuration (fully resident; `--offload-budget` of 72 expert slots with LRU, as bench/offload.py
runs it) on bench/offload.py's checkpoint (made there). After a one-token warm-up, four prompts generate four
greedy tokens, alternately with 2 and 1 intra-op threads (`torch.set_num_threads`), `--repeats` times each; wall
and CPU seconds per generation. Prints one JSON line per generation and a final summary line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def child(model_dir: str, options: dict, repeats: int) -> None:
    import torch

    from amoe import LLM, SamplingParams

    llm = LLM(model_dir, num_kv_blocks=8, max_num_seqs=4, **options)
    prompts = [[1] + list(range(3 + i, 18 + i)) for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for threads in (2, 1) * repeats:
        torch.set_num_threads(threads)
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate(prompts, params)
        row = {"offload": bool(options), "threads": threads, "wall_s": round(time.perf_counter() - wall, 2),
               "cpu_s": round(time.process_time() - cpu, 2)}  # fmt: skip
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dir", type=Path, default=Path("/tmp/amoe-bench-offload"), help="bench/offload.py's checkpoint"
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(str(args.dir), json.loads(args.child), args.repeats)
        return
    if not (args.dir / "config.json").exists():
        raise SystemExit(f"no checkpoint in {args.dir}: run bench/offload.py first (it makes it)")
    import torch

    from amoe.model.config import load_model_config
    from amoe.offload.store import dense_bytes, routed_expert_bytes

    cfg = load_model_config(args.dir)
    budget = dense_bytes(cfg, torch.float32, attention=True) + 72 * routed_expert_bytes(cfg, torch.float32)
    rows = []
    for options in ({}, {"offload_budget": str(budget), "offload_policy": "lru"}):
        cmd = [sys.executable, __file__, "--dir", str(args.dir), "--repeats", str(args.repeats)]
        done = subprocess.run(
            [*cmd, "--child", json.dumps(options)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        for line in done.stdout.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
                print(line, flush=True)
    summary = {
        "bench": "offload_threads",
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "runs": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
