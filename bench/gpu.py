"""GPU throughput: amoe offline (amoe.LLM) and served (`amoe serve`, one runtime per GPU) vs transformers `generate`
on the same GPU, side by side in one run.

    .venv/bin/python bench/gpu.py [--preset small] [--dtype bfloat16] [--num-prompts 64] [--new-tokens 128]

All three run the same random-weight checkpoint and the same prompts greedily, and must emit exactly `--new-tokens`
tokens per prompt (eos ignored): transformers and amoe.LLM as one batch on GPU 0 (transformers with left padding),
the server with every request in flight at once over its OpenAI API (1 attention runtime and the other visible GPUs
as expert runtimes, NCCL between them; skipped with fewer than 2 GPUs). Prints a table and a final JSON line. Without
CUDA it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

# The CPU benchmark's prompts (bench/ is on the path of a script run from it).
from offline import hf_generate, make_prompts

from amoe import LLM, SamplingParams
from amoe.device import cuda_missing_reason
from amoe.model.make import make_model
from amoe.model.presets import preset

GPU0 = torch.device("cuda", 0)


class Timer:
    """Wall seconds of a block, the GPU's queued work included (the host only enqueues kernels)."""

    def __enter__(self) -> Timer:
        torch.cuda.synchronize()
        self.wall = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self.wall = time.perf_counter() - self.wall


def _free_gpu() -> None:
    """Give the next engine the memory the last one held (LLM sizes its KV cache from what is free)."""
    gc.collect()
    torch.cuda.empty_cache()


def run_amoe(model_dir: Path, prompts, new_tokens: int, dtype: str) -> tuple[float, list[list[int]]]:
    llm = LLM(model_dir, device="cuda", dtype=dtype, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up: kernels, allocator
    with Timer() as timer:
        outs = llm.generate(prompts, params)
    del llm
    _free_gpu()
    return timer.wall, [o.outputs[0].token_ids for o in outs]


def run_hf(model_dir: Path, prompts, new_tokens: int, dtype: str) -> tuple[float, list[list[int]]]:
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(GPU0).eval()
    timer, tokens = hf_generate(model, prompts, new_tokens, Timer, GPU0)
    del model
    _free_gpu()
    return timer.wall, tokens


def run_served(model_dir: Path, prompts, new_tokens: int, dtype: str, attn: int, experts: int) -> float:
    """Wall seconds from sending every request at once to the last response, on a warm server."""
    from amoe.testing.servers import ServerProcess

    flags = ["--model", str(model_dir), "--device", "cuda", "--transport", "auto", "--model-dtype", dtype]
    flags += ["--attn-ranks", str(attn), "--expert-ranks", str(experts)]
    flags += ["--cache-max-num-seqs", str(max(256, len(prompts)))]
    print(f"starting amoe serve {' '.join(flags[2:])}", file=sys.stderr, flush=True)
    with ServerProcess(flags, startup_timeout_s=600) as url:
        return asyncio.run(_serve_all(url, prompts, new_tokens))


async def _serve_all(url: str, prompts, new_tokens: int) -> float:
    from amoe.bench.client import BenchClient
    from amoe.bench.workloads import RequestSpec

    def spec(prompt: list[int], n: int) -> RequestSpec:
        return RequestSpec(prompt=prompt, prompt_len=len(prompt), output_len=n)

    # One JSON response per request: the server's work is measured, not this client parsing a stream per token.
    async with BenchClient(url, stream=False, timeout=600) as client:
        client.model = (await client.list_models())[0]["id"]
        await asyncio.gather(*(client.complete(spec(p, 2)) for p in prompts[:2]))  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(client.complete(spec(p, new_tokens)) for p in prompts))
        wall = time.perf_counter() - start
    bad = [r.error or f"{r.output_tokens} tokens" for r in results if r.output_tokens != new_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} served requests did not produce {new_tokens} tokens: {bad[0]}")
    return wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attn-ranks", type=int, default=1, help="served: attention runtimes (one GPU each)")
    parser.add_argument(
        "--expert-ranks",
        type=int,
        default=None,
        help="served: expert runtimes (default: the other visible GPUs)",
    )
    parser.add_argument("--no-served", action="store_true", help="offline only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"bench/gpu.py needs a CUDA GPU: {cuda_missing_reason()}", file=sys.stderr)
        return 2

    hf_config = preset(args.preset)
    gpus = torch.cuda.device_count()
    experts = args.expert_ranks or min(max(gpus - args.attn_ranks, 1), hf_config["num_local_experts"])
    served_skip = None
    if args.no_served:
        served_skip = "--no-served"
    elif gpus < args.attn_ranks + experts:
        served_skip = f"needs {args.attn_ranks + experts} GPUs (one per runtime), {gpus} visible"
    prompts = make_prompts(
        args.num_prompts, args.min_prompt_len, args.max_prompt_len, hf_config["vocab_size"], args.seed
    )
    total = args.num_prompts * args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args.preset, Path(tmp) / f"{args.preset}-bench", seed=args.seed)
        # The server first, while no other process holds GPU memory; then the two offline engines in turn.
        served_s = None
        if served_skip is None:
            served_s = run_served(model_dir, prompts, args.new_tokens, args.dtype, args.attn_ranks, experts)
        amoe_s, amoe_tokens = run_amoe(model_dir, prompts, args.new_tokens, args.dtype)
        hf_s, hf_tokens = run_hf(model_dir, prompts, args.new_tokens, args.dtype)

    assert all(len(t) == args.new_tokens for t in amoe_tokens + hf_tokens)
    same = sum(a == h for a, h in zip(amoe_tokens, hf_tokens))
    hf_tps, amoe_tps = total / hf_s, total / amoe_s
    served_tps = total / served_s if served_s else None
    rows = [("hf generate", hf_s, hf_tps), ("amoe.LLM", amoe_s, amoe_tps)]
    if served_tps:
        rows.append((f"amoe serve {args.attn_ranks}+{experts}", served_s, served_tps))

    print(
        f"gpu={torch.cuda.get_device_name(0)} x{gpus} preset={args.preset} dtype={args.dtype} "
        f"prompts={args.num_prompts} new_tokens={args.new_tokens}"
    )
    print(f"{'engine':<20}{'wall s':>9}{'out tok/s':>12}{'vs hf':>8}")
    for name, wall, tps in rows:
        print(f"{name:<20}{wall:>9.2f}{tps:>12.1f}{tps / hf_tps:>8.2f}")
    if served_skip:
        print(f"amoe serve: skipped ({served_skip})")
    # Left padding and 16-bit rounding change transformers' arithmetic slightly, so near-ties can flip a late
    # token; most outputs should still match (tests/gpu checks exactness in float32, unpadded).
    print(f"identical greedy outputs (amoe.LLM vs hf): {same}/{args.num_prompts}")
    print(
        json.dumps(
            {
                "gpu": torch.cuda.get_device_name(0),
                "gpus": gpus,
                "preset": args.preset,
                "dtype": args.dtype,
                "hf_tok_s": round(hf_tps, 1),
                "amoe_offline_tok_s": round(amoe_tps, 1),
                "offline_ratio": round(amoe_tps / hf_tps, 2),
                "amoe_served_tok_s": round(served_tps, 1) if served_tps else None,
                "served_ratio": round(served_tps / hf_tps, 2) if served_tps else None,
                "served_layout": f"{args.attn_ranks}+{experts}" if served_tps else None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
