"""A runtime process's communicator: the ZeroMQ data endpoint, the gloo / nccl group for two-phase transfers, and
(emulated runs) the hold each peer's messages get in flight. Shared by the AEP and the synchronous runtimes."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from amoe import core, wire
from amoe.config import AmoeConfig
from amoe.runtime import build


def communicator(spec: wire.WorkerSpec, num_runtimes: int, config: AmoeConfig, em: Any = None) -> Any:
    """This runtime's ZmqCommunicator; with an emulation `em`, its links hold messages for their time in flight."""
    plane = config.tensor_plane
    group = None if plane == "inline" else _process_group(spec, num_runtimes, plane)
    comm = core.ZmqCommunicator(
        spec.runtime, num_runtimes, bind=spec.data_bind, plane=plane, process_group=group,
        timeout_s=config.transport.timeout_s,
    )  # fmt: skip
    if spec.secure_bind is not None:  # multi-node: peers on other hosts come in over CURVE
        comm.listen_secure(spec.secure_bind, **spec.curve)
    if em is not None:
        # Loopback delivers at once; an emulated GPU's messages should take the time its links would.
        comm.set_link_delays(*build.link_delays(config, em, spec.runtime))
    return comm


def _process_group(spec: wire.WorkerSpec, num_runtimes: int, plane: str) -> Any:
    """The gloo / nccl group of every runtime, met through a file in the coordinator's private run directory
    (nothing listens on the network for it)."""
    import torch.distributed as dist

    if spec.data_bind.startswith("ipc://"):
        # One host: gloo's pairs and NCCL's bootstrap / socket transport listen on loopback, not on whatever
        # interface the hostname resolves to (NCCL's GPU paths, NVLink and shared memory, need no socket).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=spec.startup_timeout_s)
    store = dist.FileStore(spec.store_path, num_runtimes)
    dist.init_process_group(plane, store=store, rank=spec.runtime, world_size=num_runtimes, timeout=timeout)
    if plane == "nccl":
        # A second group for transfers to lower ranks: NCCL keeps one pair's transfers in order on one stream,
        # so a large message each way on a single group would wait for each other's receive (docs/gpu.md).
        return dist.group.WORLD, dist.new_group(list(range(num_runtimes)), backend="nccl")
    return dist.group.WORLD
