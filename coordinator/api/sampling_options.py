"""The sampling options of an OpenAI / vLLM request beyond the core set, as SamplingParams fields: n and best_of,
the penalties, min_p, min_tokens, logit_bias, allowed_token_ids, bad_words, the text options and structured
output (compiled here, against the served tokenizer, so a bad schema is the client's 400 and never reaches a
runtime)."""

from __future__ import annotations

from typing import Any

from amoe.errors import RequestError
from amoe.structured import compile_grammar
from coordinator.api.protocol import ChatCompletionRequest, CompletionRequest

_PASSED_ON = (
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
    "include_stop_str_in_output", "skip_special_tokens",
)  # fmt: skip
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def sampling_options(
    req: CompletionRequest | ChatCompletionRequest, tokenizer: Any, vocab_size: int, grammars: Any
) -> dict[str, Any]:
    """SamplingParams keyword arguments; RequestError naming the parameter at fault."""
    options = {name: getattr(req, name) for name in _PASSED_ON if getattr(req, name) is not None}
    if req.stream and req.best_of is not None and req.best_of > (req.n or 1):
        raise RequestError("best_of > n cannot stream: the best are known only at the end", "best_of")
    if req.logit_bias:
        options["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    if req.allowed_token_ids is not None:
        _check_ids(req.allowed_token_ids, vocab_size, "allowed_token_ids")
        options["allowed_token_ids"] = req.allowed_token_ids
    if req.bad_words:
        options["bad_words_token_ids"] = _bad_words(req.bad_words, tokenizer)
    grammar, param = _grammar(req)
    if grammar is not None:
        if grammars is None:
            raise RequestError("structured output is unavailable for this model", param)
        grammars.check(grammar, param)
        options["grammar"] = grammar
    return options


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        _check_ids([token], vocab_size, "logit_bias")
        out[token] = value
    return out


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"'{param}' holds token id {bad}, outside the vocabulary [0, {vocab_size})", param)


def _bad_words(words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each word's tokens as it would appear first in the text and after a space, as vLLM tokenizes bad_words
    (SamplingParams.update_from_tokenizer): the spaced form only when it differs and has as many tokens."""
    out: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise RequestError("bad_words must not be empty or blank", "bad_words")
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def _grammar(req: CompletionRequest | ChatCompletionRequest) -> tuple[str | None, str]:
    """The compiled grammar the request asks for (None for none) and the parameter that asked."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
        if schema is None:
            raise RequestError(
                "response_format json_schema needs 'json_schema': {'schema': {...}}", "response_format"
            )
        asked.append(("response_format", {"json_schema": schema}))
    for name, key in zip(_GUIDED, ("json_schema", "regex", "choice", "grammar")):
        value = getattr(req, name)
        if value is not None:
            asked.append((name, {key: value}))
    so = req.structured_outputs
    if so is not None:
        given = {
            "json_schema": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
            "json_object": so.json_object or None,
        }  # fmt: skip
        asked.append(("structured_outputs", {k: v for k, v in given.items() if v is not None}))
    if not asked:
        return None, ""
    if len(asked) > 1:
        names = [name for name, _ in asked]
        raise RequestError(f"one structured output format per request, got {', '.join(names)}", names[1])
    param, spec = asked[0]
    return compile_grammar(**spec, param=param), param
