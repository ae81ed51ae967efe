"""The runtime's main loop: take a batch from the C++ engine, run its layer, hand the outputs on."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from amoe import core


class Executor(Protocol):
    def run(self, batch: core.Batch) -> Any:
        """Layer outputs for core.submit: expert `out`, attention `(residual, moe_input, ids, weights)`, head a
        HeadOutput."""


def run_loop(
    engine: core.Engine,
    executor: Executor,
    stop: threading.Event,
    publish: Callable[[Any], None],
    poll_s: float = 0.05,
) -> None:
    """Serve until `stop` is set; next_batch releases the GIL while it waits."""
    while not stop.is_set():
        batch = engine.next_batch(poll_s)
        if batch is None:
            continue
        out = executor.run(batch)
        core.submit(
            engine, batch, out
        )  # the head's tokens that go on re-enter block 0, like any layer output
        if batch.kind == "head":
            publish(out)  # where sampled tokens leave the runtime
