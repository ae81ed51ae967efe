"""The runtime's main loop: take a batch from the C++ engine, run its layer, hand the outputs on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from amoe import core
from amoe.runtime.requests import HeadOutput

logger = logging.getLogger(__name__)


class Executor(Protocol):
    def run(self, batch: core.Batch) -> Any:
        """Layer outputs for core.submit: expert `out`, attention `(residual, moe_input, ids, weights)`, head a
        HeadOutput (also what a failed batch returns)."""


def run_loop(
    engine: core.Engine,
    executor: Executor,
    stop: threading.Event,
    publish: Callable[[HeadOutput], None],
    poll_s: float = 0.05,
    between: Callable[[], None] = lambda: None,
) -> None:
    """Serve until `stop` is set; next_batch releases the GIL while it waits. `between` runs before each take:
    where a live placement's weights land and go (amoe.runtime.replicas), since no batch is running then."""
    while not stop.is_set():
        between()
        batch = engine.next_batch(poll_s)
        if batch is None:
            continue
        out = run_batch(executor, batch)
        core.submit(
            engine, batch, out
        )  # the head's tokens that go on re-enter block 0, like any layer output
        if isinstance(out, HeadOutput):
            publish(
                out
            )  # where tokens leave the runtime: sampled ones, or the end of a failed batch's requests


def run_batch(executor: Executor, batch: core.Batch) -> Any:
    """The executor's outputs; if its layer raises, a HeadOutput that ends the batch's requests with the error
    (logged): one bad batch never takes the runtime down. (An attention executor ends its own failed requests,
    freeing their KV; this catches the rest, e.g. an expert layer.)"""
    try:
        return executor.run(batch)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        rids = list(dict.fromkeys(batch.request_ids.tolist()))
        logger.exception("%s(%d, %d) failed for requests %s", batch.kind, batch.block, batch.index, rids)
        return HeadOutput.failed(rids, f"{type(exc).__name__}: {exc}")
