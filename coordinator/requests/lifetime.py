"""One request's lifetime in the coordinator, with one owner: it waits for KV space, is admitted to a rank, runs in
the backend and ends, once.

Every way a request ends — its last token, a stop string, the client leaving, a timeout, the server draining, a
failure — calls `RequestLifetime.end`, which is idempotent: the first call aborts the request in the backend if the
backend still runs it, gives its KV reservation (or its place in the queue) back to the load balancer and counts it
in the metrics; later calls do nothing. Enders call it directly rather than count on a CancelledError reaching the
backend's stream through nested async generators: on Python <= 3.11 `asyncio.wait_for` can drop a cancellation
that arrives in the same loop turn as a result (CPython gh-86296), and a stream suspended at a `yield` is never
reached by one at all.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from coordinator.metrics import CoordinatorMetrics
from coordinator.requests.backend import Backend
from coordinator.requests.load_balancer import LoadBalancer
from coordinator.requests.prepared import PreparedRequest

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    WAITING = "waiting"  # in the load balancer's queue for KV space
    ADMITTED = "admitted"  # bound to a rank, its KV reserved; not sent to the backend yet
    RUNNING = "running"  # sent to the backend
    ENDED = "ended"


_OUTCOMES = {"stop": "success", "length": "success", "abort": "aborted"}  # any other reason is an error


class RequestLifetime:
    """A prepared request from its arrival at the load balancer to its end; lives on the API's event loop."""

    def __init__(
        self,
        req: PreparedRequest,
        endpoint: str,
        backend: Backend,
        balancer: LoadBalancer,
        metrics: CoordinatorMetrics,
        timeout_s: float,
        on_end: Callable[[RequestLifetime], None],
    ) -> None:
        self.req = req
        self.endpoint = endpoint
        self.deadline = time.monotonic() + timeout_s
        self.phase = Phase.WAITING
        self.rank: int | None = None
        # Why it ended: a metrics reason (stop, length, abort, error, rejected).
        self.reason: str | None = None
        self.num_output_tokens = 0
        self._in_backend = False  # sent to the backend, and the backend has not reported its end
        self._backend = backend
        self._balancer = balancer
        self._metrics = metrics
        self._on_end = on_end
        self._clock = metrics.clock()
        metrics.waiting.inc()

    @property
    def request_id(self) -> int:
        return self.req.request_id

    @property
    def is_ended(self) -> bool:
        return self.phase is Phase.ENDED

    def admitted(self, rank: int) -> None:
        """The load balancer bound it to `rank` and reserved its KV."""
        if self.is_ended:  # it ended while the grant was on its way: the blocks go straight back
            self._balancer.release(self.request_id)
            return
        self.phase, self.rank = Phase.ADMITTED, rank
        self._metrics.waiting.dec()
        self._clock.admitted()

    def start(self) -> bool:
        """It is about to be sent to the backend; False if it has ended already (nothing to send)."""
        if self.phase is not Phase.ADMITTED:
            return False
        self.phase = Phase.RUNNING
        self._metrics.running.inc()
        self._metrics.prompt_tokens.inc(len(self.req.prompt_token_ids))
        return True

    def sent(self) -> None:
        """The backend took it (generate() returned its stream): ending it early now aborts it there."""
        self._in_backend = True

    def tokens(self, n: int) -> None:
        """`n` output tokens arrived from the backend."""
        self.num_output_tokens += n
        self._metrics.generation_tokens.inc(n)
        self._clock.tokens(n)

    def backend_ended(self) -> None:
        """The backend reported the request's end (its last delta, or an error): there is nothing to abort there."""
        self._in_backend = False

    def end(self, reason: str, cause: str = "") -> bool:
        """End the request for `reason` unless it has ended already; True if this call ended it. A request the
        backend still runs is aborted there; its reservation is returned; it is counted once."""
        if self.is_ended:
            return False
        phase, self.phase, self.reason = self.phase, Phase.ENDED, reason
        if self._in_backend:
            self._in_backend = False
            self._backend.abort(self.request_id)
        if phase is Phase.WAITING:
            self._balancer.withdraw(self.request_id)
        else:
            self._balancer.release(self.request_id)
        self._count(phase, reason)
        if cause:
            logger.info(
                "request %d (%s) ended (%s) after %d tokens: %s",
                self.request_id, self.req.response_id, reason, self.num_output_tokens, cause,
            )  # fmt: skip
        self._on_end(self)
        return True

    def abort(self, cause: str) -> bool:
        """End it now because its client left or the server drains (counted as aborted); idempotent."""
        return self.end("abort", cause)

    def _count(self, phase: Phase, reason: str) -> None:
        metrics = self._metrics
        if phase is Phase.WAITING:
            metrics.waiting.dec()
        if phase is Phase.RUNNING:
            metrics.running.dec()
            self._clock.finished(reason)  # a request that never ran has no latency to observe
        else:
            metrics.finished.labels(reason).inc()
        metrics.requests.labels(self.endpoint, _OUTCOMES.get(reason, "error")).inc()
