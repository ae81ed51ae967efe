"""The barrier exchange of the synchronous modes: the C++ `core.BarrierExchange` (cpp/exchange.h) does the
tagged messages, the per-tag gathers with their deadline (a silent peer raises EngineDeadError) and the MoE
all-to-all; this module makes one for a device and reports what it dropped. Wire format: docs/baselines.md
"Barriers and tags"."""

from __future__ import annotations

import logging

from amoe import core
from amoe.runtime.sync.device import SyncDevice

logger = logging.getLogger(__name__)

BEGIN, DISPATCH, COMBINE = 0, 1, 2  # phases (a tag row's slot)


def barrier_exchange(device: SyncDevice, comm: core.Communicator, timeout_s: float) -> core.BarrierExchange:
    """The exchange of one device: its rank, where each expert (or each expert slot, when the placement can
    change) lives, how long a gather waits."""
    where = device.slots.expert_device if device.slots is not None else list(device.expert_device)
    return core.BarrierExchange(comm, device.rank, timeout_s, where, list(device.expert_devices))


def note_drops(ex: core.BarrierExchange, device: SyncDevice) -> None:
    """Count the messages the exchange dropped since the last call into the device's stats, and log them."""
    new = ex.dropped - device.stats.dropped
    if new > 0:
        device.stats.add_dropped(new)
        logger.warning(
            "[sync] runtime %d dropped %d barrier message(s); last: %s", device.rank, new, ex.last_drop
        )
