"""Offline throughput: amoe.LLM vs transformers `generate` on the same random-weight checkpoint, side by side.

    .venv/bin/python bench/offline.py [--preset small] [--num-prompts 16] [--new-tokens 64]
    .venv/bin/python bench/offline.py --families      # small Mixtral, then each family's small preset

Both run the same prompts greedily as one batch (transformers with left padding) and must emit exactly
`--new-tokens` tokens per prompt (eos ignored), `--repeats` times each, alternating; the medians count. Prints a
table and a final JSON line (with --families, one entry per preset).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from amoe import LLM, SamplingParams
from amoe.model.checkpoint import write_random_checkpoint
from amoe.model.presets import preset


def make_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist() for n in lengths]


class Timer:
    """Wall and CPU seconds of a block: on a shared machine CPU time shows the work when wall time is noisy."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def amoe_runner(model_dir: str, prompts: list[list[int]], new_tokens: int):
    """A warmed-up amoe.LLM; each call of the result times one batch → (timer, new tokens of each prompt)."""
    llm = LLM(model_dir, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up

    def run() -> tuple[Timer, list[list[int]]]:
        with Timer() as timer:
            outs = llm.generate(prompts, params)
        return timer, [o.outputs[0].token_ids for o in outs]

    return run


def hf_runner(model_dir: str, prompts: list[list[int]], new_tokens: int):
    """transformers' model of the checkpoint; each call of the result times one batch (hf_generate)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return lambda: hf_generate(model, prompts, new_tokens)


def hf_generate(model, prompts: list[list[int]], new_tokens: int, timer=Timer, device=None):
    """transformers' batched greedy `generate` over left-padded prompts, warmed up, timed by `timer` (a Timer
    class) → (timer, the new tokens of each prompt). bench/gpu.py runs it on the GPU."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=mask[:2], max_new_tokens=2, **kwargs)  # warm-up
        with timer() as timed:
            out = model.generate(
                input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs
            )
    return timed, out[:, width:].tolist()


FAMILY_PRESETS = (
    "small", "small-qwen2-moe", "small-qwen3-moe", "small-olmoe", "small-deepseek-v2", "small-deepseek-v3",
)  # fmt: skip


def run_preset(name: str, args: argparse.Namespace) -> dict:
    """Both engines on one preset's checkpoint; prints its rows, returns its numbers."""
    hf_config = preset(name)
    prompts = make_prompts(
        args.num_prompts, args.min_prompt_len, args.max_prompt_len, hf_config["vocab_size"], args.seed
    )
    total = args.num_prompts * args.new_tokens
    with tempfile.TemporaryDirectory() as model_dir:
        write_random_checkpoint(hf_config, model_dir, seed=args.seed)
        runners = (
            amoe_runner(model_dir, prompts, args.new_tokens),
            hf_runner(model_dir, prompts, args.new_tokens),
        )
        # Alternating runs, medians: a neighbour's burst on this shared machine hits both engines alike.
        runs = [[runner() for runner in runners] for _ in range(args.repeats)]
    (amoe_t, amoe_tokens), (hf_t, hf_tokens) = (_median([r[i] for r in runs]) for i in (0, 1))
    assert all(len(t) == args.new_tokens for t in amoe_tokens + hf_tokens)
    same = sum(a == h for a, h in zip(amoe_tokens, hf_tokens))
    amoe_tps, hf_tps = total / amoe_t.wall, total / hf_t.wall
    for engine, timer, tps in (("amoe.LLM", amoe_t, amoe_tps), ("hf generate", hf_t, hf_tps)):
        print(
            f"{name:<20}{engine:<14}{timer.wall:>9.2f}{timer.cpu:>9.2f}{tps:>12.1f}{total / timer.cpu:>12.1f}"
            f"{same:>6}/{args.num_prompts}"
        )
    return {
        "amoe_tok_s": round(amoe_tps, 1),
        "hf_tok_s": round(hf_tps, 1),
        "ratio": round(amoe_tps / hf_tps, 2),
        "cpu_ratio": round(hf_t.cpu / amoe_t.cpu, 2),  # the same ratio in CPU seconds: steadier when shared
    }


def _median(runs: list[tuple[Timer, list[list[int]]]]) -> tuple[Timer, list[list[int]]]:
    """One timer with the median wall and CPU seconds of the runs, and the tokens (the same in every run)."""
    timer = Timer()
    timer.wall = statistics.median(t.wall for t, _ in runs)
    timer.cpu = statistics.median(t.cpu for t, _ in runs)
    assert all(tokens == runs[0][1] for _, tokens in runs), "greedy tokens changed between runs"
    return timer, runs[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument(
        "--families", action="store_true", help="every family's small preset, one after another"
    )
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each engine; medians")
    # One intra-op thread by default: these matrices are small, and on a shared machine a second OpenMP thread
    # that gets descheduled stalls every op. Both engines always run with the same setting.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    names = FAMILY_PRESETS if args.families else (args.preset,)
    print(
        f"prompts={args.num_prompts} new_tokens={args.new_tokens} threads={torch.get_num_threads()} "
        f"repeats={args.repeats} (median seconds)"
    )
    # Left padding changes HF's float rounding slightly, so a near-tie can flip a late token; most should match.
    print(
        f"{'preset':<20}{'engine':<14}{'wall s':>9}{'cpu s':>9}{'out tok/s':>12}{'tok/cpu-s':>12}{'same':>8}"
    )
    results = {name: run_preset(name, args) for name in names}
    print(json.dumps(results if args.families else results[args.preset]))


if __name__ == "__main__":
    main()
