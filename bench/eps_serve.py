"""EPS-MoE on the emulated EP runtime: `amoe serve --executor emulated --parallel ep` with and without the expert
pipeline, prefill throughput (long prompts, max_tokens 1) and decode throughput, in emulated tokens per second
(wall throughput × the time scale). Prints a table and a final JSON line (docs/findings.md "EPS-MoE").

    python bench/eps_serve.py [--profile deepseek-v2:2] [--gpu h800] [--devices 8] [--seq-lens 1024,8192]
        [--pipelines 1,5,20,auto] [--time-scale 150] [--decode-repeats 1]

`--seq-lens ''` measures decode only. `--decode-repeats N` runs the decode batch N times on the same server and
reports each run and their median (one run is at the mercy of this host's other load).

PN 1 without --ep-kernel is EP as it ran before the pipeline (one grouped step between two all-to-alls); the
others run `--ep-pipelines N --ep-kernel auto`. Prefill: every device gets tokens_per_device / seq_len prompts of
seq_len token ids; decode: `--decode-requests` per device, 8-token prompts, `--decode-tokens` each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from amoe.config import AmoeConfig
from amoe.testing.servers import ServerProcess


def serve_config(args, pipelines: str | None) -> AmoeConfig:
    parallel = {"mode": "ep", "attn_ranks": args.devices}
    if pipelines is not None:
        parallel |= {"ep_pipelines": str(pipelines), "ep_kernel": "auto"}
    return AmoeConfig().replace(
        executor={"kind": "emulated"},
        emulation={
            "profile": args.profile,
            "gpu": args.gpu,
            "routing": "uniform",
            "time_scale": args.time_scale,
        },
        parallel=parallel,
        scheduler={"attn_batch_cap": args.tokens_per_device},
        server={"max_waiting": 100000, "stall_timeout_s": 3600.0},
        transport={"timeout_s": 120.0},
        cache={"max_num_seqs": 1024},
    )


async def run_requests(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Send every prompt at once; (wall seconds until the last answer, completion tokens)."""
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]

        async def one(p: list[int]) -> int:
            body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0}
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start, sum(tokens)


def prompt(n: int, seed: int) -> list[int]:
    return [1] + [3 + (seed * 7919 + i * 104729) % 900 for i in range(n - 1)]


async def measure(args, pipelines: str | None) -> dict:
    row = {
        "pipelines": pipelines or 1,
        "kernel": "auto" if pipelines is not None else "grouped (no pipeline)",
    }
    with ServerProcess(serve_config(args, pipelines), startup_timeout_s=600) as url:
        await run_requests(url, [prompt(16, 0)], 1)  # warm-up
        for seq in args.seq_lens:
            count = args.devices * max(1, args.tokens_per_device // seq)
            wall, _ = await run_requests(url, [prompt(seq, i) for i in range(count)], 1)
            row[f"prefill_{seq}_tok_s"] = round(count * seq * args.time_scale / wall)
        count = args.devices * args.decode_requests
        runs = []
        for _ in range(args.decode_repeats):
            wall, tokens = await run_requests(url, [prompt(8, i) for i in range(count)], args.decode_tokens)
            runs.append(round(tokens * args.time_scale / wall))
        row["decode_tok_s"] = round(statistics.median(runs))
        if len(runs) > 1:
            row["decode_runs"] = runs
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="deepseek-v2:2")
    p.add_argument("--gpu", default="h800")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--seq-lens", default="1024,8192")
    p.add_argument("--tokens-per-device", type=int, default=8192)
    p.add_argument(
        "--pipelines", default="1,5,20", help="PN values; 1 is also run without the pipeline flags"
    )
    p.add_argument("--decode-requests", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--decode-repeats", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=150.0)
    args = p.parse_args()
    args.seq_lens = [int(s) for s in args.seq_lens.split(",") if s]
    rows = []
    for pn in [None, *args.pipelines.split(",")]:
        rows.append(asyncio.run(measure(args, pn)))
        print(rows[-1], flush=True)
    base = rows[0]
    for r in rows[1:]:
        r["gain_pct"] = {
            k: round(100 * (r[k] / base[k] - 1), 1) for k in r if k.endswith("_tok_s") and base.get(k)
        }
    print(f"{'PN':>4} {'kernel':>22} " + " ".join(f"{k:>18}" for k in rows[0] if k.endswith("_tok_s")))
    for r in rows:
        print(
            f"{r['pipelines']:>4} {r['kernel']:>22} "
            + " ".join(f"{r[k]:>18}" for k in r if k.endswith("_tok_s"))
        )
    print(json.dumps({"bench": "eps_serve", "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
