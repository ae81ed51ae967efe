"""Runtimes as child processes of this host (`python -m amoe.runtime.worker`, a JSON WorkerSpec on stdin), started
from the event loop's thread, which lives as long as they do: their PR_SET_PDEATHSIG is tied to the thread that
forked them. The launcher of a one-host cluster; a multi-node cluster's node 0 and every node agent start their own
runtimes with it too."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from amoe import wire
from amoe.config import AmoeConfig
from amoe.curve import ClusterKeys
from coordinator.cluster.control_plane import ControlPlane
from coordinator.cluster.launcher import RuntimeHandle


class LocalLauncher:
    """Runtimes as child processes on this host, their sockets in the private run directory `run_dir`."""

    secure = False  # one host: the control plane has no CURVE endpoint

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

    @classmethod
    def on_plane(
        cls,
        config: AmoeConfig,
        model_dir: str,
        plane: ControlPlane,
        startup_timeout_s: float,
        **multi_node: Any,
    ) -> LocalLauncher:
        """The launcher of runtimes that reach the coordinator at `plane`'s endpoint; `multi_node` (keys, node_ip):
        they also listen over CURVE for peers on other hosts."""
        return cls(
            config, model_dir, plane.run_dir, plane.endpoint, tcp_host=plane.tcp_host if not multi_node else None,
            startup_timeout_s=startup_timeout_s, **multi_node,
        )  # fmt: skip

    async def open(self, roles: list[str]) -> None:
        """Nothing to prepare on one host."""

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

    def tick(self, now: float) -> None:
        """Nothing to watch but the processes themselves (the watchdog polls them)."""

    def missing_nodes(self) -> list[int]:
        return []  # one host, no agents

    def handle(self, frames: list[bytes]) -> bool:
        return False  # no node agents here

    def describe(self, runtime: int, handle: RuntimeHandle) -> dict[str, Any]:
        return {}  # one host: nothing to add

    def stop(self) -> None:
        """Nothing of its own to stop: the cluster manager stops and reaps the processes."""

    def close(self) -> None:
        """Nothing held beyond the processes."""
