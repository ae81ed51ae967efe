"""What every engine decides the same way about a request: whether its prompt is valid, when it stops, and the
seed it samples with. Shared by the single-process engine, the attention runtimes and the coordinator (so it stays
free of torch)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from amoe.errors import RequestError
from amoe.sampling_params import SamplingParams

# Seeds drawn for sampled requests that bring none fit in 62 bits, as torch's manual_seed accepts any of them.
_SEED_BITS = 62


def check_prompt(prompt: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Raise RequestError unless the prompt is a non-empty list of in-vocabulary ids that fits the model length."""
    if not prompt:
        raise RequestError("the prompt is empty")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(prompt) > max_model_len:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens; the limit is {max_model_len} (model length and KV cache size)"
        )


def stop_reason(
    params: SamplingParams,
    token: int,
    *,
    num_output: int,
    num_tokens: int,
    max_model_len: int,
    eos_token_ids: Sequence[int],
) -> str | None:
    """Why a request ends after sampling `token` (its `num_output`-th output, `num_tokens` in all), or None.

    Token-level rules only: eos (unless ignore_eos), stop_token_ids, max_tokens and the model length. Stop
    strings need detokenized text and are the business of whoever holds the tokenizer.
    """
    if (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids:
        return "stop"
    if num_output >= params.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None


def sequence_seed(seed: int | None, index: int) -> int | None:
    """The seed of sequence `index` of a request (n > 1): seed + index, as vLLM's ParentRequest derives its
    children's, wrapped into the int64 range."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


class SeedSource:
    """Seeds for sampled requests that bring none, drawn from one seeded stream: the same arrivals get the same
    seeds, so a deployment's sampled output is reproducible run to run. Greedy and seeded requests keep theirs."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def resolve(self, params: SamplingParams) -> int | None:
        """The seed the request samples with (None for greedy ones, which never draw)."""
        if params.is_greedy or params.seed is not None:
            return params.seed
        return self._rng.getrandbits(_SEED_BITS)


class StopMatcher:
    """Finds the first stop string in text fed piece by piece, in time linear in the text: one Knuth-Morris-Pratt
    automaton per stop string, advanced once per new character (never rescanning what came before).

    `pending` is how many characters at the end of the text so far could still grow into a stop string: a stream
    holds them back until it knows.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self._stops]
        self._state = [0] * len(self._stops)  # per stop: its longest prefix that ends the text so far
        self._seen = 0  # characters fed
        self.matched: str | None = None  # the stop string found

    @property
    def pending(self) -> int:
        return max(self._state, default=0)

    def feed(self, text: str) -> int | None:
        """Add text; where (in all the text fed so far) the first stop string to complete starts, or None.

        The first to complete wins; of several completing at the same character, the longest. Nothing more
        should be fed after a match.
        """
        if not self._stops:
            return None
        stops, fail, state = self._stops, self._fail, self._state
        for i, char in enumerate(text):
            match = None
            for j, stop in enumerate(stops):
                k = state[j]
                while k and stop[k] != char:
                    k = fail[j][k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    start = self._seen + i + 1 - k
                    if match is None or start < match:
                        match, self.matched = start, stop
                    k = fail[j][k - 1]
                state[j] = k
            if match is not None:
                self._seen += i + 1
                return match
        self._seen += len(text)
        return None


def _failure(pattern: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper prefix of pattern[:i + 1] that is also its
    suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail
