"""GPU throughput: transformers `generate`, amoe offline (amoe.LLM) and `amoe serve` in each `--parallel` mode, on the
same GPU(s), side by side in one run.

    .venv/bin/python bench/gpu.py [--preset small] [--dtype bfloat16] [--num-prompts 64] [--new-tokens 128]
                                  [--parallel local,aep,ep]

All run the same random-weight checkpoint and the same prompts greedily, and must emit exactly `--new-tokens` tokens
per prompt (eos ignored): transformers and amoe.LLM as one batch on GPU 0 (transformers with left padding), each
server with every request in flight at once over its OpenAI API. The servers' layouts follow the visible GPUs:
`local` is one engine process; `aep` one attention runtime and the other GPUs as expert runtimes; `ep` one device
per GPU, at least two. Where a layout has more runtimes than GPUs they share them (--runtimes-per-gpu), and the
tensors go through host memory (--transport inline) instead of NCCL, which needs a GPU per runtime: on one GPU, aep
and ep measure amoe's runtimes, not NCCL.

Prints a table and a final JSON line (the ratios are against transformers); a mode that fails is reported in both
and the run exits 1. A JSON line on stderr after each engine holds the numbers so far. Without CUDA it says so in
one line and exits 2; `--device cpu` runs the same steps on the CPU (a rehearsal of this script: its numbers are
not what it is for).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import re
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

MODES = ("local", "aep", "ep")
_PLANE = re.compile(
    r", (\w+) transport, "
)  # amoe serve's start-up line: "serving ... (..., nccl transport, ...)"


class DeviceTimer:
    """Wall seconds of a block, the GPU's queued work included (the host only enqueues kernels)."""

    def __enter__(self) -> DeviceTimer:
        _synchronize()
        self.wall = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        _synchronize()
        self.wall = time.perf_counter() - self.wall


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_gpu() -> None:
    """Give the next engine the memory the last one held (LLM sizes its KV cache from what is free)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_amoe(
    model_dir: Path, prompts, new_tokens: int, dtype: str, device: str
) -> tuple[float, list[list[int]]]:
    llm = LLM(model_dir, device=device, dtype=dtype, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up: kernels, allocator
    with DeviceTimer() as timer:
        outs = llm.generate(prompts, params)
    del llm
    _free_gpu()
    return timer.wall, [o.outputs[0].token_ids for o in outs]


def run_hf(
    model_dir: Path, prompts, new_tokens: int, dtype: str, device: str
) -> tuple[float, list[list[int]]]:
    from transformers import MixtralForCausalLM

    first = torch.device(device, 0) if device == "cuda" else torch.device(device)
    model = MixtralForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(first).eval()
    timer, tokens = hf_generate(model, prompts, new_tokens, DeviceTimer, first)
    del model
    _free_gpu()
    return timer.wall, tokens


def layout(mode: str, gpus: int, num_experts: int) -> tuple[dict, dict]:
    """The config sections of `mode` on `gpus` GPUs, and what they mean: the runtimes, how many share a GPU."""
    if mode == "local":
        return {"parallel": {"mode": "local"}}, {"layout": "1 engine", "runtimes_per_gpu": 1}
    if mode == "aep":
        experts = min(max(gpus - 1, 1), num_experts)
        runtimes, shape = 1 + experts, f"1+{experts}"
        parallel = {"mode": "aep", "attn_ranks": 1, "expert_ranks": experts}
    else:
        runtimes = shape = max(gpus, 2)  # two devices at least, so the all-to-all runs
        parallel = {"mode": "ep", "attn_ranks": runtimes}
    per_gpu = -(-runtimes // gpus)
    sections = {"parallel": parallel, "device": {"runtimes_per_gpu": per_gpu}}
    return sections, {"layout": str(shape), "runtimes_per_gpu": per_gpu}


def run_served(
    model_dir: Path, prompts, args: argparse.Namespace, sections: dict
) -> tuple[float, str | None]:
    """Wall seconds from sending every request at once to the last response, on a warm server; and the tensor
    plane the server says it serves on."""
    from amoe.config import AmoeConfig, command_flags
    from amoe.testing.servers import ServerProcess

    config = AmoeConfig().replace(
        model={"path": str(model_dir), "dtype": args.dtype},
        device={"kind": args.device},
        transport={"plane": "auto"},
        cache={"max_num_seqs": max(256, len(prompts))},
    )
    config = config.replace(**sections)
    print(f"starting amoe serve {' '.join(command_flags(config)[2:])}", file=sys.stderr, flush=True)
    server = ServerProcess(config, startup_timeout_s=args.startup_timeout_s)
    with server as url:
        wall = asyncio.run(_serve_all(url, prompts, args.new_tokens))
    planes = [m.group(1) for line in server.lines if (m := _PLANE.search(line))]
    return wall, planes[0] if planes else None


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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--parallel", default=",".join(MODES), help="served modes, comma-separated ('' for none)"
    )
    parser.add_argument("--no-served", action="store_true", help="offline only (as --parallel '')")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="per server")
    parser.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a rehearsal of this script"
    )
    args = parser.parse_args()
    args.modes = [] if args.no_served else [m for m in args.parallel.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        parser.error(
            f"--parallel {args.parallel}: unknown mode {unknown[0]} (choose from {', '.join(MODES)})"
        )
    return args


def main() -> int:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench/gpu.py needs a CUDA GPU: {cuda_missing_reason()}", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    hf_config, gpus = preset(args.preset), torch.cuda.device_count() if cuda else 1
    prompts = make_prompts(
        args.num_prompts, args.min_prompt_len, args.max_prompt_len, hf_config["vocab_size"], args.seed
    )
    total = args.num_prompts * args.new_tokens
    result = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "gpus": gpus if cuda else 0, "preset": args.preset, "dtype": args.dtype,
        "prompts": args.num_prompts, "new_tokens": args.new_tokens, "served": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args.preset, Path(tmp) / f"{args.preset}-bench", seed=args.seed)
        # The in-process engines first, each freeing its memory after; then one server at a time.
        hf_s, hf_tokens = run_hf(model_dir, prompts, args.new_tokens, args.dtype, args.device)
        result["hf_tok_s"] = round(total / hf_s, 1)
        _progress(result)
        amoe_s, amoe_tokens = run_amoe(model_dir, prompts, args.new_tokens, args.dtype, args.device)
        assert all(len(t) == args.new_tokens for t in amoe_tokens + hf_tokens)
        same = sum(a == h for a, h in zip(amoe_tokens, hf_tokens))
        result |= {"amoe_offline_tok_s": round(total / amoe_s, 1), "offline_ratio": round(hf_s / amoe_s, 2)}
        result["identical_offline"] = f"{same}/{args.num_prompts}"
        _progress(result)
        for mode in args.modes:
            result["served"][mode] = served_entry(mode, model_dir, prompts, args, hf_s, gpus, hf_config)
            _progress(result)
    report(result, total)
    return 1 if any("error" in entry for entry in result["served"].values()) else 0


def served_entry(mode: str, model_dir: Path, prompts, args, hf_s: float, gpus: int, hf_config: dict) -> dict:
    """One served mode's numbers, or the error it stopped with (the other modes still run)."""
    experts = (
        hf_config.get("num_local_experts") or hf_config.get("num_experts") or hf_config["n_routed_experts"]
    )
    sections, entry = layout(mode, gpus, experts)
    try:
        wall, plane = run_served(model_dir, prompts, args, sections)
    except Exception as exc:  # a failed mode is a result to report, beside the others
        return {**entry, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
    total = args.num_prompts * args.new_tokens
    return {
        **entry,
        "plane": plane,
        "tok_s": round(total / wall, 1),
        "ratio": round(hf_s / wall, 2),
        "wall_s": round(wall, 2),
    }


def _progress(result: dict) -> None:
    print(json.dumps({"partial": True, **result}), file=sys.stderr, flush=True)


def report(result: dict, total: int) -> None:
    print(
        f"gpu={result['gpu']} x{result['gpus']} preset={result['preset']} dtype={result['dtype']} "
        f"prompts={result['prompts']} new_tokens={result['new_tokens']}"
    )
    print(f"{'engine':<28}{'out tok/s':>12}{'vs hf':>8}")
    print(f"{'hf generate':<28}{result['hf_tok_s']:>12.1f}{1.0:>8.2f}")
    print(f"{'amoe.LLM':<28}{result['amoe_offline_tok_s']:>12.1f}{result['offline_ratio']:>8.2f}")
    for mode, entry in result["served"].items():
        name = f"amoe serve {mode} {entry['layout']}"
        if entry["runtimes_per_gpu"] > 1:
            name += f" ({entry['runtimes_per_gpu']}/GPU)"
        if "error" in entry:
            print(f"{name:<28}  failed: {entry['error']}")
        else:
            print(f"{name:<28}{entry['tok_s']:>12.1f}{entry['ratio']:>8.2f}")
    # Left padding and 16-bit rounding change transformers' arithmetic slightly, so near-ties can flip a late
    # token; most outputs should still match (tests/gpu checks exactness in float32, unpadded).
    print(f"identical greedy outputs (amoe.LLM vs hf): {result['identical_offline']}")
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
