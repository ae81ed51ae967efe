"""The exactness oracle: LocalEngine must reproduce Hugging Face MixtralForCausalLM on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from amoe.engine.config import EngineConfig
from amoe.engine.local import LocalEngine
from amoe.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
PROMPT_LENGTHS = (3, 12, 29)

CONFIGS = {
    "gqa-top2-8e": dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    "mqa-top1-4e": dict(num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=1),
    "mha-top2-16e-window": dict(
        num_key_value_heads=4,
        num_local_experts=16,
        num_experts_per_tok=2,
        sliding_window=8,
        num_hidden_layers=2,
    ),
    "tied-legacy-rope-headdim": dict(
        hidden_size=48,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        rope_parameters=None,
        rope_theta=10000.0,
        num_hidden_layers=3,
    ),
}


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_reference(model_dir, prompts):
    """Per prompt (no padding): greedy tokens and the logits of every generated position."""
    model = transformers.MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        assert len(tokens) == NEW_TOKENS, "the reference hit eos early: pick another seed"
        refs.append((tokens, torch.stack([step[0] for step in out.logits])))
    return refs


class _LogitsRecorder:
    """Wraps the engine's scheduler and sampler to keep each request's logits per step."""

    def __init__(self, engine: LocalEngine) -> None:
        self.logits: dict[str, list[torch.Tensor]] = {}
        self._ids: list[str] = []
        schedule, sample = engine.scheduler.schedule, engine.sampler

        def recording_schedule():
            chunks = schedule()
            self._ids = [c.request.request_id for c in chunks]  # logits rows follow chunk order
            return chunks

        def recording_sample(logits, params, generators):
            for row, request_id in enumerate(self._ids):
                self.logits.setdefault(request_id, []).append(logits[row].clone())
            return sample(logits, params, generators)

        engine.scheduler.schedule, engine.sampler = recording_schedule, recording_sample


def _run_engine(engine: LocalEngine, prompts, start_after: dict[int, int] | None = None):
    """Greedy tokens and per-step logits of each prompt; prompt i joins after start_after[i] steps."""
    start_after = start_after or {}
    recorder = _LogitsRecorder(engine)
    tokens = {str(i): [] for i in range(len(prompts))}
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    step = 0
    while step <= max(start_after.values(), default=0) or engine.has_unfinished():
        for i, prompt in enumerate(prompts):
            if start_after.get(i, 0) == step:
                engine.add_request(str(i), prompt, greedy)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
    return [tokens[str(i)] for i in range(len(prompts))], [
        recorder.logits[str(i)] for i in range(len(prompts))
    ]


@pytest.fixture(scope="module", params=list(CONFIGS))
def oracle_case(request, make_checkpoint):
    overrides = CONFIGS[request.param]
    model_dir = make_checkpoint(seed=11, shards=2 if "tied" in request.param else 1, **overrides)
    prompts = _prompts(1024)
    return model_dir, prompts, _hf_reference(model_dir, prompts)


def _assert_matches(tokens, logits, refs, label):
    for i, (ref_tokens, ref_logits) in enumerate(refs):
        assert tokens[i] == ref_tokens, f"{label}: prompt {i} diverged from transformers"
        ours = torch.stack(logits[i])
        assert ours.shape == ref_logits.shape, label
        torch.testing.assert_close(ours, ref_logits, atol=1e-4, rtol=0, msg=f"{label}: prompt {i} logits")


def test_each_prompt_alone_matches_transformers(oracle_case):
    model_dir, prompts, refs = oracle_case
    for i, prompt in enumerate(prompts):
        engine = LocalEngine(model_dir, EngineConfig(block_size=4, num_kv_blocks=64))
        tokens, logits = _run_engine(engine, [prompt])
        _assert_matches(tokens, logits, [refs[i]], f"alone[{i}]")


def test_batched_prompts_match_transformers(oracle_case):
    model_dir, prompts, refs = oracle_case
    engine = LocalEngine(model_dir, EngineConfig(block_size=4, num_kv_blocks=128))
    tokens, logits = _run_engine(engine, prompts)
    _assert_matches(tokens, logits, refs, "batched")


def test_requests_joining_mid_decode_match_transformers(oracle_case):
    model_dir, prompts, refs = oracle_case
    engine = LocalEngine(model_dir, EngineConfig(block_size=16, num_kv_blocks=32))
    tokens, logits = _run_engine(engine, prompts, start_after={0: 0, 1: 5, 2: 9})
    _assert_matches(tokens, logits, refs, "staggered")
