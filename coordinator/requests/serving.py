"""Runs one prepared request: admission by the load balancer, the backend's token stream, detokenization, stop
strings, its deadline and stall watchdog. Its RequestLifetime (coordinator/requests/lifetime.py) owns how it ends: every
path out of here ends it, and so may the API layer (client gone) or a drain, at any time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable

from amoe.errors import AmoeError
from coordinator.metrics import CoordinatorMetrics
from coordinator.requests.backend import Backend, TokenDelta
from coordinator.requests.errors import InternalError, TimedOut
from coordinator.requests.lifetime import RequestLifetime
from coordinator.requests.load_balancer import LoadBalancer
from coordinator.requests.prepared import PreparedRequest
from coordinator.requests.request_state import Detokenizer, OutputChunk, RequestState

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # the same semantics before 3.11: it cancels the awaiting task itself and never swallows an outside cancel
    from async_timeout import timeout

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
        self._live: dict[int, RequestLifetime] = {}  # request id -> lifetime, from open() until it ends

    def open(self, req: PreparedRequest, endpoint: str) -> RequestLifetime:
        """The lifetime of a request that has just arrived; its deadline starts now."""
        lifetime = RequestLifetime(
            req, endpoint, self.backend, self.balancer, self.metrics, self.request_timeout_s,
            on_end=lambda ended: self._live.pop(ended.request_id, None),
        )  # fmt: skip
        self._live[req.request_id] = lifetime
        return lifetime

    def abort_all(self) -> None:
        """End of a drain: waiting requests fail (503), the others are aborted (their output ends with "abort")."""
        self.balancer.close()
        if self._live:
            logger.warning("aborting %d in-flight requests", len(self._live))
        for lifetime in list(self._live.values()):
            lifetime.abort("the server is draining")

    async def admit(self, lifetime: RequestLifetime) -> None:
        """Bind the request to a rank, waiting for KV space up to its deadline; on any failure (Overloaded,
        RequestError, TimedOut) the request has ended."""
        req = lifetime.req
        try:
            # asyncio.timeout, not wait_for: it cannot drop a cancellation (the client leaving) on the way.
            async with timeout(lifetime.deadline - time.monotonic()):
                rank = await self.balancer.admit(req.request_id, self._kv_tokens(req))
        except asyncio.TimeoutError:  # TimeoutError itself from 3.11 on
            lifetime.end("error", "no KV space before its deadline")
            raise TimedOut(
                f"waited {self.request_timeout_s:g} s for KV space (server.request_timeout_s)"
            ) from None
        except AmoeError:
            lifetime.end("rejected")
            raise
        except Exception as exc:  # a bug admitting this request: it fails alone, loudly
            logger.exception("request %d failed before it ran", req.request_id)
            lifetime.end("error")
            raise InternalError(exc) from None
        except asyncio.CancelledError:
            lifetime.abort("cancelled while waiting for KV space")
            raise
        lifetime.admitted(rank)

    def _kv_tokens(self, req: PreparedRequest) -> int:
        """The KV the request may fill: prompt + max_tokens, per sequence (n > 1: each in blocks of its own)."""
        tokens, num_seqs = len(req.prompt_token_ids) + req.max_tokens, req.sampling_params.num_sequences
        if num_seqs == 1:
            return tokens
        bs = self.backend.block_size
        return num_seqs * -(-tokens // bs) * bs

    def _states(self, req: PreparedRequest) -> list[RequestState]:
        """One output state per sequence (n > 1: best_of of them), each with its own detokenizer."""
        params, prompt = req.sampling_params, req.prompt_token_ids
        options = {} if params.skip_special_tokens else {"skip_special_tokens": False}
        return [
            RequestState(
                self._make_detokenizer(prompt, **options),
                req.stop,
                len(prompt),
                params.include_stop_str_in_output,
                index,
                req.end_token_ids,
            )  # fmt: skip
            for index in range(params.num_sequences)
        ]

    async def run(self, lifetime: RequestLifetime) -> AsyncIterator[OutputChunk]:
        """Yield what each backend delta of an admitted request has to send, as a chunk of its sequence; each
        sequence's last chunk finishes it, and the request ends after every sequence's. However this ends —
        finished, stop string, closed early, timeout, failure — the lifetime ends with it."""
        req = lifetime.req
        states = self._states(req)
        in_backend = {s.index for s in states}  # sequences the backend has not reported ended
        if not lifetime.start():  # ended before it ran (the server drains): its output ends with "abort"
            for state in states:
                state.append([], "abort")
                yield state.take_chunk()
            return
        reason, cause = "abort", "its stream was closed before its end"  # unless set below
        try:
            stream = self.backend.generate(
                req.request_id, req.prompt_token_ids, req.sampling_params, lifetime.rank
            )
            lifetime.sent()
            async with contextlib.aclosing(stream):
                while (delta := await self._next(stream, lifetime)) is not None:
                    if delta.is_finished:
                        in_backend.discard(delta.index)
                        if not in_backend:  # the backend holds nothing of it any more
                            lifetime.backend_ended()
                    if delta.prompt_logprobs is not None:  # reported once: every sequence's choice shows them
                        for each in states:
                            each.prompt_logprobs = delta.prompt_logprobs
                    state = states[delta.index]
                    if state.is_finished:  # a stop string ended it here; the backend's end of it is late
                        continue
                    state.append(delta.token_ids, delta.finish_reason, delta.logprobs)
                    lifetime.tokens(len(delta.token_ids))
                    done = all(s.is_finished for s in states)
                    if done:  # all its output is here: end it (a stop string aborts it) first
                        lifetime.end(state.finish_reason)
                    elif state.is_finished and delta.finish_reason is None:  # a stop string ended this one
                        self.backend.abort_sequence(req.request_id, state.index)
                    if (chunk := state.take_chunk()) is not None:
                        yield chunk
                    if done:
                        return
            reason, cause = "error", "the backend's stream ended without a finish reason"
        except AmoeError as exc:
            reason, cause = "error", ""
            logger.info("request %d (%s) failed: %s", req.request_id, req.response_id, exc)
            raise
        except Exception as exc:  # a bug here (e.g. detokenizing): the request fails alone, loudly
            reason, cause = "error", ""
            logger.exception("request %d (%s) failed", req.request_id, req.response_id)
            raise InternalError(exc) from None
        finally:
            lifetime.end(reason, cause)

    async def run_all(self, lifetimes: list[RequestLifetime]) -> AsyncIterator[tuple[int, OutputChunk]]:
        """(prompt index, chunk) of every prompt's request as they come (`run`), the requests of one API call; a
        failure of one fails the lot. One prompt's request is admitted already; with several, each is admitted
        as it starts: waiting for all first could hold KV for some while the others wait for it, and deadlock.
        Each prompt runs in a task of its own, ahead of the reader: what it hands over is a fixed chunk."""
        if len(lifetimes) == 1:  # the common case, without a task in between
            async for chunk in self.run(lifetimes[0]):
                yield 0, chunk
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, lifetime: RequestLifetime) -> None:
            try:
                await self.admit(lifetime)
                async for chunk in self.run(lifetime):
                    queue.put_nowait((index, chunk))
                queue.put_nowait((index, None))
            except Exception as exc:  # noqa: BLE001 - handed to the reader, who raises it
                queue.put_nowait((index, exc))

        tasks = [asyncio.ensure_future(pump(i, lifetime)) for i, lifetime in enumerate(lifetimes)]
        try:
            running = len(tasks)
            while running:
                index, chunk = await queue.get()
                if isinstance(chunk, Exception):
                    raise chunk
                if chunk is None:
                    running -= 1
                    continue
                yield index, chunk
        finally:
            end_all(lifetimes, "another prompt of its request ended early")  # no-op for those that finished
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _next(self, stream: AsyncIterator[TokenDelta], lifetime: RequestLifetime) -> TokenDelta | None:
        """The stream's next delta (None at its end), within the stall timeout and before the deadline (TimedOut)."""
        wait = min(self.stall_timeout_s, lifetime.deadline - time.monotonic())
        try:
            # asyncio.timeout, not wait_for: a cancellation arriving with the token is not lost (gh-86296).
            async with timeout(max(wait, 0.0)):
                delta = await anext(stream, None)
        except asyncio.TimeoutError:  # TimeoutError itself from 3.11 on
            if wait < self.stall_timeout_s:
                raise TimedOut(f"the request ran past its deadline of {self.request_timeout_s:g} s") from None
            raise TimedOut(f"no token for {self.stall_timeout_s:g} s (server.stall_timeout_s)") from None
        except Exception:
            lifetime.backend_ended()  # the backend failed it: it holds nothing
            raise
        if delta is None:
            lifetime.backend_ended()
        return delta


def end_all(lifetimes: list[RequestLifetime], cause: str) -> None:
    """Abort the requests of one API call (those ended already stay as they ended)."""
    for lifetime in lifetimes:
        lifetime.abort(cause)
