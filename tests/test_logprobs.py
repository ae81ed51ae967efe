"""Log-probabilities equal transformers' float32 log-softmax (teacher-forced over prompt + output) within 1e-4 in
every mode: the local engine, and aep, ep and pingpong runtime processes (the head runs on the attention rank and
only the top k travel with the token). Greedy tokens rank 1; the top k are transformers' top k; prompt tokens are
scored by the rows before them. Plus the pieces around it: the wire keeps them whole, and an emulated executor,
which computes no logits, refuses a request asking for them."""

import dataclasses

import msgspec
import pytest
import torch
import transformers
from factories import check_logprobs, hf_greedy, random_prompts

from amoe import wire
from amoe.engine.config import EngineConfig
from amoe.engine.local import LocalEngine
from amoe.errors import RequestError
from amoe.logprobs import Logprobs, concat
from amoe.runtime.requests import RankRequests
from amoe.sampling_params import SamplingParams

PROMPTS = random_prompts([6, 13, 1, 30], seed=3)
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5, prompt_logprobs=3)


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def test_local_engine_logprobs_equal_transformers(tiny_checkpoint, hf_model):
    engine = LocalEngine(tiny_checkpoint, EngineConfig())
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(i, prompt, PARAMS)
    outs = {i: [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    for i, prompt in enumerate(PROMPTS):
        output, ref = hf_greedy(hf_model, prompt, PARAMS.max_tokens)
        assert [t for o in outs[i] for t in o.new_token_ids] == output
        check_logprobs(
            ref, prompt + output, concat([o.logprobs for o in outs[i]]), len(prompt), PARAMS.logprobs
        )
        scored = [o.prompt_logprobs for o in outs[i] if o.prompt_logprobs is not None]
        assert len(scored) == 1 and outs[i][0].prompt_logprobs is not None  # once, with the first token
        check_logprobs(
            ref, prompt, scored[0], 1, PARAMS.prompt_logprobs
        )  # the first token has nothing before it


def test_logprobs_survive_the_wire_and_bad_ones_do_not_decode():
    lp = Logprobs([7], [-0.5], [1], [[7, 9]], [[-0.5, float("-inf")]])
    msg = wire.TokenOut(2, [11, 12], [[7], []], [None, "abort"], 5, logprobs=[lp, None])
    back = wire.decode(wire.encode(msg))
    assert back.logprobs == [lp, None] and back.logprobs[0].top_logprobs[0][1] == float("-inf")
    params = dataclasses.replace(PARAMS, seed=4)
    added = wire.decode(wire.encode(wire.AddRequest(1, [1], wire.to_wire_sampling(params, 4))))
    assert wire.from_wire_sampling(added.params) == params
    tag = 5  # TokenOut's; the fields follow in order
    for logprobs in (
        [lp],
        [[[7], [-0.5], [1], [[7]], [[-0.5, -1.0]]], None],
        [[[7], [-0.5], [0], [[]], [[]]], None],
    ):
        frame = bytes([wire.PROTOCOL_VERSION]) + msgspec.msgpack.encode(
            [tag, 2, [11, 12], [[7], []], [None, None], 5, None, logprobs]
        )  # a column short, top ids and values of different lengths, rank 0
        with pytest.raises(wire.WireError):
            wire.decode(frame)
    with pytest.raises(ValueError):  # log-probabilities of other tokens than the ones they travel with
        wire.TokenOut(2, [11], [[8]], [None], 5, logprobs=[lp])


def test_an_emulated_rank_refuses_logprobs_by_name():
    requests = RankRequests(
        vocab_size=100, eos_token_ids=(2,), num_kv_blocks=8, block_size=16, max_model_len=128,
        computes_logits=False,
    )  # fmt: skip
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(RequestError) as err:
            requests.add(1, [1, 5], SamplingParams(**{name: 2}))
        assert err.value.param == name
    requests.add(2, [1, 5], SamplingParams())  # without them it serves


def test_a_moved_request_does_not_score_its_prompt_again():
    requests = RankRequests(
        vocab_size=100, eos_token_ids=(2,), num_kv_blocks=8, block_size=16, max_model_len=128
    )
    params = SamplingParams(prompt_logprobs=1, logprobs=1)
    first, _ = requests.add(1, [1, 5, 7], params)
    moved, _ = requests.add(2, [1, 5, 7, 9, 11], params, num_generated=2)  # its output so far ends the prompt
    assert first.scores_prompt and not moved.scores_prompt


def test_sampling_params_bound_logprobs():
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(RequestError) as err:
            SamplingParams(logprobs=bad)
        assert err.value.param == "logprobs"
    assert SamplingParams(logprobs=0, prompt_logprobs=20).prompt_logprobs == 20


def test_the_offline_llm_returns_them_as_vllm_does(tiny_checkpoint, hf_model):
    from amoe.llm import LLM

    prompt = PROMPTS[0]
    out = LLM(tiny_checkpoint).generate([prompt], PARAMS)[0]
    output, ref = hf_greedy(hf_model, prompt, PARAMS.max_tokens)
    assert out.outputs[0].token_ids == output
    for i, (token, entry) in enumerate(zip(output, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert list(entry)[0] == token and entry[token].rank == 1  # the token first, then the top k
        assert set(entry) == {token, *row.topk(PARAMS.logprobs).indices.tolist()}
        assert abs(entry[token].logprob - float(row[token])) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, token in enumerate(prompt[1:]):
        assert abs(out.prompt_logprobs[i + 1][token].logprob - float(ref[i, token])) < 1e-4


def test_the_offline_llm_gives_each_of_n_its_own_and_ranks_best_of_by_them(tiny_checkpoint):
    """n=2 (and best_of=3 > n) offline: each completion's logprobs are its own sequence's, their sum its
    cumulative_logprob (best_of's ranking, descending); the prompt's are the request's, once. Sequence i is the
    lone request seeded seed + i."""
    from amoe.llm import LLM

    llm, prompt = LLM(tiny_checkpoint), PROMPTS[0]
    common = {"temperature": 1.0, "max_tokens": 4, "ignore_eos": True, "logprobs": 1}
    out = llm.generate([prompt], SamplingParams(n=2, seed=5, prompt_logprobs=1, **common))[0]
    for i, completion in enumerate(out.outputs):
        alone = llm.generate([prompt], SamplingParams(seed=5 + i, **common))[0].outputs[0]
        assert completion.token_ids == alone.token_ids
        values = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
        assert values == pytest.approx(
            [e[t].logprob for t, e in zip(alone.token_ids, alone.logprobs)], abs=1e-4
        )
        assert completion.cumulative_logprob == pytest.approx(sum(values), abs=1e-5)
    assert len(out.prompt_logprobs) == len(prompt)
    best = llm.generate([prompt], SamplingParams(n=2, best_of=3, seed=5, **common))[0].outputs
    assert [c.index for c in best] == [0, 1] and best[0].cumulative_logprob >= best[1].cumulative_logprob
    unranked = llm.generate([prompt], SamplingParams(n=2, seed=5, temperature=1.0, max_tokens=2))[0].outputs
    assert [c.cumulative_logprob for c in unranked] == [None, None]  # none computed, as vLLM without logprobs
