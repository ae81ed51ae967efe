"""The cost of the sampling features on the token path, against the plain path, side by side in one run.

    .venv/bin/python bench/token_path_sampling.py [--num-seqs 8] [--new-tokens 32] [--repeats 3] [--vocab 128000]

Two measurements (`measure_sampling` returns both; bench/token_path.py folds it in):

- engine: the single-process engine on the tiny random-weight model decodes `--num-seqs` sequences of
  `--new-tokens` tokens as one batch, per variant: plain (temperature 1), penalties (presence, frequency and
  repetition), min_p + logit_bias, a JSON schema (llguidance mask per token), and n=4 (one prefill forked into
  four sequences; its prompt is counted once). Reported: CPU ms per generated token (all threads: on a shared
  machine the work done, where wall time is mostly the neighbours), median of `--repeats` runs, and the ratio to
  plain.
- head: the processors and the sampler alone on `--num-seqs` rows of a `--vocab`-wide logits tensor (what a
  realistic vocabulary costs where the tiny model's 1024 tokens hide it): CPU us per row.

Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from amoe.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def _variants(new_tokens: int) -> dict[str, dict]:
    from amoe.structured import compile_grammar

    base = {"temperature": 1.0, "max_tokens": new_tokens, "ignore_eos": True}
    return {
        "plain": base,
        "penalties": {**base, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
        "min_p+logit_bias": {**base, "min_p": 0.05, "logit_bias": {t: 1.0 for t in range(10, 60)}},
        "json_schema": {**base, "grammar": compile_grammar(json_schema=SCHEMA)},
        "n=4": {**base, "n": 4},
    }


def _engine_run(engine, prompts: list[list[int]], params: SamplingParams, seed: int) -> tuple[float, int]:
    """CPU seconds (every thread of the process: on a shared machine the work, where wall time is noise) and
    generated tokens of one batch."""
    start = time.process_time()
    for i, prompt in enumerate(prompts):
        engine.add_request(seed * 1000 + i, prompt, SamplingParams(**{**_fields(params), "seed": seed + i}))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return time.process_time() - start, tokens


def _fields(params: SamplingParams) -> dict:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def measure_engine(num_seqs: int, new_tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    from amoe.engine.config import EngineConfig
    from amoe.engine.local import LocalEngine
    from amoe.model.make import make_model

    model_dir = make_model("tiny", tempfile.mkdtemp() + "/tiny-token-path", seed=0)
    engine = LocalEngine(model_dir, EngineConfig())
    gen = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 1000, (31,), generator=gen).tolist() for _ in range(num_seqs)]
    variants = {name: SamplingParams(**kw) for name, kw in _variants(new_tokens).items()}
    for params in variants.values():  # warm: the grammar's tokenizer, the allocator, every code path once
        _engine_run(engine, prompts[:2], params, 0)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(repeats):  # variants alternate, so a noisy neighbour hits each alike
        for name, params in variants.items():
            run_prompts = prompts[: max(1, num_seqs // params.n)]  # n=4: the same number of sequences
            seconds, tokens = _engine_run(engine, run_prompts, params, seed=r + 1)
            times[name].append(seconds / tokens * 1e3)
    plain = statistics.median(times["plain"])
    return {
        name: {"ms_per_token": statistics.median(t), "ratio": statistics.median(t) / plain}
        for name, t in times.items()
    }


@dataclass
class _Row:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    grammar: object = None
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))


def measure_head(num_seqs: int, vocab: int, repeats: int) -> dict[str, dict[str, float]]:
    from amoe.model.sampler import Sampler, sample_sequences

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(num_seqs, vocab, generator=gen) * 3
    prompt = torch.randint(0, vocab, (512,), generator=gen).tolist()
    output = torch.randint(0, vocab, (256,), generator=gen).tolist()
    kinds = {name: kw for name, kw in _variants(16).items() if name not in ("json_schema", "n=4")}
    sampler, out = Sampler(), {}
    for name, kw in kinds.items():
        rows = [_Row(SamplingParams(**kw), prompt, output) for _ in range(num_seqs)]
        sample_sequences(sampler, logits.clone(), list(range(num_seqs)), rows, (2,))  # warm
        times = []
        for _ in range(repeats * 5):
            batch = logits.clone()
            start = time.process_time()
            sample_sequences(sampler, batch, list(range(num_seqs)), rows, (2,))
            times.append((time.process_time() - start) / num_seqs * 1e6)
        out[name] = {"us_per_row": statistics.median(times)}
    plain = out["plain"]["us_per_row"]
    for r in out.values():
        r["ratio"] = r["us_per_row"] / plain
    return out


def measure_sampling(
    num_seqs: int = 8, new_tokens: int = 32, repeats: int = 3, vocab: int = 128000, threads: int = 1
) -> dict:
    """Both measurements, as one JSON-able dict (what bench/token_path.py folds into its report). One torch
    thread by default: idle intra-op threads spinning on a shared machine would be counted as CPU time."""
    torch.set_num_threads(threads)
    return {
        "bench": "token_path_sampling",
        "engine": measure_engine(num_seqs, new_tokens, repeats),
        "head": measure_head(num_seqs, vocab, repeats),
        "num_seqs": num_seqs,
        "new_tokens": new_tokens,
        "vocab": vocab,
        "threads": threads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    result = measure_sampling(args.num_seqs, args.new_tokens, args.repeats, args.vocab, args.threads)
    print(f"engine (tiny model, {args.num_seqs} sequences x {args.new_tokens} tokens)")
    for name, r in result["engine"].items():
        print(f"  {name:<18} {r['ms_per_token']:8.2f} CPU ms/token  x{r['ratio']:.2f}")
    print(f"head ({args.num_seqs} rows x {args.vocab} logits)")
    for name, r in result["head"].items():
        print(f"  {name:<18} {r['us_per_row']:8.1f} CPU us/row    x{r['ratio']:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
