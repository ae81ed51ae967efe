"""Every family beyond Mixtral, built by transformers itself (its config class, its model, its save_pretrained),
against transformers' own greedy `generate` on the same checkpoint: offline, in every mode (aep, ep, pingpong),
through `amoe generate` and `amoe serve`, with prompts longer than one KV block; a seeded sampled run gives the
same tokens in every mode; the packed expert layout loads like the per-expert one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from factories import random_prompts, transformers_checkpoint
from metrics_support import serve_model

from amoe.engine.config import EngineConfig
from amoe.engine.local import LocalEngine
from amoe.sampling_params import SamplingParams
from amoe.testing.inproc import InProcessCluster
from amoe.testing.sync_inproc import SyncCluster
from amoe.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

FAMILIES = ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-olmoe", "tiny-deepseek-v2", "tiny-deepseek-v3"]
PROMPT_LENGTHS = [
    5,
    21,
    37,
]  # in-process KV blocks hold 4 tokens, served ones 16: the longer two span several
NEW_TOKENS = 10
TEXT = "The expert said that the tokens of a long prompt travel through every block of the model in order."
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
MODES = {
    "aep": lambda d: InProcessCluster(
        d, num_attn_ranks=2, num_expert_ranks=3, block_size=4, num_kv_blocks=64
    ),
    "ep": lambda d: SyncCluster(d, mode="ep", num_devices=2, block_size=4, num_kv_blocks=64),
    "pingpong": lambda d: SyncCluster(
        d, mode="pingpong", num_attn=1, num_expert=2, micro_batches=2, block_size=4, num_kv_blocks=64
    ),
}


def _sampled(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=NEW_TOKENS, ignore_eos=True)


@dataclass
class FamilyCase:
    name: str
    model_dir: Path
    prompts: list[list[int]]
    greedy: list[list[int]]  # transformers' generate
    logits: list[torch.Tensor]  # and its logits, [NEW_TOKENS, V] per prompt
    sampled: list[list[int]]  # the reference engine's seeded sampling


def _hf_greedy(model, prompts: list[list[int]], logits: list | None = None) -> list[list[int]]:
    """transformers' greedy tokens of each prompt alone (no padding), eos not stopping them; each prompt's logits
    per step [NEW_TOKENS, V] appended to `logits` when given."""
    tokens = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            tokens.append(out.sequences[0, len(p) :].tolist())
            if logits is not None:
                logits.append(torch.stack([step[0] for step in out.logits]))
    return tokens


def _local(model_dir: Path, prompts, params, logits: dict | None = None) -> list[list[int]]:
    """The reference engine's tokens for the prompts, batched; each request's logits per step into `logits`."""
    engine = LocalEngine(model_dir, EngineConfig(block_size=4, num_kv_blocks=128))
    if logits is not None:
        schedule, sample, ids = engine.scheduler.schedule, engine.sampler, []

        def scheduling():  # a step's logits rows follow its chunks
            chunks = schedule()
            ids[:] = [c.request.request_id for c in chunks]
            return chunks

        def sampling(rows, params, generators):
            for row, request_id in zip(rows, ids):
                logits.setdefault(request_id, []).append(row.clone())
            return sample(rows, params, generators)

        engine.scheduler.schedule, engine.sampler = scheduling, sampling
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, params[i] if isinstance(params, list) else params)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[i] for i in range(len(prompts))]


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory) -> FamilyCase:
    model_dir = transformers_checkpoint(
        request.param, tmp_path_factory.mktemp(request.param) / "model", seed=1
    )
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logits: list[torch.Tensor] = []
    greedy = _hf_greedy(model, prompts, logits)
    sampled = _local(model_dir, prompts, [_sampled(i) for i in range(len(prompts))])
    return FamilyCase(request.param, model_dir, prompts, greedy, logits, sampled)


@pytest.mark.timeout(120)
def test_offline_matches_transformers(case):
    """Greedy tokens equal, and every step's logits within 1e-5 (measured: within 2e-7)."""
    logits: dict[int, list[torch.Tensor]] = {}
    assert _local(case.model_dir, case.prompts, GREEDY, logits) == case.greedy
    for i, ref in enumerate(case.logits):
        torch.testing.assert_close(torch.stack(logits[i]), ref, atol=1e-5, rtol=0, msg=f"prompt {i} logits")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_matches_transformers_and_samples_alike(case, mode):
    with MODES[mode](case.model_dir) as cluster:
        greedy = cluster.generate(case.prompts, GREEDY, timeout=60)
        if isinstance(cluster, InProcessCluster):
            reqs = [cluster.add_request(i % 2, 1000 + i, p, _sampled(i)) for i, p in enumerate(case.prompts)]
            assert all(r.done.wait(60) for r in reqs)
            sampled = [r.output for r in reqs]
        else:
            sampled = cluster.wait(
                [cluster.submit(p, _sampled(i)) for i, p in enumerate(case.prompts)], timeout=60
            )
    assert greedy == case.greedy
    assert sampled == case.sampled


