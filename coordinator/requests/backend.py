"""The seam between the API layer and whatever runs the model: a local engine thread or distributed runtimes."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from amoe.errors import RequestError
from amoe.logprobs import Logprobs
from amoe.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenDelta:
    """Tokens a request produced since its last delta; finish_reason is set on the last one."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    index: int = 0  # which of the request's sequences (n > 1); each finishes on its own
    # Of token_ids, when the request asked (SamplingParams.logprobs) or best_of ranks its sequences by them.
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None  # prompt tokens 1.. (first delta only), when asked

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RankKV:
    """KV-cache blocks of one attention DP rank, and how many requests it may decode at once."""

    free_blocks: int
    total_blocks: int
    max_requests: int | None = None  # --cache-max-num-seqs; None: KV alone limits the rank
    serving: bool = (
        True  # False while the rank's runtime is being replaced: new requests go elsewhere if they can
    )


class Backend(abc.ABC):
    """Runs requests on one or more attention DP ranks; every method is called from the API's event loop."""

    # Set by the API layer (the load balancer's `move`): moves a running request's KV reservation off `rank`, which
    # is being replaced, to the serving rank with the most room; returns that rank, or None if none has room.
    # None: requests stay on their rank.
    rebind: Callable[[int, int], int | None] | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Bring the backend up (load weights, spawn threads or runtimes); returns when it can serve."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort in-flight requests and stop every thread or process it started; idempotent."""

    @abc.abstractmethod
    def generate(
        self, request_id: int, prompt_token_ids: list[int], sampling_params: SamplingParams, rank: int = 0
    ) -> AsyncIterator[TokenDelta]:
        """Stream a request's new tokens, of all its sequences (`TokenDelta.index`; the stream ends when every
        one has finished); closing the iterator early aborts the request and frees its KV.

        Raises amoe.errors.EngineDeadError if the backend died before or while serving the request.
        """

    @abc.abstractmethod
    def abort(self, request_id: int) -> None:
        """Stop a request and free its KV blocks; its stream, if still read, ends with finish_reason "abort".

        Unknown or finished ids are ignored: the coordinator calls it directly whenever a request ends early
        (coordinator/requests/lifetime.py), whether or not its stream was closed too.
        """

    def placement(self) -> dict[str, Any] | None:
        """The live expert map (docs/rebalancing.md) for /admin/placement; None where experts never move."""
        return None

    async def rebalance(self, replicas: list | None = None, wait: bool = False) -> dict[str, Any]:
        """Start a rebalance — to `replicas` (per block, per expert, its runtimes) or to EPLB's map for the measured
        load — and, with `wait`, return once it has ended. RequestError where experts never move."""
        raise RequestError("this deployment's experts never move: a live placement serves --parallel aep")

    def shape(self) -> dict[str, Any] | None:
        """The runtimes serving and the joins and drains so far (docs/rebalancing.md "Scaling"), for
        /admin/scale; None where runtimes never join or leave."""
        return None

    async def scale(self, expert_runtimes: Any = None, attention_runtimes: Any = None, remove: list[int] | None = None,
                    wait: bool = False) -> dict[str, Any]:  # fmt: skip
        """Add or remove runtimes while serving and, with `wait`, return once done. RequestError where runtimes
        never join or leave."""
        raise RequestError("this deployment's runtimes are fixed: runtimes join and leave --parallel aep")

    def abort_sequence(self, request_id: int, index: int) -> None:
        """Stop one sequence of a request (n > 1; a stop string ended it); the others go on. A backend that
        runs one sequence per request aborts the request."""
        self.abort(request_id)

    @abc.abstractmethod
    def health(self) -> dict[str, Any]:
        """{"status": "ok" | "dead" | ..., plus details}; cheap, never blocks."""

    @abc.abstractmethod
    def kv_usage(self) -> list[RankKV]:
        """Free/total KV blocks per attention DP rank, indexed by rank."""

    @property
    @abc.abstractmethod
    def block_size(self) -> int:
        """Tokens per KV block (the unit the load balancer reserves in)."""
