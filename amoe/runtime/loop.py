"""The runtime's main loop: take a batch from the C++ engine, run its layer, hand the outputs back."""

from __future__ import annotations

import threading
from typing import Protocol

from amoe import core


class Executor(Protocol):
    def run(self, batch: core.Batch):
        """Layer outputs for core.submit: expert `out`, attention `(residual, moe_input, ids, weights)`, head None."""


def run_loop(engine: core.Engine, executor: Executor, stop: threading.Event, poll_s: float = 0.05) -> None:
    """Serve until `stop` is set; next_batch releases the GIL while it waits."""
    while not stop.is_set():
        batch = engine.next_batch(poll_s)
        if batch is None:
            continue
        core.submit(engine, batch, executor.run(batch))
