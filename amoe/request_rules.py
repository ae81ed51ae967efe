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
