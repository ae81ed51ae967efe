"""A tokenizer as a grammar engine sees it (llguidance masks tokens by their bytes): each id's bytes as the
tokenizer's own decoder writes them, which ids are special, and an encoder that continues a text.

The bytes come from tokenizer.json's decoder, so every shape the supported families ship reads as it decodes:
byte-level BPE (Qwen, DeepSeek, OLMoE: ByteLevel maps GPT-2's printable stand-ins back to bytes), sentencepiece
BPE with byte fallback (Llama, Mistral, Mixtral: Replace "▁" by " ", ByteFallback, Fuse, Strip; `<0xNN>` is that
byte) and Metaspace (as `tokenizers` converts a sentencepiece model: "▁" is a space, and a `<0xNN>` piece is
written as it reads, because that decoder writes it so). A decoder's edits to the ends of a whole text (Strip after
Fuse, Metaspace's dropped prefix space) are left out: generated tokens follow a prompt, and the detokenizer writes
them in its context. A decoder whose output for a token depends on its neighbours (WordPiece, BPEDecoder, CTC, a
regex Replace, or none at all: tokens joined by spaces) gives no bytes per token: UnsupportedTokenizerError says
which.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import tokenizers

from amoe.errors import UnsupportedTokenizerError
from amoe.tokenizer import byte_tokens

# One decoder step on one token: (token id, its bytes so far) → its bytes after the step.
Step = Callable[[int, bytes], bytes]


class ByteVocabulary:
    """Each id's bytes (special tokens: their text; ids the tokenizer lacks: none) and a continuing encoder."""

    def __init__(self, tokenizer_json: str, vocab_size: int) -> None:
        """`vocab_size`: the model's ids, which may outnumber the tokenizer's (the rest have no bytes)."""
        backend = _load(tokenizer_json)
        # The canonical layout, whatever version of tokenizers wrote the file.
        spec = json.loads(backend.to_str())
        steps = _decoder_steps(spec.get("decoder"), byte_tokens(backend))
        added = backend.get_added_tokens_decoder()
        self.special_ids = _special_ids(added)
        size = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        self.tokens: list[bytes] = [b""] * size  # [size]
        for piece, token_id in backend.get_vocab(with_added_tokens=True).items():
            self.tokens[token_id] = _apply(steps, token_id, piece.encode())
        for token_id in self.special_ids:
            self.tokens[token_id] = added[token_id].content.encode()
        self._spec = spec
        self._encoder: tokenizers.Tokenizer | None = None  # built on first use: only forced bytes need it
        self._by_bytes: dict[bytes, int] | None = None  # for the greedy fallback, built on its first use
        self._longest = 0

    def encode(self, text: str) -> list[int]:
        """Ids whose bytes write `text` as it follows other text (no special tokens, no prefix space): the
        tokenizer's own, or where those write something else (a <0xNN> piece a Metaspace decoder writes as read,
        an <unk>) the longest tokens that do, leaving out bytes no token writes, as llguidance's greedy tokenizer."""
        if self._encoder is None:
            self._encoder = _continuing_encoder(self._spec)
        ids = self._encoder.encode(text, add_special_tokens=False).ids
        data = text.encode()
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        if self._by_bytes is None:
            special = set(self.special_ids)
            self._by_bytes = {}
            for token_id, token in enumerate(self.tokens):
                if token and token_id not in special:
                    self._by_bytes.setdefault(token, token_id)
            self._longest = max(map(len, self._by_bytes), default=0)
        ids, start = [], 0
        while start < len(data):
            for end in range(min(len(data), start + self._longest), start, -1):
                token_id = self._by_bytes.get(data[start:end])
                if token_id is not None:
                    ids.append(token_id)
                    start = end
                    break
            else:
                start += 1  # no token writes this byte
        return ids


def _load(tokenizer_json: str) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # the Rust side raises a bare Exception for any parse error
        raise UnsupportedTokenizerError(
            f"tokenizer.json does not load ({str(exc).splitlines()[0]})"
        ) from None


def _special_ids(added: dict[int, tokenizers.AddedToken]) -> list[int]:
    """As llguidance reads a tokenizer.json: an added token marked special, or written <...>, is a control token
    that a grammar names explicitly, never text a string or regex may spell."""
    return sorted(
        i for i, t in added.items() if t.special or (t.content.startswith("<") and t.content.endswith(">"))
    )


def _apply(steps: list[Step], token_id: int, value: bytes) -> bytes:
    for step in steps:
        value = step(token_id, value)
    return value


