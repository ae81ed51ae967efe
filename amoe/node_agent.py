"""The node agent: what `amoe serve MODEL --nnodes N --node-rank R` (R ≥ 1; `--headless` is vLLM's spelling) runs
on every node but node 0 (docs/multinode.md).

It finds node 0 through the rendezvous store, joins its control plane over CURVE as "node<R>", and from then on only
starts and kills this node's runtimes when the coordinator asks (Spawn, Kill) and reports how they run and end
(NodeStatus, every 0.5 s, which is also its heartbeat). Runtimes are its children and die with it
(PR_SET_PDEATHSIG), so killing an agent takes its node's runtimes along, as losing the host would. When node 0
goes silent the agent stops its runtimes and exits non-zero: nothing outlives the coordinator.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import zmq

from amoe import wire
from amoe.config import AmoeConfig
from amoe.curve import ClusterKeys, load_secret
from amoe.errors import ConfigError, TransportError
from amoe.hostaddr import route_ip
from amoe.rendezvous import Rendezvous
from coordinator.cluster.launcher import exit_text
from coordinator.cluster.local_launcher import LocalLauncher

logger = logging.getLogger(__name__)

STATUS_S = 0.5
COORDINATOR_TIMEOUT_S = 10.0  # node 0 says NodeWelcome every second; this much silence means it is gone


class NodeAgent:
    def __init__(self, config: AmoeConfig, model_dir: Path) -> None:
        dist = config.dist
        if dist.cluster_secret_file is None:
            raise ConfigError(
                "a node agent needs --cluster-secret-file: the secret node 0 wrote (it logs where) or one your "
                "orchestrator shares with every node"
            )
        self.config, self.model_dir, self.node = config, model_dir, dist.node_rank
        self.secret = load_secret(dist.cluster_secret_file)
        self.keys = ClusterKeys.from_secret(self.secret)
        self.node_ip = dist.node_ip or route_ip(dist.init_addr)
        self.procs: dict[int, tuple[int, subprocess.Popen]] = {}  # runtime -> (spawn seq, process)
        self.exited: list[tuple[int, int, int]] = []  # (runtime, seq, code) not yet reported
        self._stopping = False
        self._grace_s = 0.0  # how long runtimes get to stop on their own at the end (after a Shutdown)

    def run(self) -> int:
        """Join, then serve the coordinator until it says Shutdown (0) or goes silent (1)."""
        dist = self.config.dist
        control = Rendezvous(dist.init_addr, timeout_s=dist.timeout_s).control(
            self.secret, dist.cluster_secret_file
        )
        run_dir = tempfile.mkdtemp(prefix="amoe-node-")  # private (0700): this node's ipc sockets
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"node{self.node}".encode())
        sock.setsockopt(zmq.LINGER, 1000)
        self.keys.client(sock)
        sock.connect(control)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            self._join(sock, control)
            launcher = LocalLauncher(
                self.config, str(self.model_dir), run_dir, control, tcp_host=None,
                startup_timeout_s=self.config.dist.timeout_s, keys=self.keys, node_ip=self.node_ip,
            )  # fmt: skip
            return self._serve(sock, launcher)
        finally:
            self._stop_children()
            sock.close()
            ctx.term()
            shutil.rmtree(run_dir, ignore_errors=True)

    def _on_signal(self, signum: int, frame) -> None:
        self._stopping = True

    def _join(self, sock: zmq.Socket, control: str) -> None:
        sock.send(wire.encode(wire.NodeHello(self.node, self.node_ip, os.getpid())))
        timeout_s = self.config.dist.timeout_s
        if not sock.poll(int(timeout_s * 1000)):
            raise TransportError(
                f"node 0 at {control} did not take node {self.node} in within {timeout_s:.0f} s: does this host "
                "hold the same --cluster-secret-file, and can it reach that address?"
            )
        msg = wire.decode(sock.recv())
        if not isinstance(msg, wire.NodeWelcome) or msg.node != self.node:
            raise TransportError(f"node 0 answered the join with {type(msg).__name__}")
        logger.info("node %d (%s) joined the cluster at %s", self.node, self.node_ip, control)

    def _serve(self, sock: zmq.Socket, launcher: LocalLauncher) -> int:
        heard = next_status = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if now >= next_status:
                self._reap()
                sock.send(wire.encode(self._status()))
                next_status = now + STATUS_S
            if now - heard > COORDINATOR_TIMEOUT_S:
                logger.error("node 0 went silent for %.0f s: stopping this node's runtimes", now - heard)
                return 1
            if not sock.poll(int(max(0.0, next_status - time.monotonic()) * 1000) + 1):
                continue
            try:
                msg = wire.decode(sock.recv())
            except wire.WireError as exc:
                logger.warning("dropped a control frame: %s", exc)
                continue
            heard = time.monotonic()
            if isinstance(msg, wire.Shutdown):
                logger.info("node %d: shutdown requested", self.node)
                self._grace_s = 10.0  # the coordinator told its runtimes too
                return 0
            if isinstance(msg, wire.Spawn):
                self._spawn(launcher, msg)
            elif isinstance(msg, wire.Kill):
                seq, proc = self.procs.get(msg.runtime, (None, None))
                if proc is not None and seq == msg.seq and proc.poll() is None:
                    proc.kill()
        return 0

    def _spawn(self, launcher: LocalLauncher, msg: wire.Spawn) -> None:
        old = self.procs.get(msg.runtime)
        if old is not None and old[1].poll() is None:
            old[1].kill()  # a replacement: the old process must not come back
            old[1].wait()
        launcher.config = AmoeConfig.from_dict(msg.config)  # the cluster's config is node 0's
        launcher.startup_timeout_s = msg.startup_timeout_s
        proc = launcher.spawn(msg.runtime, msg.role, msg.generation)
        self.procs[msg.runtime] = (msg.seq, proc)
        logger.info("node %d: started %s runtime %d (pid %d)", self.node, msg.role, msg.runtime, proc.pid)

    def _reap(self) -> None:
        for runtime, (seq, proc) in list(self.procs.items()):
            code = proc.poll()
            if code is not None:
                logger.info("node %d: runtime %d (pid %d) %s", self.node, runtime, proc.pid, exit_text(code))
                self.exited.append((runtime, seq, max(-64, min(255, code))))
                del self.procs[runtime]

    def _status(self) -> wire.NodeStatus:
        running = [(runtime, seq, proc.pid) for runtime, (seq, proc) in self.procs.items()]
        exited, self.exited = self.exited, []
        return wire.NodeStatus(self.node, running, exited)

    def _stop_children(self) -> None:
        """After a Shutdown runtimes get a moment to stop on their own; then (or at once) the rest are killed."""
        deadline = time.monotonic() + self._grace_s
        for _, proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main(config: AmoeConfig, model_dir: Path) -> int:
    return NodeAgent(config, model_dir).run()
