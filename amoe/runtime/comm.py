"""A runtime process's communicator: the ZeroMQ data endpoint, the gloo / nccl groups for two-phase transfers (one
per peer, amoe.runtime.planes), and (emulated runs) the hold each peer's messages get in flight. Shared by the AEP
and the synchronous runtimes."""

from __future__ import annotations

import os
from typing import Any

from amoe import core, wire
from amoe.config import AmoeConfig
from amoe.runtime import build
from amoe.runtime.faults import Faults
from amoe.runtime.planes import PeerGroups


def communicator(
    spec: wire.WorkerSpec, num_runtimes: int, config: AmoeConfig, em: Any = None
) -> tuple[Any, PeerGroups | None]:
    """This runtime's ZmqCommunicator, and on a gloo / nccl plane the builder of its groups with each peer (the
    runtime starts it with the peers' generations); with an emulation `em`, links hold messages for their time
    in flight."""
    plane = config.tensor_plane
    if plane != "inline" and spec.data_bind.startswith("ipc://"):
        # One host: gloo's pairs and NCCL's bootstrap / socket transport listen on loopback, not on whatever
        # interface the hostname resolves to (NCCL's GPU paths, NVLink and shared memory, need no socket).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    comm = core.ZmqCommunicator(
        spec.runtime, num_runtimes, bind=spec.data_bind, plane=plane, peer_groups=plane != "inline",
        generation=spec.generation, timeout_s=config.transport.timeout_s,
    )  # fmt: skip
    if spec.secure_bind is not None:  # multi-node: peers on other hosts come in over CURVE
        comm.listen_secure(spec.secure_bind, **spec.curve)
    if em is not None:
        # Loopback delivers at once; an emulated GPU's messages should take the time its links would.
        comm.set_link_delays(*build.link_delays(config, em, spec.runtime, num_runtimes))
    faults = Faults.from_env()
    if faults is not None and faults.alloc_failure is not None:  # tests only (AMOE_FAULTS "alloc")
        comm.inject_alloc_failure(skip=faults.alloc_failure - 1)
    if plane == "inline":
        return comm, None
    groups = PeerGroups(
        comm, spec.runtime, spec.generation, spec.store_path, plane, timeout_s=spec.startup_timeout_s
    )
    return comm, groups
