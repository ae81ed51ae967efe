"""The cost of each request feature on the token path against the plain path, side by side in one run.

    .venv/bin/python bench/token_path.py [--levels head,serve] [--features plain,logprobs,...] [--repeats 5]

Two levels, each feature against `plain` in alternating rounds (medians count: a neighbour's burst on a shared
machine hits every feature alike):

- head: one head step where the runtimes take it (amoe.model.sampler.sample_sequences: what a feature adds to the
  sampler on logits [rows, vocab] float32), for each --vocab, --rows and --temperatures (greedy rows take an argmax, sampled
  ones sort the vocabulary); µs per step.
- serve: `amoe serve` (local mode, in this process) answering --requests streamed completions of --max-tokens each,
  --concurrency at a time, over HTTP: output tokens per second, through the whole path (head, engine thread,
  coordinator, JSON shaping of the log-probabilities).

A feature is a name, the SamplingParams fields it sets (the head level; None: it has no head-level form) and the
request body fields it sends (the serve level): add one to FEATURES. Prints a table and a final JSON line with
each feature's ratio to plain (> 1: slower) per level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Feature:
    name: str
    sampling: dict[str, Any] | None = field(
        default_factory=dict
    )  # SamplingParams fields; None: serve level only
    body: dict[str, Any] = field(default_factory=dict)  # completions request fields


FEATURES = {
    f.name: f
    for f in (
        Feature("plain"),
        Feature("logprobs", {"logprobs": 1}, {"logprobs": 1}),
        Feature("top20", {"logprobs": 20}, {"logprobs": 20}),
    )
}


# ---- head level


def bench_head(
    features: list[Feature],
    vocabs: list[int],
    rows: list[int],
    temperatures: list[float],
    repeats: int,
    steps: int,
) -> dict:
    from amoe.model.sampler import Sampler, make_generator
    from amoe.sampling_params import SamplingParams

    sampler, results = Sampler(), {}
    features = [f for f in features if f.sampling is not None]
    shapes = [(v, r, t) for v in vocabs for r in rows for t in temperatures]
    for vocab, r, temperature in shapes:
        logits = torch.randn(r, vocab, generator=torch.Generator().manual_seed(0)) * 4  # [R, V] float32
        cases = {}
        for f in features:
            params = [SamplingParams(temperature=temperature, seed=i, **f.sampling) for i in range(r)]
            cases[f.name] = ([_Seq(p, make_generator(p, p.seed)) for p in params],)

        for name in cases:
            _time_steps(sampler, logits, *cases[name], steps)  # warm-up
        runs = {name: [] for name in cases}
        for _ in range(repeats):  # alternating rounds
            for name in cases:
                runs[name].append(_time_steps(sampler, logits, *cases[name], steps))
        key = f"V{vocab}xR{r}" + ("-greedy" if temperature == 0 else f"-T{temperature:g}")
        med = {name: statistics.median(v) for name, v in runs.items()}
        for name, us in med.items():
            ratio = us / med["plain"]
            print(f"head   {key:<22}{name:<14}{us:>12.1f} µs/step{ratio:>10.2f}x", flush=True)
        results[key] = {name: round(us / med["plain"], 3) for name, us in med.items() if name != "plain"}
    return results


@dataclass
class _Seq:
    """A sequence as the head's token path reads it (amoe.model.logits_processors.SequenceView)."""

    params: Any
    generator: torch.Generator | None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    grammar: Any = None


def _time_steps(sampler, logits: torch.Tensor, seqs: list[_Seq], steps: int) -> float:
    """µs per head step (no feature here has a logits processor, which would edit the logits: the same ones serve
    every step)."""
    from amoe.model.sampler import sample_sequences

    rows = list(range(len(seqs)))
    start = time.perf_counter()
    for _ in range(steps):
        sample_sequences(sampler, logits, rows, seqs, ())
    return (time.perf_counter() - start) / steps * 1e6


# ---- serve level


def bench_serve(features: list[Feature], args: argparse.Namespace) -> dict:
    import httpx

    from amoe.config import AmoeConfig
    from amoe.model.make import default_model_path
    from amoe.serve import AmoeServer

    model = args.model or str(default_model_path())
    config = AmoeConfig().replace(
        model={"path": model}, parallel={"mode": "local"}, server={"port": 0, "drain_timeout_s": 2.0},
        cache={"max_num_seqs": max(args.concurrency, 1)},
    )  # fmt: skip
    server = AmoeServer(config)
    thread = threading.Thread(target=asyncio.run, args=(server.run(),), name="bench-server", daemon=True)
    thread.start()
    while not server.started.wait(0.1):
        if not thread.is_alive():
            raise SystemExit("the server did not start")
    try:
        name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        rounds = {f.name: [] for f in features}
        asyncio.run(_round(server.url, name, features[0], args))  # warm-up
        for _ in range(args.repeats):
            for f in features:
                rounds[f.name].append(asyncio.run(_round(server.url, name, f, args)))
    finally:
        server.request_exit()
        thread.join(30)
    med = {name: statistics.median(v) for name, v in rounds.items()}
    for fname, tps in med.items():
        print(f"serve  {'local':<22}{fname:<14}{tps:>12.1f} tok/s  {med['plain'] / tps:>9.2f}x")
    return {fname: round(med["plain"] / tps, 3) for fname, tps in med.items() if fname != "plain"}


async def _round(url: str, model: str, feature: Feature, args: argparse.Namespace) -> float:
    """Output tokens per second of --requests streamed completions, --concurrency at a time."""
    import httpx

    body = {
        "model": model, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, **feature.body,
    }  # fmt: skip
    gate = asyncio.Semaphore(args.concurrency)

    async def one(client: httpx.AsyncClient, i: int) -> int:
        async with (
            gate,
            client.stream("POST", "/v1/completions", json={**body, "prompt": [1, 20 + i, 7]}) as r,
        ):
            usage = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]["completion_tokens"]
            return usage

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, i) for i in range(args.requests)))
        elapsed = time.perf_counter() - start
    assert all(t == args.max_tokens for t in tokens), tokens
    return sum(tokens) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="head,serve")
    parser.add_argument("--features", default=",".join(FEATURES), help=f"of {', '.join(FEATURES)}")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds of every feature; medians")
    parser.add_argument("--vocab", default="32000,151936", help="head level: vocabulary sizes")
    parser.add_argument("--rows", default="1,64", help="head level: requests per head step")
    parser.add_argument(
        "--temperatures", default="0,0.8", help="head level: 0 greedy (an argmax), else sampled (a sort)"
    )
    parser.add_argument("--steps", type=int, default=10, help="head level: steps per round")
    parser.add_argument("--model", default=None, help="serve level: checkpoint (default: the demo model)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = ["plain", *[n for n in args.features.split(",") if n != "plain"]]
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise SystemExit(f"unknown features {unknown}; known: {', '.join(FEATURES)}")
    features = [FEATURES[n] for n in names]
    levels = args.levels.split(",")
    print(f"{'level':<7}{'case':<22}{'feature':<14}{'median':>12}{'vs plain':>17}")
    results: dict[str, Any] = {}
    if "head" in levels:
        vocabs, rows = (list(map(int, s.split(","))) for s in (args.vocab, args.rows))
        temperatures = [float(t) for t in args.temperatures.split(",")]
        results["head"] = bench_head(features, vocabs, rows, temperatures, args.repeats, args.steps)
    if "serve" in levels:
        results["serve"] = bench_serve(features, args)
    print(json.dumps({"token_path_cost_vs_plain": results}))


if __name__ == "__main__":
    main()
