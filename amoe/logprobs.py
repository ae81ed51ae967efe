"""Log-probabilities as they leave the head: a few numbers per position, never a vocabulary row.

Plain data (no torch), so the coordinator, the wire (amoe/wire.py carries it in TokenOut) and the engines share
one type; amoe/model/logprobs.py computes it from the head's logits.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

# The most top log-probabilities a request may ask per position: vLLM's default --max-logprobs and OpenAI's
# top_logprobs bound. Each costs a top-k over the vocabulary on the attention rank and 12 bytes on the wire.
MAX_LOGPROBS = 20

_TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
_Rank = Annotated[int, Meta(ge=1, le=2**31 - 1)]


class Logprobs(msgspec.Struct, array_like=True, frozen=True):
    """Consecutive positions of one request: the token at each, its log-probability and rank (1 = the most
    likely), and the k most likely tokens there with theirs (k as the request asked, most likely first).

    Log-probabilities are float32 log-softmax values of the head's raw logits (vLLM's default "raw_logprobs"),
    widened to Python floats; -inf stays -inf here (the API clamps it to -9999.0 as OpenAI and vLLM do)."""

    token_ids: list[_TokenId]
    logprobs: list[float]
    ranks: list[_Rank]
    top_ids: list[list[_TokenId]]
    top_logprobs: list[list[float]]

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not len(self.logprobs) == len(self.ranks) == len(self.top_ids) == len(self.top_logprobs) == n:
            raise ValueError("Logprobs columns differ in length")
        if any(len(i) != len(v) or len(i) > MAX_LOGPROBS for i, v in zip(self.top_ids, self.top_logprobs)):
            raise ValueError(f"top ids and log-probabilities differ in length or exceed {MAX_LOGPROBS}")

    def __len__(self) -> int:
        return len(self.token_ids)

    def __add__(self, other: Logprobs) -> Logprobs:
        return Logprobs(
            self.token_ids + other.token_ids,
            self.logprobs + other.logprobs,
            self.ranks + other.ranks,
            self.top_ids + other.top_ids,
            self.top_logprobs + other.top_logprobs,
        )

    @classmethod
    def empty(cls) -> Logprobs:
        return cls([], [], [], [], [])

    def top(self, i: int) -> list[tuple[int, float]]:
        """Position i's most likely tokens, most likely first, as (token id, log-probability)."""
        return list(zip(self.top_ids[i], self.top_logprobs[i]))


def concat(parts: list[Logprobs]) -> Logprobs:
    """Consecutive positions of one request, in order, as one Logprobs."""
    if len(parts) == 1:
        return parts[0]
    columns: tuple[list, ...] = ([], [], [], [], [])
    for part in parts:  # linear in the positions (a + b per part would copy all before it each time)
        for column, values in zip(
            columns, (part.token_ids, part.logprobs, part.ranks, part.top_ids, part.top_logprobs)
        ):
            column += values
    return Logprobs(*columns)
