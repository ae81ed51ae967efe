"""A request's state inside an engine, and what a step reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from amoe.logprobs import Logprobs
from amoe.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # no KV yet (new, or preempted and to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Tokens so far, how many of them are in the KV cache, and the request's own sampling generator."""

    request_id: int  # unique in the engine (a request's extra sequences get ids of their own)
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    # Sequence `index` of the caller's request `client_id` (n > 1: the first is the request itself, and it
    # forks the others from its prefill, `num_forks` of them, at its first sample).
    client_id: int | None = None
    index: int = 0
    num_forks: int = 0
    seed: int | None = None  # the one the request samples with (its sequence i: seed + i)
    grammar: Any = None  # amoe.structured.GrammarState: where the output is in its grammar

    def __post_init__(self) -> None:
        if self.client_id is None:
            self.client_id = self.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def output_ids(self) -> list[int]:
        return self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def pending_token_ids(self) -> list[int]:
        """The next chunk: every token not yet in the cache (the whole prompt, or the last sampled token)."""
        cached = self.num_cached_tokens
        prompt_len = len(self.prompt_token_ids)
        if cached >= prompt_len:
            return self.output_token_ids[cached - prompt_len :]
        return self.prompt_token_ids[cached:] + self.output_token_ids


@dataclass
class EngineOutput:
    """What one step produced for one request: its new tokens, and whether and why it finished."""

    request_id: int
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    index: int = 0  # which of the request's sequences (n > 1)
    # Of new_token_ids, if the request asked (SamplingParams.logprobs) or best_of ranks its sequences by them.
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None  # of prompt tokens 1.., with its first token, if asked
