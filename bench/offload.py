"""Expert offloading on this machine: a checkpoint whose experts are at least 3x the budget, generated greedily with
`--offload-budget`, against the same model fully resident and against reading every expert on demand (a budget of
one expert, no prefetch: no cache).

    .venv/bin/python bench/offload.py [--dir /tmp/amoe-bench-offload] [--budget-experts 12] [--new-tokens 24]

Each configuration runs in a process of its own, which measures itself: VmRSS (and its peak VmHWM, and the
anonymous / file-backed split) from /proc/self/status once Python has imported torch and amoe ("process start"),
after a warm-up on the tiny model, and after the generation; bytes the kernel read for it from storage
(/proc/self/io read_bytes), tokens/s, and the store's counters. The bound (docs/offload.md, "Resident memory"): a
process that hosts experts grows by at most its budget + 10 % + the engine's working memory W, W being what the
fully resident run grows by beyond its weights (KV cache, activations, GEMM buffers, torch's code paged in on first
use) — checked from process start and after the warm-up, each against the resident run's W counted the same way;
the growth is also reported as x the budget. Further checks: the store's bytes read equal misses x expert bytes
when nothing is prefetched; every configuration's tokens equal the fully resident one's. Prints a table and a
final JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

# 32 blocks x 8 experts of 3 x 512 x 1536 float32 = 9 MiB each: 2304 MiB of experts, ~85 MiB of dense part. That
# large so that the budget is well above the engine's own working memory (KV cache, activations, the GEMM library's
# buffers, torch's code run the first time: ~30 MiB from process start, the same with every expert resident).
SHAPE = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=32, num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, num_local_experts=8, num_experts_per_tok=2, vocab_size=1024,
)  # fmt: skip


def proc_status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM, RssAnon, RssFile)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss() -> dict[str, int]:
    """Resident bytes now: all, anonymous (heap, tensors) and file-backed (library code, mapped files)."""
    return {"rss": proc_status("VmRSS"), "anon": proc_status("RssAnon"), "file": proc_status("RssFile")}


def proc_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (the page cache and O_DIRECT alike)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise KeyError("read_bytes")


def make_checkpoint(out: Path) -> Path:
    from amoe.model.checkpoint import write_random_checkpoint
    from amoe.model.presets import preset

    config = out / "config.json"
    if (
        not config.exists()
        or json.loads(config.read_text())["num_hidden_layers"] != SHAPE["num_hidden_layers"]
    ):
        write_random_checkpoint({**preset("tiny"), **SHAPE}, out, seed=0)
    warmup = out.parent / (out.name + "-warmup")
    if not (warmup / "config.json").exists():
        write_random_checkpoint(preset("tiny"), warmup, seed=0)
    return out


def prompts(num: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, 1024, (length - 1,), generator=gen).tolist() for _ in range(num)]


def child(args: argparse.Namespace) -> None:
    """One configuration, measured from inside its own process; prints one JSON line."""
    from amoe import LLM, SamplingParams

    # Process start: the interpreter, torch and amoe imported, nothing of amoe's built yet.
    at_start = rss()
    options = json.loads(args.child)
    # Intra-op threads pinned for every configuration: with the cores shared, two spinning OpenMP threads made the
    # fully resident run cost up to 20x the CPU of a one-thread run (bench/offload_threads.py, docs/offload.md).
    torch.set_num_threads(args.threads)
    batch = prompts(args.num_prompts, args.prompt_len)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    # The warm-up: the engine's own code exercised once on the tiny model (thread pools, the GEMM library's
    # start-up, torch's kernels paged in), so the growth after it is the model's alone.
    import gc

    warm = LLM(args.dir.parent / (args.dir.name + "-warmup"), num_kv_blocks=8, max_num_seqs=args.num_prompts)
    warm.generate(prompts(args.num_prompts, args.prompt_len), SamplingParams(temperature=0, max_tokens=2))
    del warm
    gc.collect()
    kv_blocks = args.num_prompts * -(-(args.prompt_len + args.new_tokens) // 16)
    warmed = rss()
    llm = LLM(args.dir, num_kv_blocks=kv_blocks, max_num_seqs=args.num_prompts, **options)
    rss_loaded = proc_status("VmRSS")
    io0 = proc_read_bytes()
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(batch, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    io1 = proc_read_bytes()
    tokens = [o.outputs[0].token_ids for o in outs]
    stats = llm.engine.offload_stats()
    kv_bytes = llm.engine.runner.kv_bytes()
    llm.engine.close()
    end = rss()
    print(json.dumps({
        "rss_runtime": at_start["rss"], "rss_before": warmed["rss"], "rss_loaded": rss_loaded, "rss_after": end["rss"],
        "hwm": proc_status("VmHWM"),
        "anon_from_start": end["anon"] - at_start["anon"], "file_from_start": end["file"] - at_start["file"],
        "kv_bytes": kv_bytes, "kernel_read_bytes": io1 - io0, "wall_s": wall, "cpu_s": cpu,
        "tokens_per_s": sum(map(len, tokens)) / wall, "tokens": tokens, "store": stats,
    }))  # fmt: skip


def run(args: argparse.Namespace, label: str, options: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(options)]
    cmd += ["--dir", str(args.dir), "--new-tokens", str(args.new_tokens)]
    cmd += ["--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len)]
    cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{label} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["label"] = label
    return result


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dir", type=Path, default=Path("/tmp/amoe-bench-offload"), help="checkpoint (made if absent)"
    )
    p.add_argument("--budget-experts", type=int, default=72, help="expert slots of the offloaded runs")
    p.add_argument("--policies", default="lru,lfu", help="an offloaded run per --offload-policy")
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every run (default 1)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.child is not None:
        child(args)
        return

    from amoe.model.config import load_model_config
    from amoe.offload.io import CheckpointIndex
    from amoe.offload.store import dense_bytes, reader_bytes, routed_expert_bytes

    make_checkpoint(args.dir)
    cfg = load_model_config(args.dir)
    dense = dense_bytes(cfg, torch.float32, attention=True)
    expert = routed_expert_bytes(cfg, torch.float32)
    keys = [(b, e) for b in range(cfg.num_blocks) for e in range(cfg.num_experts)]
    # The budget counts the reader's buffers (docs/offload.md): this buys exactly --budget-experts slots.
    buffers = reader_bytes(CheckpointIndex(args.dir), cfg, keys, torch.float32)
    budget = dense + buffers + args.budget_experts * expert
    no_cache = dense + buffers + expert
    policies = args.policies.split(",")
    configs = [
        ("resident", {}),
        *((f"offload-{p}", {"offload_budget": str(budget), "offload_policy": p}) for p in policies),
        ("no-cache", {"offload_budget": str(no_cache), "offload_policy": "lru", "offload_prefetch": False}),
    ]
    results = [run(args, label, options) for label, options in configs]
    weights = {"resident": dense + len(keys) * expert, "no-cache": no_cache}
    for r in results:
        r["budget"] = weights.get(r["label"], budget)
        r["from_start"] = r["rss_after"] - r["rss_runtime"]
        r["after_warmup"] = r["rss_after"] - r["rss_before"]
    print_table(args, results, cfg, dense, expert, budget, buffers)
    checks = all_checks(results, len(keys), expert, budget)
    for name, value in checks.items():
        print(f"  {name}: {value}")
    summary = {
        "bench": "offload", "dense_bytes": dense, "expert_bytes": expert, "reader_bytes": buffers,
        "experts": len(keys), "budget_bytes": budget, "slots": args.budget_experts, "policies": policies,
        "new_tokens": args.new_tokens, "num_prompts": args.num_prompts, "threads": args.threads,
        "runs": {
            r["label"]: {k: v for k, v in r.items() if k not in ("tokens", "label")} for r in results
        },
        "checks": checks,
    }  # fmt: skip
    print(json.dumps(summary))
    if not (
        checks["tokens_equal"]
        and checks["no_cache_bytes_equal_misses"]
        and checks["from_start_within_bound"]
        and checks["after_warmup_within_bound"]
    ):
        sys.exit(1)


def all_checks(results: list[dict], experts: int, expert: int, budget: int) -> dict:
    """memory_checks, and what the offloaded runs must show: experts well over the budget, the uncached run's reads
    all misses, every run's tokens the resident run's."""
    checks = memory_checks(results, budget)
    nc = results[-1]
    checks.update({
        "experts_over_budget": experts * expert / budget,
        "experts_at_least_3x_budget": experts * expert >= 3 * budget,
        "no_cache_bytes_equal_misses": nc["store"]["bytes_read"] == nc["store"]["misses"] * expert,
        "no_cache_kernel_read_over_store_read": nc["kernel_read_bytes"] / max(1, nc["store"]["bytes_read"]),
        "tokens_equal": all(r["tokens"] == results[0]["tokens"] for r in results),
    })  # fmt: skip
    return checks


def print_table(args, results: list[dict], cfg, dense: int, expert: int, budget: int, buffers: int) -> None:
    num_keys = cfg.num_blocks * cfg.num_experts
    print(f"experts {num_keys} x {expert / 2**20:.1f} MiB = {num_keys * expert / 2**20:.0f} MiB; dense part "
          f"{dense / 2**20:.1f} MiB; offload budget {budget / 2**20:.1f} MiB ({args.budget_experts} slots + the "
          f"reader's buffers {buffers / 2**20:.1f} MiB)")  # fmt: skip
    print(f"{'run':<14} {'tok/s':>7} {'tok/cpu-s':>9} {'from start MiB':>15} {'after warm-up':>14} {'peak MiB':>9} "
          f"{'hits':>6} {'misses':>7} {'read MiB':>9} {'stall s':>8} {'recall':>7}")  # fmt: skip
    for r in results:
        s = r["store"] or {}
        recall = s.get("prefetch_used", 0) / s["prefetches"] if s.get("prefetches") else float("nan")
        cpu_rate = sum(map(len, r["tokens"])) / r["cpu_s"]
        grew = [f"{r[k] / 2**20:.1f} ({r[k] / r['budget']:.3f}x)" for k in ("from_start", "after_warmup")]
        print(f"{r['label']:<14} {r['tokens_per_s']:7.2f} {cpu_rate:9.2f} {grew[0]:>15} {grew[1]:>14} "
              f"{r['hwm'] / 2**20:9.1f} {s.get('hits', 0):6d} {s.get('misses', 0):7d} "
              f"{s.get('bytes_read', 0) / 2**20:9.1f} {s.get('stall_s', 0):8.2f} {recall:7.2f}")  # fmt: skip
    print("(growth as x its weights: the budget, or every weight for the resident run)")


def memory_checks(results: list[dict], budget: int) -> dict:
    """Each offloaded process, from its start and after the warm-up, against the bound: its budget + 10 % + the
    engine's working memory W (what the resident run grew by beyond its weights, counted alike); the policy runs'
    growth (all at `budget`) as bytes and x the budget, and whether it is within budget + 10 % alone."""
    resident, offloaded = results[0], results[1:]
    checks: dict = {}
    for since in ("from_start", "after_warmup"):
        work = resident[since] - resident["budget"]
        grew = max(r[since] for r in offloaded if r["budget"] == budget)
        checks.update({
            f"{since}_bytes": grew,
            f"{since}_over_budget": grew / budget,
            f"{since}_within_budget_plus_10pct": grew <= 1.10 * budget,
            f"{since}_working_memory_bytes": work,
            f"{since}_within_bound": all(r[since] <= 1.10 * r["budget"] + work for r in offloaded),
        })  # fmt: skip
    return checks


if __name__ == "__main__":
    main()
