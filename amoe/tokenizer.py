"""Tokenizers with the `tokenizers` library only (the coordinator needs no transformers): load, train, chat, stream."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from amoe.errors import ConfigError, ModelLoadError, RequestError

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # where newer transformers versions save the chat template

# Mixtral's special tokens and ids.
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)
# The special tokens transformers names and hands to chat templates (bos_token etc.).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # the specials plus the byte-level alphabet
# How many prompt tokens the incremental detokenizer decodes as context, as vLLM does.
_DETOK_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode and chat template, for byte-level and sentencepiece-style BPE.

    Prompts encode exactly as transformers 5 encodes them for the same checkpoint: `encode` is `tokenizer(text)`
    (tokenizer.json's post-processor adds the special tokens) and `encode_chat` is
    `apply_chat_template(messages, tokenize=True)` (the template writes them).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        model_max_length: int | None = None,
        source: str = "<memory>",
        tool_chat_template: str | None = None,
    ) -> None:
        # transformers switches off tokenizer.json's truncation and padding for a plain call: a file saved for
        # training would otherwise cut long prompts short or pad them.
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})  # "bos_token" etc., as the chat template sees them
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.source = source
        self.bos_token_id = self._special_id(self.bos_token)
        self.eos_token_id = self._special_id(self.eos_token)
        self.byte_token_ids = _byte_fallback_ids(backend)
        self._template = _compile_template(chat_template, source) if chat_template else None
        # A checkpoint's named "tool_use" template, which transformers renders instead when tools are given.
        self._tool_template = _compile_template(tool_chat_template, source) if tool_chat_template else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and, if present, `tokenizer_config.json` from a checkpoint directory."""
        path = Path(path)
        backend = _load_backend(path / TOKENIZER_FILE)
        config = _load_config(path / CONFIG_FILE)
        tokenizer = cls(
            backend,
            special_tokens=_named_special_tokens(config),
            chat_template=_chat_template(config, path),
            model_max_length=_int_or_none(config.get("model_max_length")),
            source=str(path),
            tool_chat_template=_chat_template(config, path, "tool_use"),
        )
        tokenizer._warn_if_config_disagrees(config)
        return tokenizer

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as transformers' `tokenizer(text, add_special_tokens=...)` gives them.

        The special tokens added are tokenizer.json's post-processor's (a BOS for Llama/Mistral-style tokenizers,
        none for Qwen-style ones or a file without a post-processor); special tokens written in the text are
        recognized either way.
        """
        # encode_batch releases the GIL while it works (encode does not): a server tokenizing a huge prompt on a
        # worker thread must not freeze its event loop. One input gives exactly encode's ids.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat, as transformers' `apply_chat_template(..., tokenize=True)` gives them."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        # The template writes every special token it wants (its own BOS too): the post-processor adds none.
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: Iterable[int]) -> list[str]:
        """Each id's vocabulary piece, as transformers' `convert_ids_to_tokens` gives it (vLLM's token_strs)."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` ({"role", "content"} dicts, an assistant's "tool_calls", a tool result's
        "tool_call_id") and `tools` (JSON schemas, as sent) with the checkpoint's own chat template, as
        transformers' apply_chat_template does: its "tool_use" template when tools are given and it has one, keys
        whose value is None dropped from each message, `tools` and `documents` always defined."""
        template = self._tool_template if tools is not None and self._tool_template else self._template
        if template is None:
            raise RequestError(f"{self.source}: the tokenizer has no chat_template")
        chat = [{key: value for key, value in m.items() if value is not None} for m in messages]
        try:
            # As in transformers: the config's named special tokens, which the caller's arguments override.
            context = {**self.special_tokens, **kwargs}
            return template.render(
                context,
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as e:  # raise_exception() in the template: the conversation is invalid
            raise RequestError(f"chat template: {e}") from e

    def _special_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"{self.source}: special token {token!r} is not in the vocabulary")
        return token_id

    def _warn_if_config_disagrees(self, config: dict[str, Any]) -> None:
        """transformers 5 ignores add_bos_token / add_eos_token once there is a tokenizer.json; say so if they differ."""
        leading, trailing = _added_special_ids(self.backend)
        for key, token_id, ids in (
            ("add_bos_token", self.bos_token_id, leading),
            ("add_eos_token", self.eos_token_id, trailing),
        ):
            wanted = config.get(key)
            if isinstance(wanted, bool) and token_id is not None and wanted != (token_id in ids):
                logger.warning(
                    "[tokenizer] %s: tokenizer_config.json has %s=%s but tokenizer.json's post-processor %s it; "
                    "following tokenizer.json, as transformers 5 does",
                    self.source,
                    key,
                    str(wanted).lower(),
                    "does not add" if wanted else "adds",
                )


class IncrementalDetokenizer:
    """Turns token ids, fed one at a time, into text deltas; holds back an incomplete UTF-8 character.

    Like vLLM, each step decodes a short window of ids twice (before and after the new id) and emits the
    difference, so sentencepiece's leading-space handling and multi-token characters come out as in a full
    decode. The window only moves on once its text ends in a complete character, and not inside a run of
    byte-fallback tokens: such a run decodes as a whole, and a later invalid byte turns all of it into U+FFFD.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.text = ""  # everything emitted so far
        # The prompt's last few tokens give the first generated token its context (e.g. a leading space).
        self._prefix_offset = max(len(self.ids) - _DETOK_CONTEXT, 0)
        self._read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Feed one id; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        if token_id in self.tokenizer.byte_token_ids:
            return ""  # wait for the end of the byte run
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still waits for its remaining bytes
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of the stream: return held-back text, incomplete characters as U+FFFD."""
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def _window_texts(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        window = self.ids[self._prefix_offset :]
        read = self._read_offset - self._prefix_offset
        return decode(window[:read], self.skip_special_tokens), decode(window, self.skip_special_tokens)

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta


def write_tokenizer(
    out_dir: str | Path, vocab_size: int, model_max_length: int = 2048, corpus: Sequence[str] | None = None
) -> int:
    """Train a byte-level BPE on `corpus` (lines; default: the embedded text); write tokenizer.json and
    tokenizer_config.json.

    Deterministic: the same arguments give byte-identical files. Returns the vocabulary size, which is at most
    `vocab_size` (less if the corpus runs out of merges).
    """
    if vocab_size < _MIN_VOCAB:
        raise ConfigError(f"a byte-level tokenizer needs vocab_size >= {_MIN_VOCAB}; got {vocab_size}")
    lines = _corpus().splitlines(keepends=True) if corpus is None else corpus
    backend = _train_byte_level_bpe(vocab_size, lines)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / TOKENIZER_FILE).write_text(backend.to_str(pretty=True) + "\n", encoding="utf-8")
    config = _tokenizer_config(model_max_length)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    logger.debug("wrote a %d-token byte-level BPE tokenizer to %s", backend.get_vocab_size(), out)
    return backend.get_vocab_size()


def _train_byte_level_bpe(vocab_size: int, lines: Sequence[str]) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),  # first, so they get ids 0, 1, 2 as in Mixtral
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no <unk> ever
        show_progress=False,
    )
    # The trainer breaks ties in pair counts by the pair itself, so merges do not depend on thread count.
    backend.train_from_iterator(lines, trainer)
    # As in Mixtral's tokenizer.json: the post-processor starts every encoded prompt with <s>.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, 1)]
    )
    return backend


def _tokenizer_config(model_max_length: int) -> dict[str, Any]:
    return {
        # The generic fast class loads tokenizer.json as it is (the Llama class would rebuild a sentencepiece one).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # transformers would otherwise rewrite " ." as "."
        "model_max_length": model_max_length,
        "chat_template": _package_text("chat_template.jinja"),
    }


def _corpus() -> str:
    return _package_text("corpus.txt")


def _package_text(name: str) -> str:
    return (
        resources.files("amoe").joinpath("model").joinpath("data").joinpath(name).read_text(encoding="utf-8")
    )


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise ModelLoadError(f"{path}: tokenizer file not found")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for any parse error
        raise ModelLoadError(f"{path}: not a valid tokenizer ({_first_line(e)})") from e


def _load_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}  # optional: a bare tokenizer.json still works, without a chat template
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read tokenizer config ({_first_line(e)})") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return config


def _chat_template(config: dict[str, Any], path: Path, name: str = "default") -> str | None:
    """The checkpoint's chat template of that name (a single template is the default one), as transformers
    loads it."""
    template_file = (
        path / TEMPLATE_FILE if name == "default" else path / "additional_chat_templates" / f"{name}.jinja"
    )
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get(name)
    elif name != "default":
        return None
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{path / CONFIG_FILE}: chat_template must be a string")
    return template


def _compile_template(source: str, where: str) -> jinja2.Template:
    """Compile a chat template in the same sandbox, with the same helpers, as transformers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"{where}: chat_template does not compile (line {e.lineno}: {e.message})") from e


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _named_special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The config's named special tokens; like transformers, no defaults (a bare tokenizer.json has none)."""
    tokens = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    return {name: token for name, token in tokens.items() if token is not None}


def _added_special_ids(backend: tokenizers.Tokenizer) -> tuple[list[int], list[int]]:
    """The special token ids the post-processor puts before and after a text."""
    try:
        encoding = backend.encode("a", add_special_tokens=True)
    except Exception:  # a word-level vocabulary without "a" cannot tell; this only feeds a warning
        return [], []
    mask, ids = encoding.special_tokens_mask, encoding.ids
    first = mask.index(0) if 0 in mask else len(ids)
    last = len(mask) - mask[::-1].index(0) if 0 in mask else len(ids)
    return ids[:first], ids[last:]


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def byte_tokens(backend: tokenizers.Tokenizer) -> dict[int, int]:
    """Id → byte of each of sentencepiece's <0x00>..<0xFF> tokens the vocabulary holds."""
    ids = {byte: backend.token_to_id(f"<0x{byte:02X}>") for byte in range(256)}
    return {token_id: byte for byte, token_id in ids.items() if token_id is not None}


def _byte_fallback_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
    """Ids of sentencepiece's <0x00>..<0xFF> tokens, if the model falls back to bytes."""
    if not getattr(backend.model, "byte_fallback", False):
        return frozenset()
    return frozenset(byte_tokens(backend))


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
