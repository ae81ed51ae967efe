"""`--generation-config` as vLLM applies it: the six sampling fields of generation_config.json become defaults a
request's own values override, max_new_tokens also caps max_tokens, "vllm" switches them off, a directory names
another file; a bad file is one line at start-up. The served path is checked in tests/test_vllm_flags.py."""

from __future__ import annotations

import json
import logging

import pytest

from amoe.errors import ConfigError
from amoe.generation_config import sampling_defaults
from amoe.llm import LLM
from amoe.model.make import make_model
from amoe.sampling_params import SamplingParams
from coordinator.api.protocol import ChatCompletionRequest, CompletionRequest
from coordinator.api.validation import ModelInfo, prepare_chat, prepare_completion

CREATOR = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.01}


class Ids:
    """Token ids only: the prompts under test are ids, and a chat is any four."""

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode_chat(self, messages, add_generation_prompt=True):
        return [1, 5, 6, 7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("genconfig") / "tiny", seed=0)


def write(folder, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, **fields})
    )
    return folder


def test_auto_reads_the_six_fields_and_names_max_new_tokens_max_tokens(tmp_path, caplog):
    folder = write(tmp_path / "m", do_sample=True, max_length=4096, max_new_tokens=7, **CREATOR)
    with caplog.at_level(logging.WARNING, logger="amoe.generation_config"):
        assert sampling_defaults(folder) == {**CREATOR, "max_tokens": 7}
    assert (
        "--generation-config vllm" in caplog.text
    )  # the warning says how to switch them off, as vLLM's does
    assert sampling_defaults(folder, "vllm") == {}
    assert sampling_defaults(tmp_path / "no-file-here") == {}  # auto without a file: no defaults
    other = write(tmp_path / "other", temperature=0.0)
    assert sampling_defaults(folder, str(other)) == {"temperature": 0.0}


@pytest.mark.parametrize("setting, body, named", [
    ("missing-dir", None, "not 'auto', 'vllm' or a directory"),
    ("empty-dir", None, "has no generation_config.json"),
    ("dir", "[1, 2]", "expected a JSON object"),
    ("dir", "{not json", "not readable JSON"),
    ("dir", '{"temperature": -1}', "temperature"),
    ("dir", '{"top_p": 0}', "top_p"),
])  # fmt: skip
def test_a_bad_setting_or_file_is_one_line(tmp_path, setting, body, named):
    (tmp_path / "empty-dir").mkdir()
    if body is not None:
        (tmp_path / "dir").mkdir()
        (tmp_path / "dir" / "generation_config.json").write_text(body)
    with pytest.raises(ConfigError, match=named) as info:
        sampling_defaults(tmp_path, str(tmp_path / setting))
    assert "\n" not in str(info.value)


def model_info(**defaults):
    return ModelInfo(name="m", max_model_len=64, vocab_size=1024, sampling_defaults=defaults)


def completion(model, **body):
    return prepare_completion(CompletionRequest(model="m", prompt=[1, 5, 6], **body), Ids(), model, 0)


def test_requests_take_the_defaults_they_leave_unset():
    model = model_info(**CREATOR)
    params = completion(model).sampling_params
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    assert (params.repetition_penalty, params.min_p, params.max_tokens) == (1.05, 0.01, 16)
    own = completion(model, temperature=0, top_k=-1, repetition_penalty=1.0, min_p=0.0).sampling_params
    assert (own.temperature, own.top_k, own.repetition_penalty, own.min_p, own.top_p) == (
        0,
        -1,
        1.0,
        0.0,
        0.95,
    )
    chat = prepare_chat(
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], top_p=0.5),
        Ids(),
        model,
        0,
    ).sampling_params
    assert (chat.temperature, chat.top_p) == (0.6, 0.5)


def test_max_new_tokens_is_a_default_and_a_cap():
    capped = model_info(max_tokens=5)
    assert completion(capped).max_tokens == 5  # min(completions' 16, the cap)
    assert (
        completion(capped, max_tokens=40).max_tokens == 5
    )  # a request asking for more is capped, as in vLLM
    assert completion(capped, max_tokens=3).max_tokens == 3
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert prepare_chat(chat, Ids(), capped, 0).max_tokens == 5  # chat's default, the room, capped
    assert prepare_chat(chat, Ids(), model_info(), 0).max_tokens == 60  # no cap: the context's room
    roomy = model_info(max_tokens=1000)
    assert completion(roomy, max_tokens=None).max_tokens == 16
    assert completion(roomy, echo=True, max_tokens=0).max_tokens == 1  # echo alone runs one token, cap or not


def test_llm_and_amoe_generate_use_the_defaults_when_given_no_params(model_dir, tmp_path, capsys):
    from amoe.cli import main

    folder = write(tmp_path / "greedy5", temperature=0.0, max_new_tokens=5)
    llm = LLM(str(model_dir), generation_config=str(folder))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    unset = llm.generate([[1, 5, 6, 7]])[0].outputs[0]
    greedy = llm.generate([[1, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert unset.token_ids == greedy.token_ids  # the defaults made it greedy, five tokens or fewer at eos
    assert LLM(str(model_dir), generation_config="vllm").get_default_sampling_params() == SamplingParams()
    # amoe generate: the flags given override the defaults, the rest stay
    assert (
        main(["generate", "--model", str(model_dir), "--prompt", "hello", "--generation-config", str(folder)])
        == 0
    )
    five = capsys.readouterr().out
    args = [
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "hello",
        "--temperature",
        "0",
        "--max-tokens",
        "5",
    ]
    assert main(args) == 0
    assert capsys.readouterr().out == five
