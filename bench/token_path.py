"""The cost of each request feature on the token path against the plain path, side by side in one run.

    .venv/bin/python bench/token_path.py [--levels head,engine,serve] [--features plain,logprobs,...] [--repeats 5]

Three levels, each feature against `plain` in alternating rounds (medians count: a neighbour's burst on a shared
machine hits every feature alike):

- head: one head step where the runtimes take it (amoe.model.sampler.sample_sequences: what a feature adds to the
  logits processors and the sampler on logits [rows, vocab] float32), for each --vocab, --rows and --temperatures
  (greedy rows take an argmax, sampled ones sort the vocabulary), each row with a 512-token prompt and 256 output
  tokens for the penalties to count; CPU µs per step. A grammar's state and n's fork have no head-level form.
- engine: the single-process engine on the tiny random-weight model decodes --num-seqs sequences of --max-tokens
  tokens as one batch at temperature 1 (n=4: a quarter of the prompts, so as many sequences; its prompt is
  counted once); CPU ms per generated token, every thread of the process (on a shared machine the work done, where
  wall time is mostly the neighbours).
- serve: `amoe serve` (local mode, in this process) answering --requests streamed greedy completions of
  --max-tokens each, --concurrency at a time, over HTTP: output tokens per second through the whole path (head,
  engine thread, coordinator, JSON shaping of the log-probabilities).

A feature is a name, the SamplingParams fields it sets and the request body fields it sends: add one to FEATURES.
Prints a table and a final JSON line with each feature's ratio to plain (> 1: slower) per level. One torch thread by
default: idle intra-op threads spinning on a shared machine would be counted as CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
_BIAS = {t: 1.0 for t in range(10, 60)}
_PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}


@dataclass(frozen=True)
class Feature:
    name: str
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields (head and engine levels)
    body: dict[str, Any] = field(default_factory=dict)  # completions request fields (serve level)
    head: bool = True  # False: no head-level form (a grammar's state, n's fork)
    schema: dict | None = None  # a JSON schema the engine level compiles into SamplingParams.grammar


FEATURES = {
    f.name: f
    for f in (
        Feature("plain"),
        Feature("logprobs", {"logprobs": 1}, {"logprobs": 1}),
        Feature("top20", {"logprobs": 20}, {"logprobs": 20}),
        Feature("penalties", _PENALTIES, _PENALTIES),
        Feature(
            "min_p+logit_bias",
            {"min_p": 0.05, "logit_bias": _BIAS},
            {"min_p": 0.05, "logit_bias": {str(t): b for t, b in _BIAS.items()}},
        ),
        Feature(
            "json_schema",
            body={"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}},
            head=False,
            schema=SCHEMA,
        ),
        Feature("n=4", {"n": 4}, {"n": 4}, head=False),
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
    features = [f for f in features if f.head]
    shapes = [(v, r, t) for v in vocabs for r in rows for t in temperatures]
    for vocab, r, temperature in shapes:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(r, vocab, generator=gen) * 4  # [R, V] float32
        prompt = torch.randint(0, vocab, (512,), generator=gen).tolist()
        output = torch.randint(0, vocab, (256,), generator=gen).tolist()
        cases = {}
        for f in features:
            params = [SamplingParams(temperature=temperature, seed=i, **f.sampling) for i in range(r)]
            cases[f.name] = [_Seq(p, make_generator(p, p.seed), prompt, output) for p in params]

        for name in cases:
            _time_steps(sampler, logits, cases[name], steps)  # warm-up
        runs = {name: [] for name in cases}
        for _ in range(repeats):  # alternating rounds
            for name in cases:
                runs[name].append(_time_steps(sampler, logits, cases[name], steps))
        key = f"V{vocab}xR{r}" + ("-greedy" if temperature == 0 else f"-T{temperature:g}")
        results[key] = _ratios(
            "head", key, {name: statistics.median(v) for name, v in runs.items()}, "µs/step"
        )
    return results


def _ratios(level: str, case: str, med: dict[str, float], unit: str, higher_is_better: bool = False) -> dict:
    """Print each feature's median and its cost against plain (> 1: slower); the ratios, plain left out."""
    ratios = {}
    for name, value in med.items():
        ratio = med["plain"] / value if higher_is_better else value / med["plain"]
        print(f"{level:<7}{case:<22}{name:<18}{value:>12.1f} {unit:<9}{ratio:>8.2f}x", flush=True)
        if name != "plain":
            ratios[name] = round(ratio, 3)
    return ratios


