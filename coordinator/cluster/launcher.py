"""How runtimes are started, behind one protocol (`Launcher`): the cluster manager asks for "runtime r in role x"
and gets back a handle it can poll and kill (`RuntimeHandle`); whoever started it, the runtime then joins over the
control plane like any other, which is also what makes a replacement just another join.

Three implementations, each complete on its own; the cluster manager opens the one its config asks for
(coordinator/cluster/manager.py, `open_launcher`):
- `LocalLauncher` (coordinator/cluster/local_launcher.py): child processes of the coordinator on this host;
- `AgentLauncher` (coordinator/cluster/agent_launcher.py, `--nnodes N`): node 0's runtimes as child processes, the
  others through their node's agent (coordinator/cluster/nodes.py), which joins the control plane over CURVE;
- `RayLauncher` (coordinator/cluster/ray_launcher.py, `--distributed-backend ray`): every runtime a Ray actor.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Any, Protocol


class RuntimeHandle(Protocol):
    """A started runtime as the cluster manager holds it: a child process (subprocess.Popen), a runtime on another
    node (coordinator.cluster.nodes.RemoteProc) or a Ray actor (coordinator.cluster.ray_launcher.RayProc)."""

    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


class Launcher(Protocol):
    """One cluster's way of starting its runtimes; every method runs on the event loop."""

    # Whether the control plane has a CURVE endpoint (whose refused handshakes are counted).
    secure: bool

    async def open(self, roles: list[str]) -> None:
        """Before the first spawn (multi-node: publish the rendezvous, log the placement)."""

    def spawn(self, runtime: int, role: str, generation: int = 0) -> RuntimeHandle:
        """Runtime `runtime`'s process number `generation` (0 first, +1 per replacement)."""

    def tick(self, now: float) -> None:
        """Every watchdog pass (multi-node: keep-alives to the agents, the loss of a silent one)."""

    def missing_nodes(self) -> list[int]:
        """Nodes whose agent has not joined (yet, or again)."""

    def handle(self, frames: list[bytes]) -> bool:
        """A node agent's control message: True if `frames` was one (acted on, or WireError if invalid)."""

    def describe(self, runtime: int, handle: RuntimeHandle) -> dict[str, Any]:
        """Where the runtime runs, for /health."""

    def stop(self) -> None:
        """After the runtimes were told to stop, before the stragglers are killed (multi-node: the agents)."""

    def close(self) -> None:
        """Last, once every runtime is gone (Ray: its placement group and connection)."""


def exit_text(code: int) -> str:
    """How a process ended, in words."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
