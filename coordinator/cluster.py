"""Cluster manager: starts the runtimes of the placement (through a launcher), wires them (control ROUTER, peer
table), tracks their heartbeats and stats, and replaces a runtime that died or stopped making progress; stops them
all at the end.

Everything runs on the API's asyncio event loop: one ROUTER socket (zmq.asyncio), a reader task that checks and
handles runtime messages, and a watchdog task that polls each process, its heartbeat age and its loop's progress.

Self-healing (`--parallel aep` on every transport, docs/healing.md): a lost runtime is killed if still there and
started again in the same role with the same experts or DP rank, as the next generation of its rank; when it says
Hello it gets the peer table (endpoints and generations), and every survivor is told its new endpoint and generation
(Reconnect), so nobody else restarts (on gloo / nccl the pair's new groups are keyed by both generations). Attention
survivors then ask it again for the expert outputs the old process never answered; the backend re-admits a lost
attention rank's requests once the replacement is Ready. Past `server.max_restarts` in `server.restart_window_s`
(or in a synchronous mode, whose devices cannot rejoin a running group) the cluster fails instead.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import zmq
import zmq.asyncio

from amoe import wire
from amoe.config import AmoeConfig
from amoe.errors import AmoeError
from amoe.placement import runtime_roles
from coordinator.launcher import LocalLauncher, exit_text
from coordinator.nodes import Nodes
from coordinator.runtimes import RestartBudget, RuntimeProc

logger = logging.getLogger(__name__)

_WATCH_S = 0.1  # how often processes are polled: a killed runtime is noticed within this


class ClusterEvents(Protocol):
    """What the cluster tells its backend (all on the event loop)."""

    def on_tokens(self, msg: wire.TokenOut) -> None: ...

    def on_lost(self, runtime: RuntimeProc, reason: str) -> None:
        """A runtime is gone and being replaced."""

    def on_rejoined(self, runtime: RuntimeProc) -> None:
        """Its replacement is connected and serving."""

    def on_death(self, reason: str) -> None:
        """The cluster cannot serve any more."""


class ClusterManager:
    """The runtimes of one `amoe serve`: attention runtimes 0..A-1, then expert runtimes A..A+M-1 (none in ep)."""

    def __init__(
        self,
        config: AmoeConfig,
        model_dir: str | Path,
        events: ClusterEvents,
        *,
        control_bind: str = "ipc",
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.config = config
        self.model_dir = str(model_dir)
        # aep / pingpong: A attention + M expert runtimes; ep: N runtimes that each take requests and host experts.
        self.roles = list(runtime_roles(config.parallel))
        self._events = events
        self._control_bind = control_bind
        self._startup_timeout_s = startup_timeout_s
        # A dead runtime stops beating; process exit is noticed sooner by polling.
        self._heartbeat_timeout_s = max(config.transport.timeout_s, 5.0)
        # Only an AEP runtime can rejoin a running cluster: a synchronous group has no place for a newcomer. The
        # tensor plane does not matter: gloo / nccl groups are per pair, and a replacement gets new ones.
        self._heals = config.parallel.mode == "aep"
        self._budget = RestartBudget(config.server.max_restarts, config.server.restart_window_s)
        self.runtimes: list[RuntimeProc] = []
        self.failure: str | None = None
        self.num_dropped = 0
        self.recoveries: list[float] = []  # seconds from each loss to its replacement serving
        self._launcher: Any = None  # LocalLauncher, or NodeLauncher over several nodes
        self._nodes: Nodes | None = None  # multi-node only
        self._ray: Any = None  # the RayLauncher with --distributed-backend ray
        self.rejected_handshakes = 0  # connections to the CURVE control endpoint refused (multi-node)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tmpdir: str | None = (
            None  # the private run directory (0700): control socket, data sockets, rendezvous
        )
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._started = False

    @property
    def attn_runtimes(self) -> list[RuntimeProc]:
        return [r for r in self.runtimes if r.role == "attention"]

    @property
    def replacing(self) -> list[RuntimeProc]:
        return [r for r in self.runtimes if r.lost is not None]

    # ---- start-up

    async def start(self) -> None:
        """Spawn, wire and wait for every runtime; on any failure stop them all and raise one clear AmoeError."""
        atexit.register(self.kill_all)
        try:
            self._launcher = self._bind()
            self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]
            if self._nodes is not None:
                self._tasks.append(asyncio.ensure_future(self._watch_handshakes()))
            if self._nodes is not None and self._ray is None:
                await self._nodes.publish()
                self._nodes.log_placement(self.roles)
            logger.info("starting %d %s runtimes (%d attention, %d expert)", len(self.roles),
                        self.config.parallel.mode, self.roles.count("attention"),
                        self.roles.count("expert"))  # fmt: skip
            if not self._heals:
                logger.warning(
                    "self-healing is off: --parallel %s runs its runtimes in lock-step, so a lost one cannot "
                    "rejoin; it fails the cluster (requests end with a retryable 503, the server drains and "
                    "exits 1); --parallel aep replaces lost runtimes", self.config.parallel.mode,
                )  # fmt: skip
            for runtime, role in enumerate(self.roles):
                self.runtimes.append(RuntimeProc(runtime, role, self._launcher.spawn(runtime, role)))
            await self._wait_for(lambda r: r.endpoint is not None, "load its weights")
            for r in self.runtimes:
                self.send(r.id, self._welcome(r.id))
            await self._wait_for(lambda r: r.ready, "connect to its peers")
        except BaseException:
            await self.shutdown(timeout_s=2.0)
            raise
        self._started = True
        logger.info("all %d runtimes up", len(self.runtimes))

    def _bind(self) -> Any:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a replacement takes over its runtime's identity
        self._tmpdir = tempfile.mkdtemp(prefix="amoe-")  # private (0700): only this user's processes
        if self._control_bind == "ipc":
            endpoint, tcp_host = f"ipc://{self._tmpdir}/control", None
            self._sock.bind(endpoint)
        else:
            host = self._control_bind.removeprefix("tcp://").rsplit(":", 1)[0]
            port = self._sock.bind_to_random_port(f"tcp://{host}")
            endpoint, tcp_host = f"tcp://{host}:{port}", f"tcp://{host}"
        logger.debug("control plane on %s", endpoint)
        if not self.config.dist.multi_node:
            return LocalLauncher(
                self.config, self.model_dir, self._tmpdir, endpoint, tcp_host=tcp_host,
                startup_timeout_s=self._startup_timeout_s,
            )  # fmt: skip
        if self.config.dist.backend == "ray":
            return self._bind_ray()
        # Several nodes: node 0's runtimes keep the ipc control socket and also listen on this node's address
        # over CURVE for their peers elsewhere; the other nodes' come in through the CURVE control endpoint.
        self._nodes = Nodes(self.config, len(self.roles), self._startup_timeout_s, self._send_to)
        self._nodes.bind(self._sock)
        local = LocalLauncher(
            self.config, self.model_dir, self._tmpdir, endpoint, tcp_host=None,
            startup_timeout_s=self._startup_timeout_s, keys=self._nodes.keys, node_ip=self._nodes.node_ip,
        )  # fmt: skip
        return self._nodes.launcher(local)

    def _bind_ray(self) -> Any:
        """Every runtime a Ray actor; all of them reach the control plane over its CURVE endpoint."""
        from coordinator.ray_launcher import RayLauncher

        launcher = RayLauncher(self.config, self.model_dir, "", len(self.roles), self._startup_timeout_s)
        self._ray = launcher
        self._nodes = Nodes(
            self.config, len(self.roles), self._startup_timeout_s, self._send_to,
            node_ip=self.config.dist.node_ip or launcher.node_ip,
        )  # fmt: skip
        launcher.control = self._nodes.bind(self._sock)
        return launcher

    async def _wait_for(self, done, what: str) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        nodes_deadline = time.monotonic() + self.config.dist.timeout_s
        while not all(done(r) for r in self.runtimes):
            if self.failure is not None:
                raise AmoeError(f"a runtime failed to start: {self.failure}")
            if self._nodes is not None and self._nodes.missing() and time.monotonic() > nodes_deadline:
                missing = ", ".join(str(n) for n in self._nodes.missing())
                raise AmoeError(
                    f"node(s) {missing} did not join within {self.config.dist.timeout_s:.0f} s: start "
                    f"`amoe serve --nnodes {self.config.dist.nnodes} --node-rank R --dist-init-addr "
                    f"{self.config.dist.init_addr} --cluster-secret-file ...` on each (--dist-timeout-s)"
                )
            if time.monotonic() > deadline:
                slow = ", ".join(r.name for r in self.runtimes if not done(r))
                raise AmoeError(f"{slow} did not {what} within {self._startup_timeout_s:.0f} s")
            await asyncio.sleep(0.02)

    # ---- messages

    def send(self, runtime: int, msg: wire.Message) -> None:
        """To one runtime's control socket; never blocks (a dead runtime's messages are dropped)."""
        self._send_to(f"rt{runtime}".encode(), msg)

    def _send_to(self, identity: bytes, msg: wire.Message) -> None:
        if self._sock is None:  # closed: shut down already
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([identity, wire.encode(msg)], flags=zmq.NOBLOCK)

    def _welcome(self, viewer: int) -> wire.Welcome:
        """The peer table of runtime `viewer`: how it reaches every runtime."""
        return wire.Welcome(
            [self._reach(viewer, r) for r in self.runtimes], [r.generation for r in self.runtimes]
        )

    def _reach(self, viewer: int, peer: RuntimeProc) -> str:
        """How runtime `viewer` reaches `peer`: its ipc endpoint on the same host, its CURVE one (multi-node)
        from another host. A host is told by the address a runtime's CURVE endpoint is bound to."""
        mine = self.runtimes[viewer].secure_endpoint
        if peer.secure_endpoint is None or mine is None or _host(mine) == _host(peer.secure_endpoint):
            return peer.endpoint
        return peer.secure_endpoint

    def broadcast(self, msg: wire.Message) -> None:
        for r in self.runtimes:
            self.send(r.id, msg)

    async def _read(self) -> None:
        while True:
            self.receive(await self._sock.recv_multipart())

    def receive(self, frames: list[bytes]) -> None:
        """Act on one control message [identity, message]; an invalid one is dropped and counted, never raised."""
        try:
            if self._nodes is not None and len(frames) == 2 and frames[0].startswith(b"node"):
                self._nodes.handle(*self._check_node(frames))
                return
            runtime, msg = self._check(frames)
            runtime.last_seen = time.monotonic()
            self._handle(runtime, msg)
        except wire.WireError as exc:
            self.drop(str(exc))
        except Exception as exc:  # noqa: BLE001 - no message may stop the reader: that would kill the cluster
            logger.exception("a control message could not be handled")
            self.drop(f"{type(exc).__name__}: {exc}")

    def _check(self, frames: list[bytes]) -> tuple[RuntimeProc, wire.Message]:
        """The sender and its message, if the message is valid and really comes from that runtime's sockets
        ("rt<id>" or "rt<id>.out"); WireError otherwise."""
        if len(frames) != 2:
            raise wire.WireError(f"{len(frames)} frames, expected the identity and one message")
        identity = frames[0].decode("ascii", "replace").removesuffix(".out")
        msg = wire.decode(frames[1])
        if isinstance(msg, (wire.Welcome, wire.AddRequest, wire.Abort, wire.Shutdown, wire.Reconnect)):
            raise wire.WireError(f"a {type(msg).__name__} is no runtime's message")
        if identity != f"rt{msg.runtime}" or not 0 <= msg.runtime < len(self.runtimes):
            raise wire.WireError(f"a message of runtime {msg.runtime} on socket {frames[0]!r}")
        runtime = self.runtimes[msg.runtime]
        if isinstance(msg, wire.Hello) and msg.role != runtime.role:
            raise wire.WireError(f"{runtime.name} said hello as a {msg.role} runtime")
        if isinstance(msg, wire.Heartbeat):
            msg = wire.Heartbeat(msg.runtime, wire.check_report(msg.runtime, msg.stats))
            if msg.stats["role"] != runtime.role:
                raise wire.WireError(f"{runtime.name} reported as a {msg.stats['role']} runtime")
        return runtime, msg

    def _check_node(self, frames: list[bytes]) -> tuple[int, wire.Message]:
        """An agent's message, if valid and really from the agent of the node it names; WireError otherwise."""
        node = self._nodes.node_of_identity(frames[0])
        msg = wire.decode(frames[1])
        if node is None or node < 0 or not isinstance(msg, wire.NODE_MESSAGES) or msg.node != node:
            raise wire.WireError(f"a {type(msg).__name__} on socket {frames[0]!r}")
        return node, msg

    def drop(self, why: str) -> None:
        """Count and log a control message that is not acted on."""
        self.num_dropped += 1
        logger.warning("dropped a control message (%d so far): %s", self.num_dropped, why)

    def _handle(self, runtime: RuntimeProc, msg: wire.Message) -> None:
        if isinstance(msg, wire.TokenOut):
            if runtime.role == "attention":
                runtime.kv_free = min(msg.kv_free_blocks, runtime.num_kv_blocks)
            self._events.on_tokens(msg)
        elif isinstance(msg, wire.Heartbeat):
            self._beat(runtime, msg.stats)
        elif isinstance(msg, wire.Hello):
            self._hello(runtime, msg)
        elif isinstance(msg, wire.Ready):
            runtime.ready, runtime.progressed = True, time.monotonic()  # its loop starts now
            if runtime.lost is not None:
                self._rejoined(runtime)
        elif isinstance(msg, wire.Failed):
            self._lost(runtime, f"{runtime.name} failed: {msg.error}")

    def _hello(self, runtime: RuntimeProc, msg: wire.Hello) -> None:
        runtime.endpoint, runtime.num_kv_blocks, runtime.kv_free = (
            msg.endpoint,
            msg.num_kv_blocks,
            msg.num_kv_blocks,
        )
        runtime.secure_endpoint = msg.secure_endpoint
        runtime.generation = (
            msg.generation
        )  # what its frames carry; the spawned one when its launcher passed it on
        runtime.max_model_len, runtime.vocab_size = msg.max_model_len, msg.vocab_size
        if runtime.lost is None:
            loaded = sum(r.endpoint is not None for r in self.runtimes)
            logger.info(
                "%s loaded its weights (pid %d) [%d/%d]", runtime.name, msg.pid, loaded, len(self.runtimes)
            )
            return
        # A replacement: it gets the peer table; the survivors, its new endpoint.
        logger.info("%s's replacement (pid %d) loaded its weights", runtime.name, msg.pid)
        self.send(runtime.id, self._welcome(runtime.id))
        for other in self.runtimes:
            if other is not runtime:
                reach = self._reach(other.id, runtime)
                self.send(other.id, wire.Reconnect(runtime.id, reach, runtime.generation))

    def _beat(self, runtime: RuntimeProc, stats: dict[str, Any]) -> None:
        """A heartbeat's report: stats for /metrics, KV in use, the loop's progress, and peers it lost."""
        runtime.stats = stats
        if runtime.role == "attention":
            runtime.kv_free = max(0, runtime.num_kv_blocks - stats.get("kv_used_blocks", 0))
        polls = stats.get("polls", 0)
        if polls != runtime.polls:
            runtime.polls, runtime.progressed = polls, time.monotonic()
        for peer in (stats.get("comm") or {}).get("failed_peers") or []:
            if runtime.ready and peer < len(self.runtimes) and self.runtimes[peer].lost is None:
                self._lost(
                    self.runtimes[peer], f"{runtime.name} lost its data link to {self.runtimes[peer].name}"
                )

    def describe(self) -> list[dict[str, Any]]:
        """Each runtime's state for /health (and, over several nodes, where it runs)."""
        out = [r.describe() for r in self.runtimes]
        for r, report in zip(self.runtimes, out):
            if self._ray is not None:
                report["host"] = r.proc.host
            elif self._nodes is not None:
                report.update(self._nodes.describe(r.id))
        return out

    async def _watch_handshakes(self) -> None:
        """Count (and log once) connections to the CURVE control endpoint that fail the handshake: a host
        without the cluster secret, or a plain ZeroMQ client."""
        events = (
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )  # fmt: skip
        monitor = self._sock.get_monitor_socket(events)
        try:
            while True:
                await monitor.recv_multipart()  # one event: [event id + value, endpoint]
                self.rejected_handshakes += 1
                if self.rejected_handshakes == 1:
                    logger.warning("refused a connection without the cluster's keys (counted from now on)")
        finally:
            monitor.close()

    # ---- loss and replacement

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            if self._stopping or self.failure is not None:
                continue
            now = time.monotonic()
            if self._nodes is not None:
                self._nodes.tick(now)  # a silent node's runtimes end here, and are replaced below
            for r in self.runtimes:
                code = r.proc.poll()
                if code is not None:
                    self._lost(r, f"{r.name} (pid {r.proc.pid}) {exit_text(code)}")
                elif r.lost is not None:
                    if now - r.lost_at > self._startup_timeout_s:
                        self._lost(
                            r, f"{r.name}'s replacement did not start within {self._startup_timeout_s:.0f} s"
                        )
                elif r.ready and now - r.last_seen > self._heartbeat_timeout_s:
                    self._lost(r, f"{r.name} (pid {r.proc.pid}) sent nothing for {now - r.last_seen:.1f} s")
                elif r.ready and now - r.progressed > self._heartbeat_timeout_s:
                    # Heartbeats come from the control thread; only the loop's own counter shows it still runs.
                    self._lost(
                        r,
                        f"{r.name} (pid {r.proc.pid}): its loop made no progress for {now - r.progressed:.1f} s",
                    )

    def _lost(self, runtime: RuntimeProc, reason: str) -> None:
        """A runtime died, stopped or failed: replace it while the budget lasts, else the cluster fails."""
        if self.failure is not None or self._stopping:
            return
        if not self._started or not self._heals or not self._budget.take():
            if runtime.proc.poll() is None:
                runtime.proc.kill()  # lost for good: a stopped or wedged process would not stop when asked
            if self._started and self._heals:
                reason += f"; no restart left ({self._budget.limit} in {self._budget.window_s:g} s already)"
            return self._fail(reason)
        logger.warning("%s: replacing it", reason)
        first = runtime.lost is None
        runtime.lost, runtime.lost_at = reason, runtime.lost_at if not first else time.monotonic()
        runtime.ready, runtime.stats = False, None
        if runtime.proc.poll() is None:
            runtime.proc.kill()  # a stopped (SIGSTOP) or wedged process too: SIGKILL needs no cooperation
        _reap_later(runtime.proc)
        runtime.spawned += 1
        runtime.proc = self._launcher.spawn(runtime.id, runtime.role, generation=runtime.spawned)
        runtime.last_seen = runtime.progressed = time.monotonic()
        runtime.polls = 0
        if first:
            self._events.on_lost(runtime, reason)

    def _rejoined(self, runtime: RuntimeProc) -> None:
        seconds = time.monotonic() - runtime.lost_at
        logger.info("%s is back (pid %d) after %.1f s", runtime.name, runtime.proc.pid, seconds)
        runtime.lost = None
        runtime.restarts += 1
        self.recoveries.append(seconds)
        self._events.on_rejoined(runtime)

    def _fail(self, reason: str) -> None:
        if self.failure is not None or self._stopping:
            return
        self.failure = reason
        # During start-up `amoe serve` reports it as its one error line; afterwards the log is the report.
        logger.log(logging.ERROR if self._started else logging.DEBUG, "%s", reason)
        self._events.on_death(reason)

    # ---- shutdown

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Shutdown to every runtime, wait up to timeout_s, kill the stragglers, reap all; idempotent."""
        self._stopping = True
        if self._sock is not None:
            self.broadcast(wire.Shutdown())
        deadline = time.monotonic() + timeout_s
        while any(r.proc.poll() is None for r in self.runtimes) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._nodes is not None:
            self._nodes.shutdown()  # the agents stop what is left of their runtimes, and exit
        self.kill_all()
        if self._ray is not None:
            self._ray.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._close()
        atexit.unregister(self.kill_all)

    def kill_all(self) -> None:
        """SIGKILL and reap every runtime still alive (also the atexit safety net)."""
        for r in self.runtimes:
            if r.proc.poll() is None:
                logger.warning("%s (pid %d) did not stop; killing it", r.name, r.proc.pid)
                r.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(5.0)

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def _host(endpoint: str) -> str:
    """The address of a tcp://host:port endpoint."""
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0]


def _reap_later(proc: subprocess.Popen) -> None:
    """Wait for a killed process off the event loop, so it leaves no zombie."""
    if proc.poll() is None:
        asyncio.get_running_loop().run_in_executor(None, proc.wait)
