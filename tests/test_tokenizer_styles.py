"""Prompts tokenize as transformers does for the tokenizer styles real MoE checkpoints use, and serve the same text.

Each style is a tiny checkpoint (the session's random-weight Mixtral) with a tokenizer built offline: a
Llama/Mistral-style BOS post-processor, none at all, `add_bos_token: false`, BOS and EOS, a config that disagrees
with tokenizer.json, and Qwen-style with no BOS token; chat templates that write the BOS themselves or do not.
transformers (AutoTokenizer, MixtralForCausalLM.generate) is the reference throughout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import tokenizers
import torch
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers

from amoe import cli
from amoe.backends.local import LocalBackend
from amoe.engine.config import EngineConfig
from amoe.engine.local import LocalEngine
from amoe.llm import LLM
from amoe.sampling_params import SamplingParams
from amoe.tokenizer import IncrementalDetokenizer, Tokenizer, _corpus
from coordinator.api.app import create_app
from coordinator.api.validation import ModelInfo

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 8
PROMPT = "The lighthouse keeper climbed the steps"
MESSAGES = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Why is the sky blue?"},
]
TEXTS = [
    PROMPT,
    "  two leading spaces, a tab\tand\nnew lines\n",
    "Café → naïve, 東京 🙂 123,456.7",
    "<s>[INST] special tokens written in the text [/INST]</s>",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]

LLAMA_SPECIALS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")  # ChatML tokens as in Hermes-Mixtral
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

TEMPLATES = {
    # Mixtral-Instruct's layout: the template starts with the BOS itself.
    "writes-bos": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
    ),
    # ChatML (Qwen, DBRX, Hermes-Mixtral): no BOS anywhere.
    "no-bos": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}

_BOS = processors.TemplateProcessing(
    single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
)
_BOS_EOS = processors.TemplateProcessing(
    single="<s> $A </s>", pair="<s> $A </s> <s> $B </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
)
_NOTHING = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
_LLAMA_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
}
_QWEN_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "bos_token": None,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
}


@dataclass(frozen=True)
class Style:
    """A checkpoint's tokenizer files, and what transformers' tokenizer(text) does with them."""

    specials: tuple[str, ...]
    post_processor: Any  # a tokenizers post-processor, or None
    config: dict[str, Any]
    template: str  # the chat template it ships with
    adds_bos: bool
    adds_eos: bool = False
    extra_json: dict[str, Any] = field(default_factory=dict)  # other tokenizer.json fields


STYLES = {
    "llama-bos-post-processor": Style(LLAMA_SPECIALS, _BOS, _LLAMA_CONFIG, "writes-bos", adds_bos=True),
    # The reported case: a BOS token is defined (and add_bos_token set) but tokenizer.json adds nothing.
    "no-post-processor": Style(LLAMA_SPECIALS, None, _LLAMA_CONFIG, "writes-bos", adds_bos=False),
    # As transformers 4 saves a Llama tokenizer made with add_bos_token=False.
    "add-bos-token-false": Style(
        LLAMA_SPECIALS, _NOTHING, {**_LLAMA_CONFIG, "add_bos_token": False}, "no-bos", adds_bos=False
    ),
    "bos-and-eos": Style(
        LLAMA_SPECIALS, _BOS_EOS, {**_LLAMA_CONFIG, "add_eos_token": True}, "writes-bos", True, adds_eos=True
    ),
    # transformers 5 ignores add_bos_token once there is a tokenizer.json: the post-processor wins.
    "config-disagrees": Style(
        LLAMA_SPECIALS, _BOS, {**_LLAMA_CONFIG, "add_bos_token": False}, "no-bos", adds_bos=True
    ),
    "qwen-no-bos": Style(
        QWEN_SPECIALS, processors.ByteLevel(trim_offsets=False), _QWEN_CONFIG, "no-bos", False
    ),
    # Truncation and padding saved for training must not cut or pad a prompt.
    "truncation-and-padding": Style(
        LLAMA_SPECIALS,
        _BOS,
        _LLAMA_CONFIG,
        "writes-bos",
        adds_bos=True,
        extra_json={
            "truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0},
            "padding": {
                "strategy": {"Fixed": 64},
                "direction": "Right",
                "pad_to_multiple_of": None,
                "pad_id": 0,
                "pad_type_id": 0,
                "pad_token": "<unk>",
            },
        },
    ),
}


def _trained(specials: tuple[str, ...]) -> tokenizers.Tokenizer:
    """A small byte-level BPE; Qwen-style (NFC, Qwen's split) when its first special is <|endoftext|>."""
    backend = tokenizers.Tokenizer(models.BPE())
    if specials == QWEN_SPECIALS:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,  # within the tiny model's 1024 ids
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus().splitlines(keepends=True), trainer)
    return backend


