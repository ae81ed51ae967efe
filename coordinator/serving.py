"""Runs one prepared request: admission by the load balancer, the backend's token stream, detokenization, stop
strings, metrics, its deadline and stall watchdog, and, whatever happens, the release of its KV reservation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from amoe.errors import AmoeError
from coordinator.backend import Backend
from coordinator.load_balancer import LoadBalancer
from coordinator.metrics import CoordinatorMetrics, RequestClock
from coordinator.openai_errors import ApiError, internal_error
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
        request_timeout_s: float = 3600.0,
        stall_timeout_s: float = 60.0,
    ) -> None:
        self.backend = backend
        self.balancer = balancer
        self.metrics = metrics
        self._make_detokenizer = make_detokenizer
        self.request_timeout_s = request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        # Requests admitted but not yet run: their clocks, from admit() to run() or release().
        self._clocks: dict[int, RequestClock] = {}
        self._deadlines: dict[int, float] = {}  # request id -> monotonic deadline, from admit() on

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
        deadline = time.monotonic() + self.request_timeout_s
        self.metrics.waiting.inc()
        try:
            admission = self.balancer.admit(req.request_id, len(req.prompt_token_ids) + req.max_tokens)
            rank = await asyncio.wait_for(admission, self.request_timeout_s)
        except asyncio.TimeoutError:
            raise _timeout(
                f"waited {self.request_timeout_s:g} s for KV space (server.request_timeout_s)"
            ) from None
        finally:
            self.metrics.waiting.dec()
        clock.admitted()
        self._clocks[req.request_id] = clock
        self._deadlines[req.request_id] = deadline
        return rank

    def release(self, request_id: int) -> None:
        """Free an admitted request's reservation, whether or not it ever ran; idempotent."""
        self._clocks.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        self.balancer.release(request_id)

    async def run(
        self, req: PreparedRequest, rank: int, endpoint: str
    ) -> AsyncIterator[tuple[str, RequestState]]:
        """Yield (new text, state) per backend delta of an admitted request; closing early aborts it."""
        state = RequestState(
            self._make_detokenizer(req.prompt_token_ids), req.stop, len(req.prompt_token_ids)
        )
        clock = self._clocks.pop(req.request_id, None) or self.metrics.clock()
        deadline = self._deadlines.get(req.request_id, time.monotonic() + self.request_timeout_s)
        outcome, reason = "error", "error"
        self.metrics.running.inc()
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        stream = self.backend.generate(req.request_id, req.prompt_token_ids, req.sampling_params, rank=rank)
        try:
            # aclosing: leaving this loop early (stop string, client gone) closes the stream, which aborts the
            # request in the backend at once instead of whenever the generator is garbage collected.
            watched = self._watched(stream, deadline)
            async with contextlib.aclosing(stream), contextlib.aclosing(watched):
                async for delta in watched:
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
        except (ApiError, AmoeError) as exc:
            logger.info("request %d (%s) failed: %s", req.request_id, req.response_id, exc)
            raise
        except (
            Exception
        ) as exc:  # a bug in this request's processing (e.g. detokenizing): it fails alone, loudly
            logger.exception("request %d (%s) failed", req.request_id, req.response_id)
            raise internal_error(exc) from None
        finally:
            self.release(req.request_id)
            self.metrics.running.dec()
            self.metrics.requests.labels(endpoint, outcome).inc()
            clock.finished(reason)

    async def _watched(self, stream: AsyncIterator, deadline: float) -> AsyncIterator:
        """The stream's deltas, each within the stall timeout and all before the deadline (504 otherwise; leaving
        the stream closes it, which aborts the request and frees its KV)."""
        iterator = aiter(stream)
        while True:
            left = deadline - time.monotonic()
            wait = min(self.stall_timeout_s, left)
            try:
                delta = await asyncio.wait_for(anext(iterator), max(wait, 0.0))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                if wait < self.stall_timeout_s:
                    raise _timeout(
                        f"the request ran past its deadline of {self.request_timeout_s:g} s"
                    ) from None
                raise _timeout(f"no token for {self.stall_timeout_s:g} s (server.stall_timeout_s)") from None
            yield delta


def _timeout(message: str) -> ApiError:
    return ApiError(504, message, type="server_error", code="timeout")
