"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-compatible names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from amoe.errors import RequestError
from amoe.logprobs import MAX_LOGPROBS

# Ranges every engine can honour: a seed travels as an int64, counts as int32; below _SAMPLING_EPS a temperature
# is greedy (as in vLLM: dividing logits by a denormal would overflow them).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
_SAMPLING_EPS = 1e-5
MAX_STOP_STRINGS = (
    64  # the stop check is linear in the output, and proportional to the stop strings' total size
)
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 128  # sequences per request (n, best_of): OpenAI's own limit on n
MAX_LOGIT_BIAS = 1024  # entries of logit_bias / allowed_token_ids / bad_words, each
MAX_BAD_WORD_TOKENS = 64  # tokens of one bad word
MAX_GRAMMAR_CHARS = 1 << 20  # a compiled grammar (JSON schema, regex, ...) as it travels to the runtime


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling: temperature 0 is greedy; top_k -1 or 0 and top_p 1.0 switch those filters off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    # Several sequences from one prompt (one prefill): n are returned, the best n of best_of (default n) by
    # cumulative log-probability.
    n: int = 1
    best_of: int | None = None
    # Logits processors (amoe/model/logits_processors.py), vLLM's semantics and order.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # (token id, bias); a dict is accepted
    allowed_token_ids: tuple[int, ...] | None = None
    # Token-id sequences no output may end with (the API turns vLLM's bad_words strings into these).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=())
    # Output text (the coordinator's detokenizer): keep the stop string that ended it; skip special tokens.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A compiled grammar every output must follow (amoe.structured.compile_grammar), or None.
    grammar: str | None = None
    # Log-probabilities (vLLM's names): None asks for none; k >= 0 asks for each sampled (or prompt) token's own
    # and the k most likely tokens' at its position. Prompt log-probabilities are reported once, with the first
    # token. best_of ranks its sequences by the sum of the same sampled-token log-probabilities.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept a single string or lists from JSON / vLLM-style callers; store tuples (frozen, hashable).
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias
        if isinstance(bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))
        elif bias is None or isinstance(bias, (list, tuple)):
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in bias or ()))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(
            self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids or ())
        )
        self._validate()
        self._validate_processors()

    def _validate(self) -> None:
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise RequestError(
                f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}", "max_tokens"
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise RequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature"
            )
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise RequestError(
                f"top_k must be -1 or 0 (off) or in [1, {INT32_MAX}], got {self.top_k!r}", "top_k"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise RequestError(f"seed must be a 64-bit signed integer or null, got {self.seed!r}", "seed")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", "stop")
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            raise RequestError(
                f"stop strings must be non-empty and at most {MAX_STOP_STRING_CHARS} characters", "stop"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            _is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids
        ):
            raise RequestError(
                f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} integers in [0, {INT32_MAX}]",
                "stop_token_ids",
            )
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}", "ignore_eos")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RequestError(
                    f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}", name
                )

    def _validate_processors(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_N):
            raise RequestError(f"best_of must be an integer in [n, {MAX_N}] (n is {self.n}), got {self.best_of!r}",
                               "best_of")  # fmt: skip
        if self.best_of is not None and self.best_of > self.n and self.is_greedy:
            raise RequestError("best_of > n needs sampling (temperature > 0): greedy sequences are all the same",
                               "best_of")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {value!r}", name)
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2**16:
            raise RequestError(
                f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty!r}",
                "repetition_penalty",
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
                "min_tokens",
            )
        bias = self.logit_bias
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS or any(len(pair) != 2 for pair in bias):
            raise RequestError(
                f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias"
            )
        for token, value in bias:
            if not _is_int(token) or not 0 <= token <= INT32_MAX:
                raise RequestError(f"logit_bias keys must be token ids, got {token!r}", "logit_bias")
            if not _is_number(value) or not -100 <= value <= 100:
                raise RequestError(f"logit_bias values must be in [-100, 100], got {value!r}", "logit_bias")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not 0 < len(allowed) <= MAX_LOGIT_BIAS
            or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in allowed)
        ):
            raise RequestError(
                f"allowed_token_ids must be 1 to {MAX_LOGIT_BIAS} token ids", "allowed_token_ids"
            )
        words = self.bad_words_token_ids
        if len(words) > MAX_LOGIT_BIAS or not all(
            0 < len(w) <= MAX_BAD_WORD_TOKENS and all(_is_int(t) and 0 <= t <= INT32_MAX for t in w)
            for w in words
        ):
            raise RequestError(
                f"bad words must be at most {MAX_LOGIT_BIAS}, each of 1 to {MAX_BAD_WORD_TOKENS} tokens",
                "bad_words",
            )
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be a boolean, got {getattr(self, name)!r}", name)
        if self.grammar is not None and (
            not isinstance(self.grammar, str) or len(self.grammar) > MAX_GRAMMAR_CHARS
        ):
            raise RequestError(f"a grammar must be a string of at most {MAX_GRAMMAR_CHARS} characters",
                               "structured_outputs")  # fmt: skip

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def num_sequences(self) -> int:
        """Sequences generated from the prompt: best_of if given, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranks_sequences(self) -> bool:
        """best_of > n: the n returned are the best by cumulative log-probability."""
        return self.best_of is not None and self.best_of > self.n

    @property
    def num_logprobs(self) -> int | None:
        """The top log-probabilities each sampled token carries back from the head: as asked, or 0 (the token's
        own only) when best_of ranks the sequences by them; None: none."""
        if self.logprobs is None and self.ranks_sequences:
            return 0
        return self.logprobs

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor acts on this request's rows (the plain path skips them all)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.min_tokens
            or self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids or self.grammar
        )  # fmt: skip


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
