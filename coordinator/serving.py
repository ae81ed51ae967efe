"""Runs one prepared request: admission by the load balancer, the backend's token stream, detokenization, stop
strings, metrics and, whatever happens, the release of its KV reservation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from coordinator.backend import Backend
from coordinator.load_balancer import LoadBalancer
from coordinator.metrics import CoordinatorMetrics, RequestClock
from coordinator.request_state import Detokenizer, RequestState
from coordinator.validation import PreparedRequest

logger = logging.getLogger(__name__)


class RequestRunner:
    """Shared by every endpoint; lives on the API's event loop."""

    def __init__(
        self,
        backend: Backend,
        balancer: LoadBalancer,
        metrics: CoordinatorMetrics,
        make_detokenizer: Callable[[list[int]], Detokenizer],
    ) -> None:
        self.backend = backend
        self.balancer = balancer
        self.metrics = metrics
        self._make_detokenizer = make_detokenizer
        # Requests admitted but not yet run: their clocks, from admit() to run() or release().
        self._clocks: dict[int, RequestClock] = {}

    def abort_all(self) -> None:
        """End of a drain: fail waiting requests and abort running ones (their streams end with "abort")."""
        self.balancer.close()
        running = self.balancer.running_ids()
        if running:
            logger.warning("aborting %d in-flight requests", len(running))
        for request_id in running:
            self.backend.abort(request_id)

    async def admit(self, req: PreparedRequest) -> int:
        """Bind the request to a rank (may wait for KV space); raises OverloadedError or RequestError."""
        clock = self.metrics.clock()
        self.metrics.waiting.inc()
        try:
            rank = await self.balancer.admit(req.request_id, len(req.prompt_token_ids) + req.max_tokens)
        finally:
            self.metrics.waiting.dec()
        clock.admitted()
        self._clocks[req.request_id] = clock
        return rank

    def release(self, request_id: int) -> None:
        """Free an admitted request's reservation, whether or not it ever ran; idempotent."""
        self._clocks.pop(request_id, None)
        self.balancer.release(request_id)

    async def run(
        self, req: PreparedRequest, rank: int, endpoint: str
    ) -> AsyncIterator[tuple[str, RequestState]]:
        """Yield (new text, state) per backend delta of an admitted request; closing early aborts it."""
        state = RequestState(
            self._make_detokenizer(req.prompt_token_ids), req.stop, len(req.prompt_token_ids)
        )
        clock = self._clocks.pop(req.request_id, None) or self.metrics.clock()
        outcome, reason = "error", "error"
        self.metrics.running.inc()
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        stream = self.backend.generate(req.request_id, req.prompt_token_ids, req.sampling_params, rank=rank)
        try:
            # aclosing: leaving this loop early (stop string, client gone) closes the stream, which aborts the
            # request in the backend at once instead of whenever the generator is garbage collected.
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    state.append(delta.token_ids, delta.finish_reason)
                    self.metrics.generation_tokens.inc(len(delta.token_ids))
                    clock.tokens(len(delta.token_ids))
                    text = state.take_text()
                    if text or state.is_finished:
                        yield text, state
                    if state.is_finished:
                        break
            outcome = {None: "error", "abort": "aborted"}.get(state.finish_reason, "success")
            reason = state.finish_reason or "error"
        except (asyncio.CancelledError, GeneratorExit):
            outcome, reason = "aborted", "abort"
            logger.info(
                "request %d (%s) aborted after %d tokens",
                req.request_id,
                req.response_id,
                state.num_output_tokens,
            )
            raise
        finally:
            self.release(req.request_id)
            self.metrics.running.dec()
            self.metrics.requests.labels(endpoint, outcome).inc()
            clock.finished(reason)