def _expected_text(model_dir: Path, prompt_ids: list[int], tokens: list[int]) -> str:
    detok = IncrementalDetokenizer(Tokenizer.from_dir(model_dir), prompt_ids)
    return "".join(detok.add(t) for t in tokens) + detok.flush()


def _reference_text(model_dir: Path) -> tuple[str, list[int]]:
    """The text transformers' greedy tokens for TEXT decode to (as amoe streams it), and TEXT's token ids."""
    prompt_ids = Tokenizer.from_dir(model_dir).encode(TEXT)
    assert len(prompt_ids) > 16  # longer than one KV block of the served cache
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    (tokens,) = _hf_greedy(model, [prompt_ids])
    assert 2 not in tokens, "the reference reaches eos, where amoe would stop: pick another text"
    return _expected_text(model_dir, prompt_ids, tokens), prompt_ids


def _served_text(model_dir: Path, *flags: str) -> dict:
    """`amoe serve --model DIR FLAGS`'s greedy completion of TEXT."""
    import asyncio

    import httpx

    server = serve_model(model_dir, *flags)
    try:
        url = server.wait_for_url()
        body = {"model": model_dir.name, "prompt": TEXT, "max_tokens": NEW_TOKENS, "temperature": 0}

        async def complete():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return (await client.post("/v1/completions", json=body)).json()

        return asyncio.run(complete())
    finally:
        server.stop()


@pytest.mark.timeout(180)
def test_amoe_generate_and_serve_match_transformers(case, capsys):
    """The text `amoe generate` prints and `amoe serve` (default mode) answers is transformers' greedy tokens'."""
    from amoe.cli import main

    expected, _ = _reference_text(case.model_dir)
    args = ["generate", "--model", str(case.model_dir), "--prompt", TEXT, "--temperature", "0"]
    assert main([*args, "--max-tokens", str(NEW_TOKENS)]) == 0
    assert capsys.readouterr().out == expected + "\n"
    answer = _served_text(case.model_dir)
    assert answer["choices"][0]["text"] == expected, answer
    assert answer["usage"]["completion_tokens"] == NEW_TOKENS


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> Path:
    return transformers_checkpoint("tiny-deepseek-v3", tmp_path_factory.mktemp("served") / "model", seed=1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "flags",
    [
        ("--parallel", "ep", "--attn-ranks", "2"),
        ("--parallel", "pingpong", "--attn-ranks", "1", "--expert-ranks", "2"),
    ],
    ids=["ep", "pingpong"],
)
def test_served_sync_modes_match_transformers(deepseek_v3, flags):
    """The synchronous modes' runtime processes with every family feature at once (MLA, a dense layer, a shared
    expert hosted by an expert device, grouped routing): transformers' text."""
    expected, _ = _reference_text(deepseek_v3)
    assert _served_text(deepseek_v3, *flags)["choices"][0]["text"] == expected