class StyleDirs:
    """Checkpoint dirs: the tiny checkpoint's weights and config (linked) plus one style's tokenizer files."""

    def __init__(self, root: Path, checkpoint: Path) -> None:
        self.root, self.checkpoint = root, checkpoint
        self._trained: dict[tuple[str, ...], str] = {}
        self._made: dict[tuple[str, str], Path] = {}

    def __call__(self, name: str, template: str | None = None) -> Path:
        style = STYLES[name]
        template = template or style.template
        if (name, template) not in self._made:
            out = self.root / f"{name}-{template}"
            out.mkdir()
            for linked in ("config.json", "model.safetensors"):
                (out / linked).symlink_to(self.checkpoint / linked)
            (out / "tokenizer.json").write_text(self._tokenizer_json(style), encoding="utf-8")
            config = {**style.config, "chat_template": TEMPLATES[template]}
            (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
            self._made[name, template] = out
        return self._made[name, template]

    def _tokenizer_json(self, style: Style) -> str:
        if style.specials not in self._trained:
            self._trained[style.specials] = _trained(style.specials).to_str()
        backend = tokenizers.Tokenizer.from_str(self._trained[style.specials])
        backend.post_processor = style.post_processor
        return json.dumps({**json.loads(backend.to_str()), **style.extra_json})


@pytest.fixture(scope="module")
def style_dir(tmp_path_factory, tiny_checkpoint) -> StyleDirs:
    """style_dir(name, template=None) → a checkpoint dir with that tokenizer style (and chat template)."""
    return StyleDirs(tmp_path_factory.mktemp("styles"), tiny_checkpoint)


@pytest.fixture(scope="module")
def hf_generate(tiny_checkpoint):
    """hf_generate(ids) → transformers' greedy new tokens for a prompt, NEW_TOKENS at most."""
    model = transformers.MixtralForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    done: dict[tuple[int, ...], list[int]] = {}

    def generate(ids: list[int]) -> list[int]:
        if tuple(ids) not in done:
            out = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
            )
            done[tuple(ids)] = out[0, len(ids) :].tolist()
        return done[tuple(ids)]

    return generate


def _hf_tokenizer(path: Path):
    return transformers.AutoTokenizer.from_pretrained(path)


def _hf_chat_ids(hf, messages=MESSAGES) -> list[int]:
    return hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]


# ---- prompt token ids


