"""amoe.LLM: text and token-id prompts, input order, stop strings, the shipped default model."""

from __future__ import annotations

import pytest

import amoe
from amoe import LLM, SamplingParams
from amoe.errors import RequestError
from amoe.model.make import default_model_path, make_model

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_model("tiny", tmp_path_factory.mktemp("llm") / "tiny", seed=0))


def test_text_and_token_prompts_in_input_order(llm):
    texts = ["Hello there", "A much longer prompt about mixtures of experts", "x"]
    outs = llm.generate(texts, GREEDY)
    assert [o.prompt for o in outs] == texts
    for text, out in zip(texts, outs):
        assert out.prompt_token_ids == llm.tokenizer.encode(text)
        completion = out.outputs[0]
        assert len(completion.token_ids) == 10 and completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
    by_ids = llm.generate([o.prompt_token_ids for o in outs], GREEDY)
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in outs]
    assert by_ids[0].prompt is None


def test_single_prompt_forms(llm):
    ids = llm.tokenizer.encode("Hello there")
    one_text, one_ids = llm.generate("Hello there", GREEDY), llm.generate(ids, GREEDY)
    assert len(one_text) == len(one_ids) == 1
    assert one_text[0].outputs[0].token_ids == one_ids[0].outputs[0].token_ids


def test_per_prompt_params(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=2), GREEDY])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 10]
    with pytest.raises(RequestError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY])
    with pytest.raises(RequestError, match="prompts must be"):
        llm.generate([1.5], GREEDY)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[1, 2], []], GREEDY)
    assert not llm.engine.has_unfinished()  # the valid first prompt was withdrawn


def test_stop_string_cuts_text_before_it(llm):
    full = llm.generate("Tell me a story", SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), "need a visible stop string"
    cut = llm.generate("Tell me a story", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[
        0
    ].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids and len(cut.token_ids) < len(full.token_ids)
    assert not llm.engine.has_unfinished()


def test_default_model_is_the_shipped_one():
    llm = amoe.LLM()
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3
    assert llm.model_dir == default_model_path()
