"""Log-probabilities in the API's shapes: OpenAI's completions `logprobs` (tokens, token_logprobs, top_logprobs,
text_offset) and chat `logprobs.content`, and vLLM's `prompt_logprobs`, from what the runtimes computed
(amoe.logprobs.Logprobs). Token texts are each token decoded alone with its special tokens kept, as vLLM shows
them; -inf becomes -9999.0, as OpenAI and vLLM send it (JSON has no infinity)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import lru_cache
from typing import Protocol

from amoe.logprobs import Logprobs
from coordinator.api.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)

FLOOR = -9999.0

# (token id, its log-probability or None, the most likely (id, log-probability) there or None) per position
Position = tuple[int, float | None, list[tuple[int, float]] | None]


class _Decoder(Protocol):
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...


class TokenTexts:
    """Each token's text decoded alone (special tokens kept), cached: top log-probabilities name the same few
    thousand tokens over and over."""

    def __init__(self, tokenizer: _Decoder, cache_size: int = 1 << 16) -> None:
        self._text = lru_cache(maxsize=cache_size)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        )

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)


def clamp(logprob: float) -> float:
    return max(logprob, FLOOR)


def positions(logprobs: Logprobs | None) -> Iterator[Position]:
    if logprobs is None:
        return
    for i, token in enumerate(logprobs.token_ids):
        yield token, logprobs.logprobs[i], logprobs.top(i)


def echoed(prompt: list[int], logprobs: Logprobs | None) -> Iterator[Position]:
    """The prompt's positions: its first token has nothing before it (null), the others are scored."""
    yield prompt[0], None, None
    if logprobs is None:  # not asked: every token but the first would need them
        yield from ((t, None, None) for t in prompt[1:])
    else:
        yield from positions(logprobs)


def completion_logprobs(texts: TokenTexts, at: Iterable[Position], offset: int = 0) -> CompletionLogprobs:
    """OpenAI's completions shape; `offset`: where the first token's text starts in the choice's text (a stream's
    later chunks go on from what was sent). Each position's top_logprobs holds its own token and the k most likely."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token, logprob, top in at:
        text = texts(token)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if logprob is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamp(logprob))
        entry = {text: clamp(logprob)}  # the token first, as vLLM orders them
        for top_id, top_logprob in top or ():
            entry.setdefault(texts(top_id), clamp(top_logprob))
        top_logprobs.append(entry)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )


def chat_logprobs(texts: TokenTexts, logprobs: Logprobs | None) -> ChatLogprobs:
    """OpenAI's chat shape: per output token its text, log-probability and UTF-8 bytes, and the top_logprobs
    most likely tokens there (most likely first)."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        text = texts(token_id)
        return TopLogprob(token=text, logprob=clamp(logprob), bytes=list(text.encode("utf-8", "replace")))

    content = []
    for token, logprob, tops in positions(logprobs):
        own = top(token, logprob)
        content.append(TokenLogprob(**own.model_dump(), top_logprobs=[top(t, lp) for t, lp in tops or ()]))
    return ChatLogprobs(content=content)


def prompt_logprobs(texts: TokenTexts, prompt: list[int], logprobs: Logprobs) -> PromptLogprobs:
    """vLLM's prompt_logprobs: null for the first token, then per token {token id: {logprob, rank,
    decoded_token}} for the token itself and the k most likely there (ranks 1..k)."""
    out: PromptLogprobs = [None]
    for i, token in enumerate(logprobs.token_ids):
        entry = {str(token): _prompt_entry(texts, token, logprobs.logprobs[i], logprobs.ranks[i])}
        for rank, (top_id, top_logprob) in enumerate(logprobs.top(i), start=1):
            entry.setdefault(str(top_id), _prompt_entry(texts, top_id, top_logprob, rank))
        out.append(entry)
    return out[: len(prompt)]


def _prompt_entry(texts: TokenTexts, token: int, logprob: float, rank: int) -> PromptLogprob:
    return PromptLogprob(logprob=clamp(logprob), rank=rank, decoded_token=texts(token))
