"""Structured output through `amoe serve` on a checkpoint of each tokenizer shape real MoE checkpoints ship:
byte-level BPE (amoe's own, as Qwen, DeepSeek and OLMoE), sentencepiece BPE with byte fallback (as Mixtral) and a
Metaspace decoder (as `tokenizers` converts a sentencepiece model). Each format, streamed and not, gives text its
grammar accepts; a tokenizer whose tokens have no bytes of their own is a 400 naming the parameter."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
from factories import sentencepiece_tokenizer_json, server_in_thread

from amoe.config import AmoeConfig
from amoe.model.make import make_model
from amoe.tokenizer import Tokenizer

MODEL = "tiny-shapes"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "alan"]},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2000},
    },
    "required": ["name", "year"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8} [0-9]{2,4}\."
SHAPES = ["byte-level", "sentencepiece-byte-fallback", "metaspace-decoder"]
# Each shape on the single-process backend, and the Metaspace decoder also as deployed (aep), where the attention
# runtime builds the grammar's tokenizer from the checkpoint itself.
SERVERS = [*((shape, "local") for shape in SHAPES), ("metaspace-decoder", "aep")]
# One option, so the grammar forces every byte: spaces, non-ASCII and a character written by byte tokens; a
# Metaspace decoder writes a <0xNN> piece as it reads, so that shape gets an option its pieces spell.
FORCED = {
    "byte-level": "naïve café 🙂, 42 steps",
    "sentencepiece-byte-fallback": "naïve café 🙂, 42 steps",
    "metaspace-decoder": "the keeper, 42 steps.",
}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return make_model("tiny", tmp_path_factory.mktemp("shapes") / "byte-level", seed=0)


def _with_tokenizer(base: Path, out: Path, tokenizer_json: str) -> Path:
    """The base checkpoint (linked) with another tokenizer.json; the same special ids, so its chat template fits."""
    out.mkdir()
    for path in base.iterdir():
        if path.name != "tokenizer.json":
            (out / path.name).symlink_to(path)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    return out


def _config(model_dir: Path, mode: str = "local") -> AmoeConfig:
    return AmoeConfig().replace(
        model={"path": str(model_dir)},
        parallel={"mode": mode},
        server={"port": 0, "drain_timeout_s": 2.0, "served_model_name": MODEL},
    )


@pytest.fixture(scope="module", params=SERVERS, ids=["-".join(p) for p in SERVERS])
def served(request, base_model):
    """(shape, client, tokenizer) of a server on that shape's checkpoint."""
    shape, mode = request.param
    model_dir = base_model
    if shape != "byte-level":
        style = "metaspace" if shape == "sentencepiece-byte-fallback" else "metaspace-decoder"
        model_dir = base_model.parent / shape
        if not model_dir.exists():
            _with_tokenizer(base_model, model_dir, sentencepiece_tokenizer_json(style))
    with server_in_thread(_config(model_dir, mode)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield shape, client, Tokenizer.from_dir(model_dir)


def _completions(client, stream: bool, **extra) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice, from one response or the chunks of a stream."""
    args = {"model": MODEL, "prompt": "The keeper", "temperature": 1.0, "max_tokens": 40, "n": 2, "seed": 3}
    if not stream:
        return [
            (c.text, c.finish_reason) for c in client.completions.create(**args, extra_body=extra).choices
        ]
    texts, reasons = ["", ""], ["", ""]
    for chunk in client.completions.create(**args, stream=True, extra_body=extra):
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return list(zip(texts, reasons))


def _chat(client, stream: bool, **extra) -> list[tuple[str, str]]:
    args = {"model": MODEL, "messages": [{"role": "user", "content": "Who?"}], "temperature": 1.0, "n": 3}
    args |= {"max_tokens": 64, "seed": 5, **extra}
    if not stream:
        out = client.chat.completions.create(**args)
        return [(c.message.content, c.finish_reason) for c in out.choices]
    texts, reasons = [""] * 3, [""] * 3
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return list(zip(texts, reasons))


@pytest.mark.timeout(180)
def test_chat_json_object_parses_streamed_and_not(served):
    """Any JSON object; closing quotes and braces favoured (logit_bias, applied after the grammar's mask), so that a
    random-weight model's strings end within max_tokens."""
    shape, client, tokenizer = served
    bias = {str(tokenizer.backend.token_to_id(c)): 6 for c in ('"', "}")}
    extra = {"response_format": {"type": "json_object"}, "logit_bias": bias}
    whole = _chat(client, stream=False, **extra)
    for text, reason in whole:
        assert reason == "stop" and isinstance(json.loads(text), dict), (shape, text)
    assert _chat(client, stream=True, **extra) == whole


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("extra", "valid"),
    [
        (
            {"structured_outputs": {"json": SCHEMA}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
        ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    ],
    ids=["json_schema", "regex", "choice"],
)
def test_completion_formats_hold_streamed_and_not(served, extra, valid):
    shape, client, _ = served
    whole = _completions(client, stream=False, **extra)
    for text, reason in whole:
        assert reason == "stop" and valid(text), (shape, text)
    assert _completions(client, stream=True, **extra) == whole


@pytest.mark.timeout(180)
def test_one_choice_writes_exactly_what_the_grammar_forces(served):
    """Every token the mask allows writes the option's next bytes: the text is the option, to the byte."""
    shape, client, _ = served
    option = FORCED[shape]
    for stream in (False, True):
        assert _completions(client, stream, guided_choice=[option]) == [(option, "stop")] * 2, (shape, stream)


@pytest.fixture(scope="module")
def unsupported(base_model):
    """A server on a checkpoint whose decoder (WordPiece) writes a token according to its neighbours."""
    spec = json.loads(sentencepiece_tokenizer_json("metaspace"))
    spec["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    model_dir = _with_tokenizer(base_model, base_model.parent / "wordpiece-decoder", json.dumps(spec))
    with server_in_thread(_config(model_dir)) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("completions", {"guided_regex": "[0-9]+"}, "guided_regex"),
        ("completions", {"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ],
)
def test_a_tokenizer_without_token_bytes_is_a_400_naming_the_parameter(unsupported, route, extra, param):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            if route == "chat":
                messages = [{"role": "user", "content": "Who?"}]
                create = unsupported.chat.completions.create
                create(model=MODEL, messages=messages, max_tokens=4, stream=stream, extra_body=extra)
            else:
                create = unsupported.completions.create
                create(model=MODEL, prompt="The keeper", max_tokens=4, stream=stream, extra_body=extra)
        assert err.value.status_code == 400
        body = err.value.body
        assert body["param"] == param, body
        assert "structured output is unavailable for this model" in body["message"], body
        assert "WordPiece decoder" in body["message"], body
    plain = unsupported.completions.create(
        model=MODEL, prompt="The keeper", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].finish_reason == "length"  # the rest of the API serves on
