"""How runtimes are started, behind one interface (`Launch`): the cluster manager asks for "runtime r in role x" and
gets back a handle it can poll and kill (`RuntimeHandle`); whoever started it, the runtime then joins over the
control plane like any other, which is also what makes a replacement just another join.

Three ways, picked by `open_launch` from the config:
- `Launch` itself: child processes of the coordinator (`LocalLauncher`: `python -m amoe.runtime.worker`, a JSON
  WorkerSpec on stdin), from the event loop's thread, which lives as long as they do: their PR_SET_PDEATHSIG is
  tied to the thread that forked them.
- `MultiNodeLaunch` (`--nnodes N`): node 0's runtimes as child processes, the others through their node's agent
  (coordinator/cluster/nodes.py), which joins the control plane over CURVE.
- `RayLaunch` (`--distributed-backend ray`): every runtime a Ray actor (coordinator/cluster/ray_launcher.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Protocol

from amoe import wire
from amoe.config import AmoeConfig
from amoe.curve import ClusterKeys
from coordinator.cluster.control_plane import ControlPlane
from coordinator.cluster.nodes import Nodes

if TYPE_CHECKING:  # Ray is an optional extra: imported only when --distributed-backend ray asks for it
    from coordinator.cluster.ray_launcher import RayLauncher

logger = logging.getLogger(__name__)


class RuntimeHandle(Protocol):
    """A started runtime as the cluster manager holds it: a child process (subprocess.Popen), a runtime on another
    node (coordinator.cluster.nodes.RemoteProc) or a Ray actor (coordinator.cluster.ray_launcher.RayProc)."""

    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


class Spawner(Protocol):
    """Starts runtime `runtime` in `role` somewhere and returns its handle (LocalLauncher, RayLauncher)."""

    def spawn(self, runtime: int, role: str, generation: int = 0) -> RuntimeHandle: ...


class LocalLauncher:
    """Runtimes as child processes on this host, their sockets in the private run directory `run_dir`."""

    def __init__(
        self,
        config: AmoeConfig,
        model_dir: str,
        run_dir: str,
        control: str,
        *,
        tcp_host: str | None,
        startup_timeout_s: float,
        keys: ClusterKeys | None = None,
        node_ip: str | None = None,
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.run_dir = run_dir
        self.control = control
        self.tcp_host = tcp_host  # None: ipc sockets in the run directory (one host)
        self.startup_timeout_s = startup_timeout_s
        # Multi-node: each runtime also listens on node_ip over CURVE for peers on other hosts.
        self.keys, self.node_ip = keys, node_ip

    def spawn(self, runtime: int, role: str, generation: int = 0) -> subprocess.Popen:
        """Runtime `runtime`'s process number `generation` (0 first, +1 per replacement)."""
        # gloo / nccl rendezvous: a file in the private run directory (torch's FileStore), so nothing listens on
        # the network for it and the coordinator needs no torch.
        store = os.path.join(self.run_dir, "rendezvous") if self.config.tensor_plane != "inline" else None
        # ipc sockets live in the private run directory: only this user's processes can reach them. A replacement
        # gets a fresh path (the old process may not have unlinked its own).
        data = os.path.join(self.run_dir, f"rt{runtime}-{os.urandom(4).hex()}.data")
        spec = wire.WorkerSpec(
            runtime=runtime, role=role, coordinator=self.control, model_dir=self.model_dir,
            config=self.config.to_dict(), parent_pid=os.getpid(), store_path=store,
            data_bind=f"ipc://{data}" if self.tcp_host is None else f"{self.tcp_host}:0",
            startup_timeout_s=self.startup_timeout_s,
            secure_bind=f"tcp://{self.node_ip}:0" if self.keys is not None else None,
            curve=self.keys.as_dict() if self.keys is not None else None, generation=generation,
        )  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, "-m", "amoe.runtime.worker"], stdin=subprocess.PIPE, close_fds=True
        )
        proc.stdin.write(wire.encode_spec(spec))  # a few kB: fits the pipe buffer, never blocks
        proc.stdin.close()
        return proc


