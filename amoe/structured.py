"""Structured output with llguidance (torch-free: the coordinator compiles and checks grammars too): request formats → one grammar; a grammar's state per sequence.

Why llguidance (bench/grammar_engines.py, docs/sampling.md): on a 128k vocabulary its mask costs
~40 us per token against xgrammar's ~170 us and outlines-core's ~1.8 ms, a schema compiles in ~1 ms (xgrammar
~80 ms, outlines-core ~1.4 s), and its wheel has no dependencies (xgrammar's pulls torch, triton and
transformers).

The coordinator compiles a request's format into a grammar string and checks it against the served tokenizer (a
bad schema is the client's 400); the string travels with the request to the attention rank, which keeps one
matcher per sequence beside its sampler: the mask is computed where the logits are, and no round trip per token
leaves the rank.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from amoe.errors import RequestError, UnsupportedTokenizerError
from amoe.token_bytes import ByteVocabulary

logger = logging.getLogger(__name__)

# What a grammar may hold, so one request cannot make a rank build a huge automaton.
_MAX_CHOICES = 1024


def compile_grammar(
    *,
    json_schema: Any = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
    param: str = "structured_outputs",
) -> str:
    """Exactly one format → an llguidance grammar (a JSON string); RequestError naming `param` if it is bad."""
    import llguidance

    given = [
        k
        for k, v in (
            ("json", json_schema), ("json_object", json_object or None), ("regex", regex), ("choice", choice),
            ("grammar", grammar),
        )
        if v is not None
    ]  # fmt: skip
    if len(given) != 1:
        raise RequestError(f"exactly one structured output format is allowed, got {given or 'none'}", param)
    try:
        if json_schema is not None:
            schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
            if not isinstance(schema, (dict, bool)):
                raise RequestError("a JSON schema must be an object", param)
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
        if json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(_string(regex, param))
        if choice is not None:
            if not isinstance(choice, list) or not 0 < len(choice) <= _MAX_CHOICES:
                raise RequestError(f"a choice must be a list of 1 to {_MAX_CHOICES} strings", param)
            alternatives = " | ".join(json.dumps(_string(c, param)) for c in choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        # vLLM's guided_grammar is GBNF (`root ::= ...`, what xgrammar takes) or Lark: both become Lark here.
        from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

        try:
            lark = any_to_lark(_string(grammar, param))
        except GbnfToLarkError as exc:
            raise RequestError(f"invalid grammar: {exc}", param) from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as exc:  # llguidance's own word on a malformed schema
        raise RequestError(f"invalid structured output format: {exc}", param) from None


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise RequestError("a regex, choice or grammar must be a non-empty string", param)
    return value


class Grammars:
    """The served tokenizer as llguidance sees it, built on first use (a second or so on a large vocabulary) and
    shared by every sequence of the process; makes and checks matchers."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer = None
        self._unavailable: str | None = None  # why this tokenizer serves no structured output, once known
        self._lock = threading.Lock()  # control threads check grammars while the loop thread makes matchers

    @classmethod
    def for_model(
        cls, model_dir: str | Path | None, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> Grammars:
        """The checkpoint's tokenizer.json (a model without one, or an emulated one without a checkpoint, serves
        no structured output)."""
        path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
        text = path.read_text(encoding="utf-8") if path is not None and path.exists() else None
        return cls(text, vocab_size, eos_token_ids)

    def _llg_tokenizer(self, param: str):
        """llguidance's tokenizer; RequestError naming `param` if this model's tokenizer cannot serve grammars."""
        with self._lock:
            if self._tokenizer is None and self._unavailable is None:
                try:
                    self._tokenizer = _build_llg_tokenizer(self._json, self.vocab_size, self._eos)
                except UnsupportedTokenizerError as exc:
                    self._unavailable = str(exc)
                    logger.warning("[structured] this model serves no structured output: %s", exc)
            if self._unavailable is not None:
                raise RequestError(
                    f"structured output is unavailable for this model: {self._unavailable}", param
                )
            return self._tokenizer

    def check(self, grammar: str, param: str = "structured_outputs") -> None:
        """RequestError naming `param` unless the grammar compiles for this tokenizer."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self._llg_tokenizer(param))
        if error and not error.startswith("WARNING"):
            raise RequestError(f"invalid structured output format: {_first_line(error)}", param)

    def matcher(self, grammar: str) -> GrammarState:
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer("structured_outputs"), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(
                f"invalid structured output format: {matcher.get_error()}", "structured_outputs"
            )
        return GrammarState(matcher, self.vocab_size)


def _build_llg_tokenizer(tokenizer_json: str | None, vocab_size: int, eos: list[int]):
    """llguidance's tokenizer from each token's bytes as the decoder writes them (amoe.token_bytes), for every
    tokenizer shape: llguidance's own tokenizer.json reader knows ByteLevel and ByteFallback decoders only."""
    import llguidance

    if tokenizer_json is None:
        raise UnsupportedTokenizerError("it has no tokenizer.json")
    vocabulary = ByteVocabulary(tokenizer_json, vocab_size)
    try:
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_LLGuidanceVocabulary(vocabulary, eos)), eos_token=eos or None
        )
    except ValueError as exc:  # llguidance's word on a table it cannot use (an eos id outside it, ...)
        raise UnsupportedTokenizerError(f"llguidance refuses its tokenizer ({exc})") from None


class _LLGuidanceVocabulary:
    """What llguidance.TokenizerWrapper reads of a tokenizer: the token bytes, special ids, eos and an encoder."""

    def __init__(self, vocabulary: ByteVocabulary, eos: list[int]) -> None:
        self.tokens = vocabulary.tokens
        self.special_token_ids = vocabulary.special_ids
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None  # llguidance keeps it but never reads it
        self._vocabulary = vocabulary

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("the encoder takes text")  # TokenizerWrapper then passes text, never bytes
        return self._vocabulary.encode(text)


class GrammarState:
    """One sequence's position in its grammar: the tokens it may sample next, and whether it is complete."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._dead_end = False  # reported once that no token continues the grammar

    def allowed(self) -> np.ndarray:
        """[V] bool: the tokens that keep the output inside the grammar."""
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)  # little-endian int32 words
        if not self._dead_end and self._matcher.is_error():
            # A grammar asking for text no token writes (a character outside a vocabulary without byte
            # fallback): llguidance allows only the end from here, as in vLLM; say why the output stops short.
            self._dead_end = True
            logger.warning(
                "[structured] the output ends short of its grammar: %s",
                _first_line(self._matcher.get_error()),
            )
        return np.unpackbits(words, bitorder="little")[: self._vocab_size].view(bool)

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"token {token} left the grammar: {self._matcher.get_error()}")

    @property
    def is_done(self) -> bool:
        """The output is complete: nothing but its end may follow (the sequence stops here, as in vLLM)."""
        return self._matcher.is_stopped()

    def fork(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy(), self._vocab_size)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
