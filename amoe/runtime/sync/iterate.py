"""The outer loop both synchronous modes share: admit at the iteration boundary, agree with every peer whether
anyone has work (or is stopping), run one iteration, repeat.

The agreement is itself a barrier all-to-all (phase BEGIN, carrying each device's row count and stop flag), as
SGLang's DP attention exchanges batch sizes before each forward: every device runs every iteration, those without
rows send zero-row messages. So all devices leave together when any is told to stop, and idle devices poll at
`poll_s` instead of spinning through empty iterations.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

from amoe import core
from amoe.runtime.requests import HeadOutput
from amoe.runtime.sync.batch import Chunk
from amoe.runtime.sync.device import SyncDevice
from amoe.runtime.sync.exchange import note_drops

logger = logging.getLogger(__name__)

# (iteration number, admitted chunks) -> the head steps' outputs
Iteration = Callable[[int, list[Chunk]], list[HeadOutput]]


def serve_iterations(
    device: SyncDevice,
    ex: core.BarrierExchange,
    stop: threading.Event,
    run_iteration: Iteration,
    publish: Callable[[HeadOutput], None],
    poll_s: float,
) -> None:
    """Iterate until some device's `stop` is set, publishing what each head step sampled; EngineDeadError if a
    peer goes silent."""
    for it in itertools.count():
        chunks = device.admit()
        rows = sum(c.num_rows for c in chunks)
        head_s = (
            device.stats.take_step()
        )  # the last iteration's head (what is left since its steps were taken)
        start = time.perf_counter()
        total, stopping = ex.begin(it, list(device.all_devices), rows, stop.is_set(), head_s)
        note_drops(ex, device)
        if stopping:
            logger.debug("[sync] device %d leaves after %d iterations", device.rank, it)
            return
        if total == 0:
            _idle(device, poll_s)
            device.stats.add_idle(time.perf_counter() - start)
            continue
        device.stats.add_wait(time.perf_counter() - start)  # the BEGIN barrier of a working iteration
        if device.role == "ep":  # every peer a device like it: the heads of the iteration before are compared
            device.stats.waited_for_slower(head_s, ex.slowest_step_s, attention=True)
        device.iteration_rows = total  # every device's rows: what an EP pipeline's auto PN is chosen by
        if (
            device.rebalancer is not None
        ):  # every device agreed this iteration works: the same boundary for all
            device.rebalancer.after_begin(ex, it)
        outputs = run_iteration(it, chunks)
        device.stats.end_iteration(time.perf_counter() - start, rows)
        for out in outputs:
            publish(out)  # where sampled tokens leave the device


def _idle(device: SyncDevice, poll_s: float) -> None:
    # An expert-only device has no inbox: its next BEGIN gather blocks until the attention devices speak.
    if device.inbox is not None:
        device.inbox.wait(poll_s)
