"""Sampling parameters end to end on a random-weight checkpoint: greedy with penalties equals transformers'
`generate` with the same processors (or a direct computation on transformers' logits where it has none); n's
sequences are independent draws that share one prefill (sequence i = a lone request seeded seed + i) in the local
engine and at the attention rank of aep, ep and pingpong; a bounded grammar makes a random model's output parse (an unbounded one, like any JSON object, may still run
into max_tokens, as in vLLM)."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch
import transformers

from amoe.engine.config import EngineConfig
from amoe.engine.local import LocalEngine
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams
from amoe.structured import compile_grammar
from amoe.testing.inproc import InProcessCluster
from amoe.testing.sync_inproc import SyncCluster

PROMPT = [1, 17, 230, 41, 230, 9, 77]
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("sampling") / "tiny-sampling", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    return LocalEngine(model_dir, EngineConfig())


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run(engine: LocalEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Each sequence's tokens (n of them, or best_of) of one request."""
    request_id = int(time.monotonic_ns() % 2**40)
    engine.add_request(request_id, prompt, params)
    out: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.index, []).extend(o.new_token_ids)
    return [out[i] for i in sorted(out)]


def test_greedy_with_processors_equals_transformers_generate(engine, hf_model):
    """repetition_penalty, a bad word, min_tokens and a bias that makes eos the greedy choice as soon as it may
    come: transformers' RepetitionPenalty, NoBadWords, MinNewTokensLength and SequenceBias processors."""
    banned = run(engine, PROMPT, SamplingParams(temperature=0, max_tokens=1))[0][0]  # the greedy first token
    params = SamplingParams(
        temperature=0, max_tokens=12, repetition_penalty=1.8, bad_words_token_ids=[[banned]], min_tokens=5,
        logit_bias={EOS: 100.0},
    )  # fmt: skip
    (ours,) = run(engine, PROMPT, params)
    hf = hf_model.generate(
        torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12, repetition_penalty=1.8,
        bad_words_ids=[[banned]], min_new_tokens=5, sequence_bias={(EOS,): 100.0}, eos_token_id=EOS,
        pad_token_id=EOS,
    )[0, len(PROMPT):].tolist()  # fmt: skip
    assert ours == hf
    assert len(ours) == 6 and ours[-1] == EOS and banned not in ours  # every processor acted


def test_greedy_with_frequency_and_presence_penalties_equals_a_direct_computation(engine, hf_model):
    params = SamplingParams(temperature=0, max_tokens=6, frequency_penalty=1.5, presence_penalty=0.8)
    (ours,) = run(engine, PROMPT, params)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(6):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].double()
            counts = torch.bincount(
                torch.tensor(ids[len(PROMPT) :], dtype=torch.long), minlength=logits.numel()
            )
            logits -= 1.5 * counts + 0.8 * (counts > 0)
            ids.append(int(logits.argmax()))
    assert ours == ids[len(PROMPT) :]
    plain = run(engine, PROMPT, SamplingParams(temperature=0, max_tokens=6))[0]
    assert ours != plain  # the penalties changed the output


def test_n_sequences_are_lone_requests_seeded_seed_plus_index(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, n=3, seed=11, presence_penalty=0.5)
    together = run(engine, PROMPT, params)
    alone = [
        run(
            engine,
            PROMPT,
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, seed=11 + i, presence_penalty=0.5),
        )[0]
        for i in range(3)
    ]
    assert together == alone
    assert len({tuple(t) for t in together}) == 3
    greedy = run(engine, PROMPT, SamplingParams(temperature=0, max_tokens=5, n=2))
    assert greedy[0] == greedy[1] == run(engine, PROMPT, SamplingParams(temperature=0, max_tokens=5))[0]