def exit_text(code: int) -> str:
    """How a process ended, in words."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Launch:
    """One cluster's way of starting its runtimes; this base starts them all as child processes of this host."""

    secure = False  # whether the control plane has a CURVE endpoint (whose refused handshakes are counted)

    def __init__(self, spawner: Spawner) -> None:
        self.spawner = spawner

    async def open(self, roles: list[str]) -> None:
        """Before the first spawn (multi-node: publish the rendezvous, log the placement)."""

    def spawn(self, runtime: int, role: str, generation: int = 0) -> RuntimeHandle:
        """Runtime `runtime`'s process number `generation` (0 first, +1 per replacement)."""
        return self.spawner.spawn(runtime, role, generation)

    def tick(self, now: float) -> None:
        """Every watchdog pass (multi-node: keep-alives to the agents, the loss of a silent one)."""

    def missing_nodes(self) -> list[int]:
        """Nodes whose agent has not joined (yet, or again)."""
        return []

    def handle(self, frames: list[bytes]) -> bool:
        """A node agent's control message: True if `frames` was one (acted on, or WireError if invalid)."""
        return False

    def describe(self, runtime: int, handle: RuntimeHandle) -> dict[str, Any]:
        """Where the runtime runs, for /health (nothing to add on one host)."""
        return {}

    def stop(self) -> None:
        """After the runtimes were told to stop, before the stragglers are killed (multi-node: the agents)."""

    def close(self) -> None:
        """Last, once every runtime is gone (Ray: its placement group and connection)."""


class MultiNodeLaunch(Launch):
    """Node 0's runtimes as child processes; every other node's through its agent."""

    secure = True

    def __init__(self, local: LocalLauncher, nodes: Nodes) -> None:
        super().__init__(local)
        self.nodes = nodes

    async def open(self, roles: list[str]) -> None:
        await self.nodes.publish()
        self.nodes.log_placement(roles)

    def spawn(self, runtime: int, role: str, generation: int = 0) -> RuntimeHandle:
        node = self.nodes.node_of[runtime]
        if node == 0:
            return self.spawner.spawn(runtime, role, generation)
        return self.nodes.agents[node].spawn(runtime, role, generation)

    def tick(self, now: float) -> None:
        self.nodes.tick(now)  # a silent node's runtimes end here, and are replaced by the watchdog

    def missing_nodes(self) -> list[int]:
        return self.nodes.missing()

    def handle(self, frames: list[bytes]) -> bool:
        if len(frames) != 2 or not frames[0].startswith(b"node"):
            return False
        node = self.nodes.node_of_identity(frames[0])
        msg = wire.decode(frames[1])
        if node is None or node < 0 or not isinstance(msg, wire.NODE_MESSAGES) or msg.node != node:
            raise wire.WireError(f"a {type(msg).__name__} on socket {frames[0]!r}")
        self.nodes.handle(node, msg)
        return True

    def describe(self, runtime: int, handle: RuntimeHandle) -> dict[str, Any]:
        return self.nodes.describe(runtime)

    def stop(self) -> None:
        self.nodes.shutdown()  # the agents stop what is left of their runtimes, and exit


class RayLaunch(Launch):
    """Every runtime a Ray actor; all of them reach the control plane over its CURVE endpoint."""

    secure = True

    def __init__(self, ray: RayLauncher) -> None:
        super().__init__(ray)
        self.ray = ray

    def describe(self, runtime: int, handle: RuntimeHandle) -> dict[str, Any]:
        return {"host": handle.host}

    def close(self) -> None:
        self.ray.shutdown()  # after kill_all: polling an actor needs Ray


def open_launch(
    config: AmoeConfig, model_dir: str, plane: ControlPlane, num_runtimes: int, startup_timeout_s: float
) -> Launch:
    """The way this config starts its runtimes, its control endpoints bound on `plane`."""

    def local(**multi_node: Any) -> LocalLauncher:
        return LocalLauncher(
            config, model_dir, plane.run_dir, plane.endpoint, tcp_host=plane.tcp_host if not multi_node else None,
            startup_timeout_s=startup_timeout_s, **multi_node,
        )  # fmt: skip

    def to_node(identity: bytes, msg: wire.Message) -> None:
        plane.send(identity, msg, retry=False)  # an agent's own keep-alives tell whether it is still there

    if not config.dist.multi_node:
        return Launch(local())
    if config.dist.backend == "ray":
        from coordinator.cluster.ray_launcher import RayLauncher

        ray = RayLauncher(config, model_dir, "", num_runtimes, startup_timeout_s)
        nodes = Nodes(
            config, num_runtimes, startup_timeout_s, to_node, node_ip=config.dist.node_ip or ray.node_ip
        )
        ray.control = nodes.bind(plane.sock)
        return RayLaunch(ray)
    # Several nodes: node 0's runtimes keep the ipc control socket and also listen on this node's address over
    # CURVE for their peers elsewhere; the other nodes' come in through the CURVE control endpoint.
    nodes = Nodes(config, num_runtimes, startup_timeout_s, to_node)
    nodes.bind(plane.sock)
    return MultiNodeLaunch(local(keys=nodes.keys, node_ip=nodes.node_ip), nodes)
