"""`--nnodes N`: node 0's runtimes as child processes of the coordinator, every other node's through its node agent
(coordinator/cluster/nodes.py), which joins the control plane over CURVE."""

from __future__ import annotations

from typing import Any

from amoe import wire
from amoe.config import AmoeConfig
from coordinator.cluster.control_plane import ControlPlane
from coordinator.cluster.launcher import RuntimeHandle
from coordinator.cluster.local_launcher import LocalLauncher
from coordinator.cluster.nodes import Nodes


class AgentLauncher:
    """Node 0's runtimes as child processes; every other node's through its agent."""

    secure = True  # the other nodes' agents and runtimes reach the control plane over CURVE

    def __init__(
        self,
        config: AmoeConfig,
        model_dir: str,
        plane: ControlPlane,
        num_runtimes: int,
        startup_timeout_s: float,
    ) -> None:
        """Binds the control plane's CURVE endpoint on this node's address; node 0's runtimes keep the ipc control
        socket and also listen there over CURVE for their peers elsewhere."""

        def to_node(identity: bytes, msg: wire.Message) -> None:
            plane.send(
                identity, msg, retry=False
            )  # an agent's own keep-alives tell whether it is still there

        self.nodes = Nodes(config, num_runtimes, startup_timeout_s, to_node)
        self.nodes.bind(plane.sock)
        self.local = LocalLauncher.on_plane(
            config, model_dir, plane, startup_timeout_s, keys=self.nodes.keys, node_ip=self.nodes.node_ip
        )

    async def open(self, roles: list[str]) -> None:
        await self.nodes.publish()
        self.nodes.log_placement(roles)

    def spawn(self, runtime: int, role: str, generation: int = 0) -> RuntimeHandle:
        node = self.nodes.node_of[runtime]
        if node == 0:
            return self.local.spawn(runtime, role, generation)
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

    def close(self) -> None:
        """The agents and the rendezvous store stopped with `stop`."""