def test_best_of_sequences_carry_their_raw_log_probability(engine):
    engine.add_request(77, PROMPT, SamplingParams(temperature=1.0, max_tokens=4, n=1, best_of=3, seed=5))
    scores: dict[int, float] = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.logprobs is not None and o.logprobs.logprobs[0] <= 0
            assert o.logprobs.top_ids == [[]]  # best_of alone asks for the token's own, no top k
            scores[o.index] = scores.get(o.index, 0.0) + o.logprobs.logprobs[0]
    assert sorted(scores) == [0, 1, 2]


@pytest.mark.parametrize(
    ("fmt", "check"),
    [
        ({"json_schema": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
        (
            {"regex": r"[a-c]{3}-[0-9]{2}"},
            lambda text: __import__("re").fullmatch(r"[a-c]{3}-[0-9]{2}", text) or pytest.fail(text),
        ),
        (
            {"choice": ["alpha", "beta gamma"]},
            lambda text: text in ("alpha", "beta gamma") or pytest.fail(text),
        ),
    ],
    ids=["json_schema", "regex", "choice"],
)
def test_a_grammar_makes_a_random_model_parse(model_dir, engine, fmt, check):
    from amoe.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, n=2, grammar=compile_grammar(**fmt))
    for tokens in run(engine, [1, 40, 41], params):
        assert tokens[-1] != EOS  # it stops where the grammar is complete, as vLLM does
        check(tokenizer.decode(tokens))


def _children(req) -> list[list[int]]:
    return [req.output] + [child.output for child in req.children]


def _wait(reqs, timeout=60.0):
    deadline = time.monotonic() + timeout
    for req in reqs:
        while not req.done.wait(0.05):
            assert time.monotonic() < deadline, "a request did not finish"


@pytest.mark.timeout(120)
def test_every_mode_samples_at_the_attention_rank_like_the_local_engine(model_dir, engine):
    """n (forked at the rank, KV copied), penalties and a grammar: aep, ep and pingpong give the local engine's
    sequences."""
    cases = [
        SamplingParams(
            temperature=1.0, max_tokens=5, n=3, seed=21, repetition_penalty=1.3, frequency_penalty=0.4
        ),
        SamplingParams(
            temperature=0.8, max_tokens=60, n=2, seed=4, grammar=compile_grammar(json_schema=SCHEMA)
        ),
    ]
    expected = [run(engine, PROMPT, params) for params in cases]
    seq_ids = [[1000, 1001], [2000]]

    with InProcessCluster(model_dir, num_attn_ranks=1, num_expert_ranks=2) as cluster:
        reqs = [cluster.add_request(0, 10 + i, PROMPT, p, seq_ids[i]) for i, p in enumerate(cases)]
        _wait(reqs)
        _wait([c for r in reqs for c in r.children])
        assert [_children(r) for r in reqs] == expected, "aep"
    for mode in ("ep", "pingpong"):
        with SyncCluster(model_dir, mode=mode) as cluster:
            reqs = [cluster.submit(PROMPT, p, rank=0, seq_ids=seq_ids[i]) for i, p in enumerate(cases)]
            _wait(reqs)
            _wait([c for r in reqs for c in r.children])
            assert [_children(r) for r in reqs] == expected, mode


def test_llm_returns_n_completions_and_keeps_a_stop_string_when_asked(model_dir):
    from amoe.llm import LLM

    llm = LLM(model_dir)
    params = SamplingParams(temperature=1.0, seed=8, max_tokens=8, n=2, ignore_eos=True)
    (out,) = llm.generate("Hello", params)
    assert [c.index for c in out.outputs] == [0, 1] and out.outputs[0].token_ids != out.outputs[1].token_ids
    stop = out.outputs[0].text[2:5]
    (kept,) = llm.generate(
        "Hello", SamplingParams(**{**_fields(params), "stop": [stop], "include_stop_str_in_output": True})
    )
    text = out.outputs[0].text
    assert (
        kept.outputs[0].text == text[: text.index(stop) + len(stop)]
        and kept.outputs[0].finish_reason == "stop"
    )


def _fields(params: SamplingParams) -> dict:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
