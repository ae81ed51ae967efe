"""A request's state inside an engine, and what a step reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None

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
    logprobs: Logprobs | None = None  # of new_token_ids, if the request asked (SamplingParams.logprobs)
    prompt_logprobs: Logprobs | None = None  # of prompt tokens 1.., with its first token, if asked
