"""LocalEngine: continuous batching invariance, stop rules, KV accounting, preemption, request validation."""

from __future__ import annotations

import pytest
import torch

from amoe.engine.config import EngineConfig
from amoe.engine.local import LocalEngine
from amoe.errors import ConfigError, RequestError
from amoe.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 1024, (n - 1,), generator=gen).tolist() for n in lengths]


def _run(engine, prompts, params=GREEDY, start_after=None):
    """Drive the engine to completion; prompt i joins after start_after[i] steps. → {id: (tokens, reason)}."""
    start_after = start_after or {}
    params = params if isinstance(params, list) else [params] * len(prompts)
    results = {i: ([], None) for i in range(len(prompts))}
    step = 0
    while step <= max(start_after.values(), default=0) or engine.has_unfinished():
        for i, prompt in enumerate(prompts):
            if start_after.get(i, 0) == step:
                engine.add_request(i, prompt, params[i])
        for out in engine.step():
            tokens, _ = results[out.request_id]
            results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
        step += 1
    return [results[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def engine_factory(tiny_checkpoint):
    def make(model_dir=tiny_checkpoint, **options):
        return LocalEngine(model_dir, EngineConfig.from_options(**options))

    return make


@pytest.fixture(scope="module")
def alone(engine_factory):
    """Reference outputs: each prompt run alone in a fresh engine."""
    prompts = _prompts([1, 4, 17, 33, 9, 2])
    return prompts, [_run(engine_factory(), [p])[0] for p in prompts]


def test_batch_of_different_lengths_equals_each_alone(engine_factory, alone):
    prompts, expected = alone
    assert _run(engine_factory(block_size=8), prompts) == expected


def test_requests_joining_while_others_decode(engine_factory, alone):
    prompts, expected = alone
    engine = engine_factory()
    assert _run(engine, prompts, start_after={0: 0, 1: 0, 2: 3, 3: 4, 4: 7, 5: 11}) == expected
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks


def test_small_budgets_and_preemption_keep_tokens(engine_factory, alone):
    prompts, expected = alone
    # 12 blocks of 4 slots cannot hold all six requests at full length: some are preempted and recomputed.
    engine = engine_factory(block_size=4, num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=40)
    assert _run(engine, prompts) == expected
    assert engine.blocks.num_free_blocks == 12 and not engine.has_unfinished()


def test_max_tokens_and_stop_token_ids(engine_factory, alone):
    prompts, expected = alone
    tokens = expected[2][0]
    short = _run(engine_factory(), [prompts[2]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert short == (tokens[:3], "length")
    stop_at = tokens[5]
    stopped = _run(engine_factory(), [prompts[2]], SamplingParams(temperature=0, stop_token_ids=[stop_at]))[0]
    assert stopped == (tokens[: tokens.index(stop_at) + 1], "stop")


def test_eos_stops_unless_ignored(make_checkpoint, engine_factory, alone):
    prompts, expected = alone
    tokens = expected[3][0]
    eos = tokens[4]
    model_dir = make_checkpoint(eos_token_id=eos)  # same weights (same seed and shapes), another eos id
    assert _run(engine_factory(model_dir), [prompts[3]])[0] == (tokens[: tokens.index(eos) + 1], "stop")
    ignoring = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert _run(engine_factory(model_dir), [prompts[3]], ignoring)[0] == (tokens, "length")


def test_max_model_len_ends_with_length(engine_factory, alone):
    prompts, expected = alone
    engine = engine_factory(max_model_len=20)
    tokens, reason = _run(engine, [prompts[2]], SamplingParams(temperature=0, max_tokens=100))[0]
    assert reason == "length" and tokens == expected[2][0][: 20 - 17]


def test_seeded_sampling_is_independent_of_the_batch(engine_factory):
    prompts = _prompts([5, 9, 3], seed=1)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=10)
    alone = _run(engine_factory(), [prompts[0]], seeded)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=10), SamplingParams(temperature=0, max_tokens=4)]
    batched = _run(engine_factory(), prompts, [seeded, *others])[0]
    assert alone == batched


def test_abort_frees_kv(engine_factory):
    engine = engine_factory()
    engine.add_request(1, [1, 2, 3], GREEDY)
    engine.add_request(2, [1, 2, 3, 4], GREEDY)
    engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_total_blocks
    assert engine.abort(1).finish_reason == "abort"
    assert engine.abort(1) is None
    engine.abort(2)
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks and not engine.has_unfinished()
    assert engine.step() == []


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "empty"), ([1, 5000], r"in \[0, 1024\)"), ([1, "a"], "integers"), ([1] * 3000, "limit is 2048")],
)
def test_bad_prompts_are_request_errors(engine_factory, prompt, message):
    with pytest.raises(RequestError, match=message):
        engine_factory().add_request(7, prompt, GREEDY)


def test_duplicate_id_and_bad_options(engine_factory):
    engine = engine_factory()
    engine.add_request(7, [1, 2], GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request(7, [1, 2], GREEDY)
    with pytest.raises(ConfigError, match="unknown engine option 'blocks'"):
        EngineConfig.from_options(blocks=3)
    with pytest.raises(ConfigError, match="block_size must be a positive integer"):
        EngineConfig(block_size=0)