@pytest.mark.parametrize("name", STYLES)
def test_completion_prompt_ids_equal_transformers(style_dir, name):
    path, style = style_dir(name), STYLES[name]
    tok, hf = Tokenizer.from_dir(path), _hf_tokenizer(path)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ids == hf.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
    # The style's own convention, not just agreement: a BOS (and EOS) exactly when its tokenizer.json adds one.
    ids = tok.encode(PROMPT)
    assert len(ids) > 4  # tokenizer.json's truncation to 4 does not apply
    assert (ids[0] == tok.bos_token_id) == style.adds_bos
    assert (ids[-1] == tok.eos_token_id) == style.adds_eos
    plain = tok.encode(PROMPT, add_special_tokens=False)
    assert len(ids) == len(plain) + style.adds_bos + style.adds_eos


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("name", STYLES)
def test_chat_prompt_ids_equal_transformers(style_dir, name, template):
    path = style_dir(name, template)
    tok, hf = Tokenizer.from_dir(path), _hf_tokenizer(path)
    for messages in (MESSAGES, MESSAGES[:1]):
        ids = tok.encode_chat(messages)
        assert ids == _hf_chat_ids(hf, messages)
        assert tok.apply_chat_template(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    # A template that writes the BOS gets exactly that one; any other gets none, whatever the post-processor adds.
    has_bos = template == "writes-bos" and tok.bos_token_id is not None
    ids = tok.encode_chat(MESSAGES)
    assert (ids[0] == tok.bos_token_id) == has_bos
    if tok.bos_token_id is not None:
        assert ids.count(tok.bos_token_id) == has_bos


@pytest.mark.parametrize("model", ["tiny", "default"])
def test_amoes_own_tokenizers_keep_their_completion_ids(tmp_path, model):
    """The tokenizer.json amoe writes (the presets', the default model's) adds <s> itself, so its prompts are what
    they were: <s> then the text."""
    from amoe.model.make import default_model_path, make_model

    path = make_model("tiny", tmp_path / "tiny", seed=0) if model == "tiny" else default_model_path()
    tok, hf = Tokenizer.from_dir(path), _hf_tokenizer(path)
    for text in TEXTS:
        assert tok.encode(text) == [1] + tok.backend.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.encode_chat(MESSAGES).count(1) == 1  # its Mistral template writes <s>; no second one


def test_config_disagreeing_with_tokenizer_json_is_logged(style_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="amoe.tokenizer"):
        Tokenizer.from_dir(style_dir("config-disagrees"))
    assert "add_bos_token=false but tokenizer.json's post-processor adds it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="amoe.tokenizer"):
        Tokenizer.from_dir(style_dir("no-post-processor"))
    assert "add_bos_token=true but tokenizer.json's post-processor does not add it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="amoe.tokenizer"):
        for name in ("llama-bos-post-processor", "add-bos-token-false", "bos-and-eos", "qwen-no-bos"):
            Tokenizer.from_dir(style_dir(name))
    assert caplog.text == ""


# ---- served text


async def _serve(path: Path, requests: list[tuple[str, dict]]) -> list[dict]:
    """POST each (route, body) to the API app over a local backend on `path`, as `amoe serve --parallel local`."""
    engine_config = EngineConfig()
    tokenizer = Tokenizer.from_dir(path)
    backend = LocalBackend(lambda: LocalEngine(path, engine_config), engine_config.block_size)
    await backend.start()
    try:
        model = ModelInfo("styled", backend.engine.max_model_len, backend.engine.model_config.vocab_size)
        app = create_app(backend, tokenizer, model, lambda ids: IncrementalDetokenizer(tokenizer, ids))
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://amoe"
        ) as client:
            replies = [await client.post(route, json={"model": "styled", **body}) for route, body in requests]
    finally:
        await backend.shutdown()
    for reply in replies:
        assert reply.status_code == 200, reply.text
    return [reply.json() for reply in replies]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", STYLES)
def test_served_greedy_text_equals_transformers_generate(style_dir, hf_generate, name):
    path = style_dir(name)
    hf = _hf_tokenizer(path)
    prompt_ids, chat_ids = hf(PROMPT)["input_ids"], _hf_chat_ids(hf)
    greedy = {"max_tokens": NEW_TOKENS, "temperature": 0}
    completion, chat = asyncio.run(
        _serve(
            path,
            [
                ("/v1/completions", {"prompt": PROMPT, **greedy}),
                ("/v1/chat/completions", {"messages": MESSAGES, **greedy}),
            ],
        )
    )
    assert completion["usage"]["prompt_tokens"] == len(prompt_ids)
    assert completion["choices"][0]["text"] == hf.decode(hf_generate(prompt_ids), skip_special_tokens=True)
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    expected = hf.decode(hf_generate(chat_ids), skip_special_tokens=True)
    assert chat["choices"][0]["message"]["content"] == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["llama-bos-post-processor", "no-post-processor", "qwen-no-bos"])
def test_llm_and_cli_generate_equal_transformers(style_dir, hf_generate, monkeypatch, capsys, name):
    path = style_dir(name)
    hf = _hf_tokenizer(path)
    prompt_ids, chat_ids = hf(PROMPT)["input_ids"], _hf_chat_ids(hf, MESSAGES[:1])
    out = LLM(path).generate(PROMPT, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == hf_generate(prompt_ids)

    monkeypatch.setattr(cli, "setup_logging", lambda verbose: None)  # leave this process's logging alone
    args = ["generate", "--model", str(path), "--prompt", MESSAGES[0]["content"], "--chat"]
    assert cli.main([*args, "--max-tokens", str(NEW_TOKENS), "--temperature", "0"]) == 0
    assert capsys.readouterr().out == hf.decode(hf_generate(chat_ids), skip_special_tokens=True) + "\n"
