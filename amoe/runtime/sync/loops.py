"""Choosing the synchronous loop by `parallel.mode`: the one call a runtime process needs."""

from __future__ import annotations

import threading
from collections.abc import Callable

from amoe import core
from amoe.runtime.requests import HeadOutput
from amoe.runtime.sync.device import SyncDevice
from amoe.runtime.sync.ep import run_ep_loop
from amoe.runtime.sync.pingpong import run_pingpong_loop


def run_sync_loop(
    mode: str,
    device: SyncDevice,
    comm: core.Communicator,
    stop: threading.Event,
    publish: Callable[[HeadOutput], None],
    *,
    micro_batches: int = 2,
    timeout_s: float = 10.0,
    poll_s: float = 0.005,
    pipeline=None,
) -> None:
    """Serve `device` in mode "ep" or "pingpong" until any device's stop is set (they leave together); what
    each head step samples leaves through `publish`. `pipeline`: ep's expert pipeline (amoe.runtime.sync.eps)."""
    if mode == "ep":
        run_ep_loop(device, comm, stop, publish, timeout_s=timeout_s, poll_s=poll_s, pipeline=pipeline)
    elif mode == "pingpong":
        run_pingpong_loop(
            device, comm, stop, publish, micro_batches=micro_batches, timeout_s=timeout_s, poll_s=poll_s
        )
    else:
        raise ValueError(f"not a synchronous mode: {mode!r}")
