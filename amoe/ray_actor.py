"""A runtime as a Ray actor (`--distributed-backend ray`, docs/multinode.md): the actor holds one runtime worker
process (`python -m amoe.runtime.worker`, the same as every launcher starts) on the node Ray placed its bundle on.
The worker dies with the actor (PR_SET_PDEATHSIG), so killing the actor, or losing its node, ends the runtime.

Nothing secret travels through Ray: the actor reads the cluster secret from `--cluster-secret-file` on its own host
(every node holds the same file, as it holds the model), and only its path crosses the network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from amoe import wire
from amoe.curve import ClusterKeys, load_secret


class RuntimeActor:
    """One runtime process on this Ray node: `start` launches it, `wait` blocks until it exits (its code)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.run_dir: str | None = None

    def start(self, spec: dict[str, Any], secret_file: str) -> tuple[int, str]:
        """Launch the worker of `spec` (a WorkerSpec's fields without the host-specific ones); (pid, node ip)."""
        import ray

        node_ip = ray.util.get_node_ip_address()
        keys = ClusterKeys.from_secret(load_secret(secret_file))  # read here: no key crosses the network
        self.run_dir = tempfile.mkdtemp(prefix="amoe-ray-")  # private (0700): this runtime's ipc socket
        worker = wire.WorkerSpec(
            **spec, parent_pid=os.getpid(), data_bind=f"ipc://{self.run_dir}/rt{spec['runtime']}.data",
            secure_bind=f"tcp://{node_ip}:0", curve=keys.as_dict(),
        )  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "amoe.runtime.worker"], stdin=subprocess.PIPE, close_fds=True
        )
        self.proc.stdin.write(wire.encode_spec(worker))  # a few kB: fits the pipe buffer, never blocks
        self.proc.stdin.close()
        return self.proc.pid, node_ip

    def wait(self) -> int:
        code = self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return code
