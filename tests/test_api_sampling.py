"""What the openai SDK sends beyond the basics, against `amoe serve` (aep: the parameters travel to the attention
runtime on the wire): n, best_of, penalties, vLLM's extras (extra_body), structured output with response_format
json_schema and guided_* / structured_outputs, stop strings kept with include_stop_str_in_output, streams of n
choices. The reference is the single-process engine on the same checkpoint and seeds."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from factories import server_in_thread

from amoe.config import AmoeConfig
from amoe.engine.config import EngineConfig
from amoe.engine.local import LocalEngine
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams
from amoe.structured import compile_grammar
from amoe.tokenizer import Tokenizer

MODEL = "tiny-sampling-api"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "alan"]},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2000},
    },
    "required": ["name", "year"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("api-sampling") / MODEL, seed=0)


@pytest.fixture(scope="module")
def server(model_dir):
    config = AmoeConfig().replace(model={"path": str(model_dir)}, server={"port": 0, "drain_timeout_s": 2.0})
    with server_in_thread(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(model_dir):
    return LocalEngine(model_dir, EngineConfig())


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


def reference(engine, tokenizer, prompt: str, params: SamplingParams) -> list[tuple[str, float]]:
    """(text, raw cumulative log-probability or 0) of each sequence, from the single-process engine."""
    engine.add_request(1, tokenizer.encode(prompt), params)
    tokens: dict[int, list[int]] = {}
    score: dict[int, float] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.index, []).extend(o.new_token_ids)
            score[o.index] = score.get(o.index, 0.0) + (sum(o.logprobs.logprobs) if o.logprobs else 0.0)
    return [(tokenizer.decode(tokens[i]), score[i]) for i in sorted(tokens)]


@pytest.mark.timeout(120)
def test_n_and_penalties_equal_the_engine(client, engine, tokenizer):
    common = {
        "temperature": 1.0,
        "max_tokens": 6,
        "seed": 42,
        "presence_penalty": 0.6,
        "frequency_penalty": 0.3,
    }
    out = client.completions.create(
        model=MODEL, prompt="The cat", n=3, extra_body={"repetition_penalty": 1.2, "min_p": 0.02}, **common
    )
    params = SamplingParams(n=3, repetition_penalty=1.2, min_p=0.02, **common)
    expected = [text for text, _ in reference(engine, tokenizer, "The cat", params)]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == expected
    assert out.usage.completion_tokens == 18

    greedy = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, temperature=0, max_tokens=5,
        frequency_penalty=2.0,
    )  # fmt: skip
    assert len(greedy.choices) == 2 and greedy.choices[0].message.content == greedy.choices[1].message.content


@pytest.mark.timeout(120)
def test_best_of_returns_the_highest_scoring_sequences(client, engine, tokenizer):
    body = {"temperature": 1.0, "max_tokens": 5, "seed": 7, "ignore_eos": True}
    out = client.completions.create(model=MODEL, prompt="Once", n=2, best_of=4, extra_body=body)
    ranked = sorted(
        reference(engine, tokenizer, "Once", SamplingParams(n=2, best_of=4, **body)), key=lambda r: -r[1]
    )
    assert [c.text for c in out.choices] == [text for text, _ in ranked[:2]]
    assert out.usage.completion_tokens == 20  # every sequence generated counts


@pytest.mark.timeout(120)
def test_n_chat_choices_carry_their_own_raw_logprobs_streamed_alike(client, engine, tokenizer):
    """Chat n=2 with logprobs under a penalty, sampled at the attention rank: each choice's log-probabilities are
    the engine's for its sequence (the raw model's: the penalty changes the draws, not them), and a stream carries
    each choice's in its own chunks."""
    body = {"temperature": 1.0, "max_tokens": 4, "seed": 3, "presence_penalty": 1.5}
    messages = [{"role": "user", "content": "hi"}]
    args = {"model": MODEL, "messages": messages, "n": 2, "logprobs": True, "top_logprobs": 2, **body}
    out = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    engine.add_request(
        2, tokenizer.encode_chat(messages), SamplingParams(n=2, logprobs=2, ignore_eos=True, **body)
    )
    expected: dict[int, list[tuple[float, list[float]]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            expected.setdefault(o.index, []).extend(zip(o.logprobs.logprobs, o.logprobs.top_logprobs))
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        _close(_values(choice.logprobs.content), expected[choice.index])
    streamed = client.chat.completions.create(**args, stream=True, extra_body={"ignore_eos": True})
    per_choice: dict[int, list] = {0: [], 1: []}
    for chunk in streamed:
        for c in chunk.choices:
            per_choice[c.index] += c.logprobs.content if c.logprobs else []
    for choice in out.choices:
        assert [e.token for e in per_choice[choice.index]] == [e.token for e in choice.logprobs.content]
        _close(_values(per_choice[choice.index]), _values(choice.logprobs.content))


def _values(content) -> list[tuple[float, list[float]]]:
    return [(e.logprob, [t.logprob for t in e.top_logprobs]) for e in content]


def _close(got: list[tuple[float, list[float]]], want: list[tuple[float, list[float]]]) -> None:
    """Equal but for float noise (a step batched otherwise runs other matmul shapes)."""
    assert len(got) == len(want)
    for (value, top), (value_want, top_want) in zip(got, want):
        assert value == pytest.approx(value_want, abs=1e-4)
        assert top == pytest.approx(top_want, abs=1e-4)


@pytest.mark.timeout(120)
def test_response_format_json_schema_always_parses(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "who?"}], n=3, temperature=1.0, max_tokens=40, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )  # fmt: skip
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("extra", "valid"),
    [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": "[0-9]{4}"}, lambda t: len(t) == 4 and t.isdigit()),
        (
            {"structured_outputs": {"json": SCHEMA}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        (
            {"guided_grammar": 'root ::= "x" [0-9] [0-9]'},
            lambda t: len(t) == 3 and t[0] == "x" and t[1:].isdigit(),
        ),
    ],
    ids=["guided_choice", "guided_regex", "structured_outputs", "guided_json", "guided_grammar(gbnf)"],
)
def test_vllm_structured_output_parameters(client, extra, valid):
    out = client.completions.create(
        model=MODEL, prompt="A", temperature=1.0, max_tokens=40, n=2, extra_body=extra
    )
    for choice in out.choices:
        assert valid(choice.text), choice.text


@pytest.mark.timeout(120)
def test_stop_strings_per_sequence_and_streams_of_n_choices(client, engine, tokenizer):
    body = {"temperature": 1.0, "max_tokens": 12, "seed": 3, "ignore_eos": True}
    full = reference(engine, tokenizer, "Hello", SamplingParams(n=2, **body))
    stop = full[0][0][3:6]  # a stop string inside the first sequence's text
    kept = client.completions.create(
        model=MODEL, prompt="Hello", n=2, stop=[stop], extra_body={**body, "include_stop_str_in_output": True}
    )
    cut = full[0][0].index(stop)
    assert kept.choices[0].text == full[0][0][: cut + len(stop)] and kept.choices[0].finish_reason == "stop"
    second = full[1][0]
    assert kept.choices[1].text == (second[: second.index(stop) + len(stop)] if stop in second else second)

    chunks = client.completions.create(model=MODEL, prompt="Hello", n=2, stream=True, extra_body=body)
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [text for text, _ in full]


def test_structured_output_grammar_is_checked_on_the_served_tokenizer(model_dir):
    """A schema the compiler takes but that has no valid output is still refused before it runs."""
    from amoe.errors import RequestError
    from amoe.structured import Grammars

    grammars = Grammars.for_model(model_dir, 1024, (2,))
    grammars.check(compile_grammar(json_schema=SCHEMA))
    with pytest.raises(RequestError) as err:
        grammars.check(
            compile_grammar(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), "guided_json"
        )
    assert err.value.param == "guided_json"


@pytest.mark.timeout(120)
def test_allowed_token_ids_and_special_tokens_in_the_text(client, tokenizer):
    body = {"temperature": 1.0, "max_tokens": 6, "seed": 5, "ignore_eos": True}
    allowed = tokenizer.encode(" a b c", add_special_tokens=False)
    out = client.completions.create(
        model=MODEL, prompt="x", extra_body={**body, "allowed_token_ids": allowed}
    )
    assert set(tokenizer.encode(out.choices[0].text, add_special_tokens=False)) <= set(allowed)
    forced_eos = {
        **body,
        "max_tokens": 3,
        "logit_bias": {"2": 100},
    }  # eos (</s>) every time; ignore_eos goes on
    kept = client.completions.create(
        model=MODEL, prompt="x", extra_body={**forced_eos, "skip_special_tokens": False}
    )
    skipped = client.completions.create(model=MODEL, prompt="x", extra_body=forced_eos)
    assert kept.choices[0].text == "</s></s></s>" and skipped.choices[0].text == ""