def _decoder_steps(decoder: dict[str, Any] | None, byte_of: dict[int, int]) -> list[Step]:
    """The per-token steps of a decoder (a Sequence's in order); UnsupportedTokenizerError for one that has none."""
    if decoder is None:
        raise UnsupportedTokenizerError(
            "tokenizer.json has no decoder (tokens decode joined by spaces, so none has bytes of its own)"
        )
    steps: list[Step] = []
    fused = False
    for part in _flatten(decoder):
        kind = part.get("type")
        if kind == "Fuse":
            fused = True  # one text from here on: a later Strip edits only its ends
        elif kind == "Strip":
            if not fused:
                steps.append(_strip(part))
        elif kind == "ByteLevel":
            steps.append(_byte_level)
        elif kind == "ByteFallback":
            steps.append(lambda token_id, value: bytes([byte_of[token_id]]) if token_id in byte_of else value)
        elif kind == "Metaspace":
            steps.append(_replace(part.get("replacement", "▁"), " "))
        elif kind == "Replace":
            pattern = part.get("pattern") or {}
            if "String" not in pattern:
                raise UnsupportedTokenizerError(
                    "its decoder replaces by a regex, which no byte table can follow"
                )
            steps.append(_replace(pattern["String"], part.get("content", "")))
        else:
            raise UnsupportedTokenizerError(
                f"its {kind} decoder writes a token according to its neighbours, so no token has bytes of its own"
            )
    return steps


def _flatten(decoder: dict[str, Any]) -> list[dict[str, Any]]:
    if decoder.get("type") == "Sequence":
        return [part for inner in decoder.get("decoders", []) for part in _flatten(inner)]
    return [decoder]


def _replace(pattern: str, content: str) -> Step:
    old, new = pattern.encode(), content.encode()
    return lambda token_id, value: value.replace(old, new)


def _strip(part: dict[str, Any]) -> Step:
    """Each token loses up to `start` leading and `stop` trailing `content` characters (a Strip before any Fuse)."""
    char, start, stop = part.get("content", " ").encode(), part.get("start", 0), part.get("stop", 0)

    def step(token_id: int, value: bytes) -> bytes:
        for _ in range(start):
            if not value.startswith(char):
                break
            value = value[len(char) :]
        for _ in range(stop):
            if not value.endswith(char):
                break
            value = value[: -len(char)]
        return value

    return step


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's table: a printable byte stands for itself, the others for 256, 257, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    stand_ins = iter(range(256, 512))
    return {chr(byte) if byte in printable else chr(next(stand_ins)): byte for byte in range(256)}


_BYTE_OF_CHAR = _byte_level_alphabet()
# str.translate to the bytes as latin-1 characters; a character outside the alphabet becomes one latin-1 cannot
# encode, so that the whole token falls back to its UTF-8 text.
_TO_LATIN1 = {ord(char): byte for char, byte in _BYTE_OF_CHAR.items()} | {
    code: 0xFFFF for code in range(256) if chr(code) not in _BYTE_OF_CHAR
}


def _byte_level(token_id: int, value: bytes) -> bytes:
    """GPT-2's stand-in characters back to their bytes; a token with any other character is its own UTF-8 text,
    as the ByteLevel decoder writes it."""
    try:
        return value.decode().translate(_TO_LATIN1).encode("latin-1")
    except UnicodeError:
        return value


def _continuing_encoder(spec: dict[str, Any]) -> tokenizers.Tokenizer:
    """The tokenizer without what starts a text: sentencepiece's prefix "▁" (a Prepend normalizer, Metaspace's
    prepend scheme) and ByteLevel's prefix space, as llguidance adjusts a tokenizer.json it loads."""
    spec = {**spec, "post_processor": None, "truncation": None, "padding": None}
    spec["normalizer"] = _without_prepend(spec.get("normalizer"))
    spec["pre_tokenizer"] = _without_prefix_space(spec.get("pre_tokenizer"))
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def _without_prepend(normalizer: dict[str, Any] | None) -> dict[str, Any] | None:
    if normalizer is None or normalizer.get("type") == "Prepend":
        return None
    if normalizer.get("type") == "Sequence":
        kept = [n for n in map(_without_prepend, normalizer.get("normalizers", [])) if n is not None]
        return {**normalizer, "normalizers": kept} if kept else None
    return normalizer


def _without_prefix_space(pre_tokenizer: dict[str, Any] | None) -> dict[str, Any] | None:
    kind = pre_tokenizer.get("type") if pre_tokenizer is not None else None
    if kind == "Metaspace":
        return {**pre_tokenizer, "prepend_scheme": "never"}
    if kind == "ByteLevel":
        return {**pre_tokenizer, "add_prefix_space": False}
    if kind == "Sequence":
        return {
            **pre_tokenizer,
            "pretokenizers": [_without_prefix_space(p) for p in pre_tokenizer["pretokenizers"]],
        }
    return pre_tokenizer
