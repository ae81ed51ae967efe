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
    # Log-probabilities (vLLM's names): None asks for none; k >= 0 asks for each sampled (or prompt) token's own
    # and the k most likely tokens' at its position. Prompt log-probabilities are reported once, with the first
    # token.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept a single string or lists from JSON / vLLM-style callers; store tuples (frozen, hashable).
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
