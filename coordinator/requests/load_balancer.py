"""Load balancer (AMoE §3.1): a new request goes to the attention DP rank with the most free KV blocks, for life.

Admission reserves the request's worst case (prompt + max_tokens) in blocks, so a rank is never over-committed
and a running request can never be preempted for lack of KV; a rank also takes no more than its `max_requests`
(--cache-max-num-seqs, vLLM's meaning: requests decoding at once). Requests that fit nowhere yet wait in a bounded
FIFO.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from amoe.errors import RequestError
from coordinator.requests.backend import RankKV
from coordinator.requests.errors import Overloaded

logger = logging.getLogger(__name__)


@dataclass
class _Waiter:
    request_id: int
    num_blocks: int
    future: asyncio.Future


class LoadBalancer:
    """Binds requests to ranks and reserves their KV blocks; every method runs on the API's event loop."""

    def __init__(self, kv_usage: Callable[[], list[RankKV]], block_size: int, max_waiting: int) -> None:
        self._kv_usage = kv_usage
        self._block_size = block_size
        self._max_waiting = max_waiting
        self._reserved: dict[int, int] = {}  # rank -> blocks reserved by admitted requests
        self._bindings: dict[int, tuple[int, int]] = {}  # request_id -> (rank, reserved blocks)
        self._running: dict[int, int] = {}  # rank -> requests bound to it
        self._waiting: deque[_Waiter] = deque()
        self._closed = False

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._bindings)

    def running_ids(self) -> list[int]:
        return list(self._bindings)

    def close(self) -> None:
        """Shutting down: refuse new requests and fail the waiting ones (running ones are left to the caller)."""
        self._closed = True
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(Overloaded("the server is shutting down"))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def rank_of(self, request_id: int) -> int | None:
        binding = self._bindings.get(request_id)
        return None if binding is None else binding[0]

    def free_blocks(self) -> list[int]:
        """Unreserved blocks per rank.

        Counted from our own reservations, not the rank's live free count: a finished request's blocks are
        released here at once, while the rank frees them a moment later, and waiters are only woken on release.
        """
        return [kv.total_blocks - self._reserved.get(rank, 0) for rank, kv in enumerate(self._kv_usage())]

    def try_admit(self, request_id: int, num_tokens: int) -> int | None:
        """Bind and reserve on the rank with the most free blocks, or None if no rank fits (and nobody waits)."""
        if self._waiting:
            return None  # FIFO: a newcomer must not overtake a waiting request
        return self._bind(request_id, self.blocks_needed(num_tokens))

    async def admit(self, request_id: int, num_tokens: int) -> int:
        """The rank the request is bound to; waits for KV space; raises Overloaded when the queue is full."""
        if self._closed:
            raise Overloaded("the server is shutting down")
        num_blocks = self.blocks_needed(num_tokens)
        largest = max((kv.total_blocks for kv in self._kv_usage()), default=0)
        if num_blocks > largest:
            raise RequestError(
                f"the request needs {num_tokens} tokens of KV cache ({num_blocks} blocks) but the largest rank "
                f"holds {largest} blocks; lower max_tokens or shorten the prompt"
            )
        if not self._waiting:
            rank = self._bind(request_id, num_blocks)
            if rank is not None:
                return rank
        if len(self._waiting) >= self._max_waiting:
            raise Overloaded(
                f"server overloaded: {len(self._waiting)} requests are already waiting for KV cache space "
                f"(server.max_waiting={self._max_waiting}); retry later"
            )
        waiter = _Waiter(request_id, num_blocks, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        logger.debug("%s waits for %d blocks (%d waiting)", request_id, num_blocks, len(self._waiting))
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._forget_waiter(waiter)
            raise

    def release(self, request_id: int) -> None:
        """Return a finished or aborted request's reservation and admit whoever now fits; idempotent."""
        if self._unreserve(request_id) is not None:
            self._wake_waiters()

    def move(self, request_id: int, rank: int) -> int | None:
        """Move a running request's reservation off `rank` (being replaced) to the serving rank with the most free
        blocks; that rank, or None if none has room (it stays where it was)."""
        binding = self._bindings.get(request_id)
        if binding is None or binding[0] != rank:
            return None
        target = self._best_rank(binding[1], lambda r, kv: r != rank and kv.serving)
        if target is None:
            return None
        self._unreserve(request_id)
        self._reserve(request_id, target, binding[1])
        return target

    def withdraw(self, request_id: int) -> None:
        """Take a request out of the waiting queue (its admission raises CancelledError) and give back what it was
        granted meanwhile (its admission then still returns that rank, no longer reserved); idempotent."""
        for waiter in [w for w in self._waiting if w.request_id == request_id]:
            waiter.future.cancel()
            self._forget_waiter(waiter)
        self.release(request_id)

    def _bind(self, request_id: int, num_blocks: int) -> int | None:
        # A rank being replaced takes a new request only when no serving rank can.
        rank = self._best_rank(num_blocks, lambda r, kv: kv.serving)
        rank = rank if rank is not None else self._best_rank(num_blocks, lambda r, kv: True)
        if rank is not None:
            self._reserve(request_id, rank, num_blocks)
        return rank

    def _best_rank(self, num_blocks: int, allowed: Callable[[int, RankKV], bool]) -> int | None:
        """The allowed rank with the most free blocks that fits `num_blocks` and one more request."""
        ranks = self._kv_usage()
        free = [kv.total_blocks - self._reserved.get(r, 0) for r, kv in enumerate(ranks)]
        open_ranks = [
            r for r, kv in enumerate(ranks)
            if allowed(r, kv) and free[r] >= num_blocks
            and (kv.max_requests is None or self._running.get(r, 0) < kv.max_requests)
        ]  # fmt: skip
        return max(open_ranks, key=lambda r: free[r]) if open_ranks else None  # ties go to the lowest rank

    def _reserve(self, request_id: int, rank: int, num_blocks: int) -> None:
        self._reserved[rank] = self._reserved.get(rank, 0) + num_blocks
        self._running[rank] = self._running.get(rank, 0) + 1
        self._bindings[request_id] = (rank, num_blocks)

    def _unreserve(self, request_id: int) -> tuple[int, int] | None:
        binding = self._bindings.pop(request_id, None)
        if binding is not None:
            rank, num_blocks = binding
            self._reserved[rank] -= num_blocks
            self._running[rank] -= 1
        return binding

    def _wake_waiters(self) -> None:
        while self._waiting:
            head = self._waiting[0]
            if head.future.done():  # cancelled while queued
                self._waiting.popleft()
                continue
            rank = self._bind(head.request_id, head.num_blocks)
            if rank is None:
                return
            self._waiting.popleft()
            head.future.set_result(rank)

    def _forget_waiter(self, waiter: _Waiter) -> None:
        if waiter in self._waiting:
            self._waiting.remove(waiter)
        # A rank may have been granted in the same tick the waiter was cancelled: give it back.
        if waiter.future.done() and not waiter.future.cancelled():
            self.release(waiter.request_id)
        self._wake_waiters()
