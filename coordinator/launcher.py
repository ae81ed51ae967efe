"""How runtimes are started: the cluster manager asks a launcher for "runtime r in role x" and gets back a handle
it can poll and kill; whoever started it, the runtime then joins over the control plane like any other.

`LocalLauncher` starts them as child processes of the coordinator (`python -m amoe.runtime.worker`, a JSON
WorkerSpec on stdin), from the event loop's thread, which lives as long as they do: their PR_SET_PDEATHSIG is tied
to the thread that forked them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from amoe import wire
from amoe.config import AmoeConfig
from amoe.curve import ClusterKeys


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
