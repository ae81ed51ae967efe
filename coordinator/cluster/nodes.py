"""The coordinator's view of the other nodes of a multi-node cluster (docs/multinode.md): one agent per node,
connected to the control plane over CURVE, that starts and stops that node's runtimes when asked and reports how
they end.

A runtime on another node is a `RemoteProc`: the same handle (poll, kill, pid) the cluster manager holds for a local
child process, kept up to date from its agent's NodeStatus reports. An agent that goes silent (its host or its
process died) has lost every runtime it ran: the cluster manager replaces them through the self-healing path, and
their Spawns wait here until the agent is back (an orchestrator restarts it; it joins again by node rank).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from amoe import envs, wire
from amoe.config import AmoeConfig
from amoe.curve import ClusterKeys, fingerprint, load_secret, write_secret
from amoe.errors import AmoeError
from amoe.hostaddr import STORE_READY, route_ip
from amoe.placement import node_map

logger = logging.getLogger(__name__)

# An agent reports every 0.5 s; this much silence means its host, or at least the agent, is gone.
NODE_TIMEOUT_S = 5.0


class RemoteProc:
    """A runtime process on another node (subprocess.Popen's poll / kill / wait / pid, as far as they are used)."""

    def __init__(self, agent: AgentLink, runtime: int, role: str, seq: int, generation: int = 0) -> None:
        self.agent, self.runtime, self.role, self.seq = agent, runtime, role, seq
        self.generation = generation  # of this process of its rank (WorkerSpec.generation)
        self.pid = 0  # known once the agent reports it running
        self.returncode: int | None = None
        self.why: str | None = None  # how it ended, when its agent could not say (the node was lost)
        self.sent = False  # its Spawn reached an agent

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.agent.kill(self)

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode  # its agent reaps it; nothing to wait for on this host


@dataclass
class AgentLink:
    """The coordinator's link to one node's agent (the agent itself is amoe/node_agent.py's NodeAgent): what it was
    told to run, what it last reported, whether it is still there."""

    node: int
    send: Callable[[wire.Message], None]
    config: AmoeConfig
    startup_timeout_s: float
    host: str | None = None
    pid: int = 0
    connected: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    procs: dict[int, RemoteProc] = field(default_factory=dict)  # the current process of each of its runtimes
    _seq: int = 0

    def spawn(self, runtime: int, role: str, generation: int = 0) -> RemoteProc:
        self._seq += 1
        proc = RemoteProc(self, runtime, role, self._seq, generation)
        self.procs[runtime] = proc
        if self.connected:
            self._send_spawn(proc)
        elif self.host is not None:  # it was here: the runtime waits for the agent to come back
            logger.warning("node %d is gone: runtime %d starts when its agent is back", self.node, runtime)
        return proc

    def _send_spawn(self, proc: RemoteProc) -> None:
        proc.sent = True
        self.send(
            wire.Spawn(
                proc.runtime,
                proc.role,
                proc.seq,
                self.config.to_dict(),
                self.startup_timeout_s,
                proc.generation,
            )
        )

    def kill(self, proc: RemoteProc) -> None:
        if self.connected:
            self.send(wire.Kill(proc.runtime, proc.seq))

    def hello(self, msg: wire.NodeHello) -> None:
        """The agent (re)joined: a new agent process has none of the old one's runtimes."""
        rejoined = self.host is not None
        self.host, self.pid, self.connected, self.last_seen = msg.host, msg.pid, True, time.monotonic()
        for proc in self.procs.values():
            if proc.sent and proc.returncode is None and rejoined:
                proc.returncode, proc.why = -signal.SIGKILL, f"was lost with node {self.node}'s old agent"
        self.send(wire.NodeWelcome(self.node))
        for proc in self.procs.values():
            if not proc.sent:
                self._send_spawn(proc)
        logger.info("node %d (%s, agent pid %d) %s", self.node, msg.host, msg.pid,
                    "joined again" if rejoined else "joined")  # fmt: skip

    def status(self, msg: wire.NodeStatus) -> None:
        self.last_seen = time.monotonic()
        for runtime, seq, pid in msg.running:
            proc = self.procs.get(runtime)
            if proc is not None and proc.seq == seq:
                proc.pid = pid
        for runtime, seq, code in msg.exited:
            proc = self.procs.get(runtime)
            if proc is not None and proc.seq == seq and proc.returncode is None:
                proc.returncode = code

    def check(self, now: float) -> str | None:
        """Why the node counts as lost now (once), or None."""
        if not self.connected or now - self.last_seen <= NODE_TIMEOUT_S:
            return None
        self.connected = False
        why = f"node {self.node} ({self.host}) went silent for {now - self.last_seen:.1f} s"
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.returncode, proc.why = -signal.SIGKILL, f"was lost with node {self.node}"
        return why

    def describe(self) -> dict:
        return {
            "node": self.node,
            "host": self.host,
            "agent_pid": self.pid,
            "connected": self.connected,
            "heartbeat_age_s": round(time.monotonic() - self.last_seen, 3),
            "runtimes": sorted(self.procs),
        }


class Nodes:
    """Node 0's side of a multi-node cluster: the cluster keys, the control plane's CURVE endpoint, the rendezvous
    store that publishes it, one AgentLink per other node, and which node each runtime runs on."""

    def __init__(
        self,
        config: AmoeConfig,
        num_runtimes: int,
        startup_timeout_s: float,
        send: Callable[[bytes, wire.Message], None],
        *,
        node_ip: str | None = None,
    ) -> None:
        """`node_ip`: where this node's endpoints bind (default: --node-ip, else the route to --dist-init-addr)."""
        dist = config.dist
        self.dist = dist
        self.node_of = node_map(dist, num_runtimes)  # by runtime id
        self._startup_timeout_s = startup_timeout_s
        secret = _cluster_secret(dist)
        self.keys = ClusterKeys.from_secret(secret)
        salt = os.urandom(16)
        self._secret_check = (
            f"{salt.hex()}:{fingerprint(secret, salt)}"  # agents with another secret stop at it
        )
        self.node_ip = node_ip or dist.node_ip or route_ip(dist.init_addr)
        self.agents = {
            n: AgentLink(n, lambda msg, n=n: send(f"node{n}".encode(), msg), config, startup_timeout_s)
            for n in range(1, dist.nnodes)
        }
        self.control: str | None = None  # the CURVE endpoint agents and remote runtimes reach
        self._store: subprocess.Popen | None = None
        self._next_welcome = 0.0

    # ---- start-up

    def bind(self, sock: zmq.Socket) -> str:
        """The control ROUTER's second endpoint: TCP on this node's address, CURVE only (ZeroMQ copies a socket's
        options into each endpoint when it is bound, so the ipc one bound before stays as it was)."""
        self.keys.serve(sock)
        port = sock.bind_to_random_port(f"tcp://{_url_host(self.node_ip)}")
        sock.curve_server = False
        self.control = f"tcp://{_url_host(self.node_ip)}:{port}"
        return self.control

    async def publish(self) -> None:
        """Host the rendezvous store at --dist-init-addr with the control endpoint in it; a clear error if it
        cannot listen there."""
        self._store = subprocess.Popen(
            [sys.executable, "-m", "amoe.rendezvous", "--addr", self.dist.init_addr, "--control", self.control,
             "--secret-check", self._secret_check, "--parent-pid", str(os.getpid())],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, close_fds=True,
        )  # fmt: skip
        # A local process that imports torch: on a busy host that can take longer than other nodes get to join
        # (--dist-timeout-s), so it gets as long as a runtime gets to start.
        try:
            line = await asyncio.wait_for(
                asyncio.to_thread(self._store.stdout.readline), self._startup_timeout_s
            )
        except asyncio.TimeoutError:
            self._store.kill()  # its readline then returns at end of file
            raise AmoeError(
                f"the rendezvous store at {self.dist.init_addr} did not start within {self._startup_timeout_s:.0f} s"
            ) from None
        if line.strip() != STORE_READY:
            self._store.wait()
            error = self._store.stderr.read().strip().splitlines()
            raise AmoeError(
                error[-1].removeprefix("amoe: error: ") if error else "the rendezvous store failed"
            )
        logger.info("rendezvous store at %s; control plane for other nodes at %s (CURVE)", self.dist.init_addr,
                    self.control)  # fmt: skip

    def log_placement(self, roles: list[str]) -> None:
        for runtime, node in enumerate(self.node_of):
            where = self.node_ip if node == 0 else "its agent joins"
            logger.info("%s runtime %d → node %d (%s)", roles[runtime], runtime, node, where)

    def missing(self) -> list[int]:
        """Nodes whose agent has not joined (yet, or again)."""
        return sorted(n for n, agent in self.agents.items() if not agent.connected)

    # ---- messages from agents

    def node_of_identity(self, identity: bytes) -> int | None:
        """The node an agent's socket speaks for ("node<n>"), or None if the identity is no agent's."""
        text = identity.decode("ascii", "replace")
        if not text.startswith("node") or not text[4:].isdigit():
            return None
        node = int(text[4:])
        return node if node in self.agents else -1

    def handle(self, node: int, msg: wire.Message) -> None:
        """A checked NodeHello / NodeStatus from agent `node`."""
        agent = self.agents[node]
        if isinstance(msg, wire.NodeHello):
            agent.hello(msg)
            names = ", ".join(f"runtime {r}" for r, n in enumerate(self.node_of) if n == node)
            logger.info("node %d joined from %s (agent pid %d): %s", node, msg.host, msg.pid, names)
        else:
            agent.status(msg)

    def tick(self, now: float) -> None:
        """Keep-alives to the agents (every second) and the loss of a silent one (its runtimes end with it)."""
        if now >= self._next_welcome:
            for agent in self.agents.values():
                if agent.connected:
                    agent.send(wire.NodeWelcome(agent.node))
            self._next_welcome = now + 1.0
        for agent in self.agents.values():
            why = agent.check(now)
            if why is not None:
                logger.warning("%s: its runtimes are lost until its agent is back", why)

    def describe(self, runtime: int) -> dict[str, Any]:
        node = self.node_of[runtime]
        host = self.node_ip if node == 0 else self.agents[node].host
        return {"node": node, "host": host}

    def shutdown(self) -> None:
        """Tell every agent to stop (their runtimes go with them) and stop the store."""
        for agent in self.agents.values():
            if agent.connected:
                agent.send(wire.Shutdown())
            for proc in agent.procs.values():
                if proc.returncode is None:
                    proc.returncode, proc.why = -signal.SIGKILL, f"stopped with node {agent.node}"
        if self._store is not None and self._store.poll() is None:
            self._store.kill()
            self._store.wait()


def _cluster_secret(dist: Any) -> bytes:
    """The secret every node holds: --cluster-secret-file, or a new one node 0 writes (0600) and names in its log,
    for the orchestrator to hand to the agents."""
    if dist.cluster_secret_file is not None:
        return load_secret(dist.cluster_secret_file)
    folder = envs.AMOE_CACHE_DIR / "secrets"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"cluster-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.secret"
    secret = write_secret(path)
    logger.warning(
        "wrote a new cluster secret to %s: give it to every node agent (--cluster-secret-file), over a channel "
        "you trust",
        path,
    )
    return secret


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
