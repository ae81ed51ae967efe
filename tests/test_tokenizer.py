"""Tokenizer: deterministic training, round trips, chat template, streaming detokenization, agreement with HF."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from factories import sentencepiece_tokenizer_json

from amoe.errors import ModelLoadError, RequestError
from amoe.tokenizer import IncrementalDetokenizer, Tokenizer, write_tokenizer

TEXTS = [
    "Hello, world!",
    "The lighthouse keeper climbed the one hundred and twelve steps.",
    "  two leading spaces, a tab\tand\nnew lines\n\n",
    "Café → naïve façade, 東京, emoji 🙂👍🏽",
    'def f(x: int) -> int:\n    return x ** 2  # 3.14159e-3 {"a": [1, 2]}',
    "<s>[INST] special tokens in text [/INST] ok</s>",
    "",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Why is the sky blue?"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out, 1024)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module", params=["prepend", "metaspace"])
def sp_dir(request, tmp_path_factory) -> Path:
    """A Mistral-style tokenizer: sentencepiece BPE with byte fallback, as in Mixtral's tokenizer.json."""
    out = tmp_path_factory.mktemp(f"sp-{request.param}")
    (out / "tokenizer.json").write_text(sentencepiece_tokenizer_json(request.param), encoding="utf-8")
    config = {  # Mixtral's tokenizer_config.json, with AddedToken dicts and the generic fast class
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "unk_token": "<unk>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1000000000000000019884624838656,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


def test_write_tokenizer_is_deterministic_across_processes(tok_dir, tmp_path):
    # Different thread counts and hash seeds must not change a byte.
    code = "import sys; from amoe.tokenizer import write_tokenizer; write_tokenizer(sys.argv[1], 1024)"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / str(threads))],
            env={**os.environ, "RAYON_NUM_THREADS": str(threads), "PYTHONHASHSEED": str(threads)},
        )
        for threads in (1, 2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        expected = (tok_dir / name).read_bytes()
        assert (tmp_path / "1" / name).read_bytes() == expected
        assert (tmp_path / "2" / name).read_bytes() == expected


def test_written_tokenizer_has_mixtral_special_ids(tok):
    assert tok.vocab_size == 1024
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.backend.token_to_id("<unk>") == 0
    assert tok.model_max_length == 2048


def test_vocab_never_exceeds_request(tmp_path):
    assert write_tokenizer(tmp_path, 300) == 300
    assert Tokenizer.from_dir(tmp_path).vocab_size == 300


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id  # the demo tokenizer's post-processor adds <s>, as Mixtral's does
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text
    assert tok.decode(tok.encode(text.replace("<s>", "").replace("</s>", ""))) == text.replace(
        "<s>", ""
    ).replace("</s>", "")


def test_special_tokens_in_text_are_recognized(tok):
    assert tok.encode("<s>hi</s>", add_special_tokens=False)[0] == 1
    assert tok.encode("<s>hi</s>", add_special_tokens=False)[-1] == 2


def test_chat_template_renders_mistral_format(tok):
    assert tok.apply_chat_template(CHAT) == (
        "<s>[INST] Be brief.\n\nHi [/INST] Hello.</s>[INST] Why is the sky blue? [/INST]"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<s>[INST] Hi [/INST]"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "content": "first"}],
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        [{"role": "tool", "content": "x"}],
    ],
)
def test_chat_template_rejects_bad_conversations(tok, messages):
    with pytest.raises(RequestError, match="chat template"):
        tok.apply_chat_template(messages)


def test_agrees_with_transformers(tok_dir, tok):
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf.encode(text) == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    for messages in (CHAT, CHAT[1:2]):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(messages) == expected


def test_loads_sentencepiece_style_tokenizer(sp_dir):
    tok = Tokenizer.from_dir(sp_dir)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert len(tok.byte_token_ids) == 256
    for text in TEXTS:
        # Leading spaces are not round-trip safe in sentencepiece (Metaspace merges them with its own prefix).
        plain = text.replace("<s>", "").replace("</s>", "").lstrip(" ")
        assert tok.decode(tok.encode(plain)) == plain
    ids = tok.encode("naïve 🙂", add_special_tokens=False)
    assert any(i in tok.byte_token_ids for i in ids)  # characters outside the vocabulary fall back to bytes


def test_sentencepiece_style_agrees_with_transformers(sp_dir):
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer
    hf = AutoTokenizer.from_pretrained(sp_dir)
    tok = Tokenizer.from_dir(sp_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf.encode(text) == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)


def _random_ids(rng: random.Random, tok: Tokenizer) -> list[int]:
    # Half the ids from the low range, where single bytes (byte-level alphabet or <0x..> tokens) live.
    return [
        rng.randrange(tok.vocab_size) if rng.random() < 0.5 else rng.randrange(3, 259)
        for _ in range(rng.randrange(1, 30))
    ]


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] = ()) -> str:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert detok.text == "".join(deltas)
    return detok.text


def test_incremental_detokenizer_matches_full_decode(tok):
    rng = random.Random(0)
    prompt = tok.encode("The keeper said")
    for _ in range(300):
        ids = _random_ids(rng, tok)
        assert _stream(tok, ids) == tok.decode(ids), ids
        assert _stream(tok, ids, prompt) == tok.decode(prompt + ids)[len(tok.decode(prompt)) :], ids


def test_incremental_detokenizer_sentencepiece_style(sp_dir):
    tok = Tokenizer.from_dir(sp_dir)
    rng = random.Random(1)
    prompt = tok.encode("The keeper said")
    for _ in range(300):
        ids = _random_ids(rng, tok)
        assert _stream(tok, ids) == tok.decode(ids), ids
        assert _stream(tok, ids, prompt) == tok.decode(prompt + ids)[len(tok.decode(prompt)) :], ids


def test_incremental_detokenizer_holds_back_partial_characters(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # a rare character spans several byte tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
    assert detok.flush() == ""


def test_first_generated_token_keeps_its_leading_space(sp_dir):
    tok = Tokenizer.from_dir(sp_dir)
    prompt, the = tok.encode("Hello"), tok.backend.token_to_id("▁the")
    detok = IncrementalDetokenizer(tok, prompt)
    assert (
        detok.add(the) + detok.flush() == " the"
    )  # a full decode would strip a leading space: context matters


def test_missing_tokenizer_names_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_files_name_the_file(tok_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ModelLoadError, match="chat_template"):
        Tokenizer.from_dir(tmp_path)


def test_without_config_no_named_specials_and_no_template(tok_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    # As in transformers: no bos_token / eos_token without a config, but the post-processor still adds <s>.
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id, tok.eos_token_id) == (None, None, None, None)
    assert tok.encode("hi")[0] == 1
    with pytest.raises(RequestError, match="no chat_template"):
        tok.apply_chat_template(CHAT)