@dataclass
class _Seq:
    """A sequence as the head's token path reads it (amoe.model.logits_processors.SequenceView)."""

    params: Any
    generator: torch.Generator | None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    grammar: Any = None


def _time_steps(sampler, logits: torch.Tensor, seqs: list[_Seq], steps: int) -> float:
    """CPU µs per head step; each step gets a fresh copy of the logits (processors edit them in place), copied
    outside the timing."""
    from amoe.model.sampler import sample_sequences

    rows, total = list(range(len(seqs))), 0.0
    for _ in range(steps):
        batch = logits.clone()
        start = time.process_time()
        sample_sequences(sampler, batch, rows, seqs, (2,))
        total += time.process_time() - start
    return total / steps * 1e6


# ---- engine level


def bench_engine(features: list[Feature], args: argparse.Namespace) -> dict:
    from amoe.engine.config import EngineConfig
    from amoe.engine.local import LocalEngine
    from amoe.model.make import make_model
    from amoe.sampling_params import SamplingParams
    from amoe.structured import compile_grammar

    model_dir = make_model("tiny", tempfile.mkdtemp() + "/tiny-token-path", seed=0)
    engine = LocalEngine(model_dir, EngineConfig())
    gen = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 1000, (31,), generator=gen).tolist() for _ in range(args.num_seqs)]
    base = {"temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    params = {
        f.name: SamplingParams(
            **base, **f.sampling, **({"grammar": compile_grammar(json_schema=f.schema)} if f.schema else {})
        )
        for f in features
    }
    for p in params.values():  # warm: the grammar's tokenizer, the allocator, every code path once
        _engine_run(engine, prompts[:2], p, 0)
    runs: dict[str, list[float]] = {name: [] for name in params}
    for r in range(args.repeats):  # features alternate, so a noisy neighbour hits each alike
        for name, p in params.items():
            seconds, tokens = _engine_run(engine, prompts[: max(1, args.num_seqs // p.n)], p, seed=r + 1)
            runs[name].append(seconds / tokens * 1e3)
    med = {name: statistics.median(v) for name, v in runs.items()}
    return _ratios("engine", f"tiny {args.num_seqs}x{args.max_tokens}", med, "ms/token")


def _engine_run(engine, prompts: list[list[int]], params, seed: int) -> tuple[float, int]:
    """CPU seconds (every thread of the process) and generated tokens of one batch."""
    start = time.process_time()
    for i, prompt in enumerate(prompts):
        engine.add_request(seed * 1000 + i, prompt, dataclasses.replace(params, seed=seed + i))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return time.process_time() - start, tokens


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
    return _ratios("serve", "local", med, "tok/s", higher_is_better=True)


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
    # n choices per request; a grammar may end its JSON object early
    assert all(0 < t <= args.max_tokens * feature.body.get("n", 1) for t in tokens), tokens
    return sum(tokens) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="head,engine,serve")
    parser.add_argument("--features", default=",".join(FEATURES), help=f"of {', '.join(FEATURES)}")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds of every feature; medians")
    parser.add_argument("--vocab", default="32000,151936", help="head level: vocabulary sizes")
    parser.add_argument("--rows", default="1,64", help="head level: requests per head step")
    parser.add_argument(
        "--temperatures", default="0,0.8", help="head level: 0 greedy (an argmax), else sampled (a sort)"
    )
    parser.add_argument("--steps", type=int, default=10, help="head level: steps per round")
    parser.add_argument(
        "--model", default=None, help="serve level: checkpoint (default: the shipped default model)"
    )
    parser.add_argument("--num-seqs", type=int, default=8, help="engine level: sequences per batch")
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
    print(f"{'level':<7}{'case':<22}{'feature':<18}{'median':>12}{'':<10}{'vs plain':>9}")
    results: dict[str, Any] = {}
    if "head" in levels:
        vocabs, rows = (list(map(int, s.split(","))) for s in (args.vocab, args.rows))
        temperatures = [float(t) for t in args.temperatures.split(",")]
        results["head"] = bench_head(features, vocabs, rows, temperatures, args.repeats, args.steps)
    if "engine" in levels:
        results["engine"] = bench_engine(features, args)
    if "serve" in levels:
        results["serve"] = bench_serve(features, args)
    print(json.dumps({"token_path_cost_vs_plain": results}))


if __name__ == "__main__":
    main()
