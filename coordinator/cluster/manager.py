"""Cluster manager: starts the runtimes of the placement, wires them (peer table, Reconnect), reads what they say,
and stops them all at the end. Its parts, each in its own module:

- coordinator/cluster/launcher.py: how runtimes are started (child processes, node agents, Ray actors), behind one
  `Launcher` protocol; `open_launcher` below picks the implementation;
- coordinator/cluster/control_plane.py: the ROUTER socket every runtime and agent connects to; sends that never block and
  are never lost in silence;
- coordinator/cluster/health.py: the watchdog: loss (death, silence, a wedged loop, undeliverable messages), replacement
  within the restart budget, or the cluster's failure.

What is left here is the router: each message is checked (it must come from the runtime it names, in its role) and
handed on, to the backend (tokens) or to the runtime table (Hello, Ready, heartbeats). Everything runs on the API's
asyncio event loop.

Self-healing (`--parallel aep` on every transport, docs/healing.md): a lost runtime is started again in the same
role with the same experts or DP rank, as the next generation of its rank; when it says Hello it gets the peer table
(endpoints and generations), and every survivor is told its new endpoint and generation (Reconnect), so nobody else
restarts (on gloo / nccl the pair's new groups are keyed by both generations). Attention survivors then ask it
again for the expert outputs the old process never answered; the backend re-admits a lost attention rank's
requests. Configurations that cannot heal (a synchronous mode) fail the cluster instead.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amoe import wire
from amoe.config import AmoeConfig
from amoe.errors import AmoeError
from amoe.placement import node_map, runtime_roles
from coordinator.cluster.agent_launcher import AgentLauncher
from coordinator.cluster.control_plane import ControlPlane
from coordinator.cluster.health import WATCH_S, RuntimeWatch
from coordinator.cluster.launcher import Launcher
from coordinator.cluster.local_launcher import LocalLauncher
from coordinator.cluster.ray_launcher import RayLauncher
from coordinator.cluster.rebalance import Rebalancer
from coordinator.cluster.runtimes import ClusterEvents, RestartBudget, RuntimeProc
from coordinator.cluster.scaling import Scaler

logger = logging.getLogger(__name__)

# Runtime messages only a runtime may send; the coordinator's own commands coming back are forged.
_COMMANDS = (
    wire.Welcome,
    wire.AddRequest,
    wire.Abort,
    wire.Shutdown,
    wire.Reconnect,
    *wire.PLACEMENT_COMMANDS,
)


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
        self.runtimes: list[RuntimeProc] = []
        self.num_dropped = 0
        self.plane: ControlPlane | None = None
        self.launch: Launcher | None = None
        self.watch = RuntimeWatch(
            self.runtimes, events, heals=heals(config), startup_timeout_s=startup_timeout_s,
            budget=RestartBudget(config.server.max_restarts, config.server.restart_window_s),
            # A dead runtime stops beating; process exit is noticed sooner by polling.
            heartbeat_timeout_s=max(config.transport.timeout_s, 5.0),
        )  # fmt: skip
        self._tasks: list[asyncio.Task] = []
        # The live expert map (docs/rebalancing.md): aep's experts are queues a replica can join.
        self.placement = (
            Rebalancer(config, self.runtimes, self.send, node_map(config.dist, len(self.roles)))
            if live_placement(config) else None
        )  # fmt: skip
        # Elastic runtimes (coordinator/cluster/scaling.py): joins and drains through the live placement.
        self.scaler = Scaler(self) if self.placement is not None else None

    @property
    def attn_runtimes(self) -> list[RuntimeProc]:
        return [r for r in self.active if r.role == "attention"]

    @property
    def active(self) -> list[RuntimeProc]:
        """The runtimes of the cluster now: all but the retired ones (scaled in; their ids are free slots)."""
        return [r for r in self.runtimes if not r.retired]

    @property
    def replacing(self) -> list[RuntimeProc]:
        return [r for r in self.runtimes if r.lost is not None]

    @property
    def failure(self) -> str | None:
        return self.watch.failure

    @property
    def recoveries(self) -> list[float]:
        return self.watch.recoveries

    @property
    def rejected_handshakes(self) -> int:
        return self.plane.rejected_handshakes if self.plane is not None else 0

    @property
    def send_failures(self) -> int:
        return self.plane.send_failures if self.plane is not None else 0

    # ---- start-up

    async def start(self) -> None:
        """Spawn, wire and wait for every runtime; on any failure stop them all and raise one clear AmoeError."""
        atexit.register(self.kill_all)
        try:
            self.plane = self.watch.plane = ControlPlane(self._control_bind)
            self.launch = self.watch.launch = open_launcher(
                self.config, self.model_dir, self.plane, len(self.roles), self._startup_timeout_s
            )
            self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self.watch.run())]
            if self.placement is not None:
                self._tasks.append(asyncio.ensure_future(self._follow_placement()))
            if self.launch.secure:
                self._tasks.append(asyncio.ensure_future(self.plane.watch_handshakes()))
            await self.launch.open(self.roles)
            logger.info("starting %d %s runtimes (%d attention, %d expert)", len(self.roles),
                        self.config.parallel.mode, self.roles.count("attention"),
                        self.roles.count("expert"))  # fmt: skip
            if not self.watch.heals:
                logger.warning("%s", no_healing_reason(self.config))
            for runtime, role in enumerate(self.roles):
                self.runtimes.append(RuntimeProc(runtime, role, self.launch.spawn(runtime, role)))
            await self._wait_for(lambda r: r.endpoint is not None, "load its weights")
            for r in self.runtimes:
                self.send(r.id, self._welcome(r.id))
            await self._wait_for(lambda r: r.ready, "connect to its peers")
        except BaseException:
            await self.shutdown(timeout_s=2.0)
            raise
        self.watch.started = True
        logger.info("all %d runtimes up", len(self.runtimes))

    async def _wait_for(self, done: Callable[[RuntimeProc], bool], what: str) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        nodes_deadline = time.monotonic() + self.config.dist.timeout_s
        while not all(done(r) for r in self.runtimes):
            if self.failure is not None:
                raise AmoeError(f"a runtime failed to start: {self.failure}")
            if self.launch.missing_nodes() and time.monotonic() > nodes_deadline:
                missing = ", ".join(str(n) for n in self.launch.missing_nodes())
                raise AmoeError(
                    f"node(s) {missing} did not join within {self.config.dist.timeout_s:.0f} s: start "
                    f"`amoe serve --nnodes {self.config.dist.nnodes} --node-rank R --dist-init-addr "
                    f"{self.config.dist.init_addr} --cluster-secret-file ...` on each (--dist-timeout-s)"
                )
            if time.monotonic() > deadline:
                slow = ", ".join(r.name for r in self.runtimes if not done(r))
                raise AmoeError(f"{slow} did not {what} within {self._startup_timeout_s:.0f} s")
            await asyncio.sleep(0.02)

    # ---- messages out

    def send(self, runtime: int, msg: wire.Message) -> bool:
        """To one runtime's control socket; never blocks. False: not delivered yet (it waits in the runtime's
        outbox and is retried; a runtime that stays unreachable is lost, and its outbox dropped)."""
        if self.plane is None:
            return False
        return self.plane.send(f"rt{runtime}".encode(), msg)

    def broadcast(self, msg: wire.Message) -> None:
        for r in self.active:
            self.send(r.id, msg)

    def _welcome(self, viewer: int) -> wire.Welcome:
        """The peer table of runtime `viewer`: how it reaches every runtime; and the placement it starts from."""
        placement = self.placement.welcome(self.runtimes[viewer]) if self.placement is not None else None
        return wire.Welcome(
            [self._reach(viewer, r) for r in self.runtimes], [r.generation for r in self.runtimes], placement
        )

    async def _follow_placement(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            if self.watch.started and not self.watch.stopping and self.failure is None:
                self.placement.tick()

    def _reach(self, viewer: int, peer: RuntimeProc) -> str:
        """How runtime `viewer` reaches `peer`: its ipc endpoint on the same host, its CURVE one (multi-node)
        from another host. A host is told by the address a runtime's CURVE endpoint is bound to."""
        if peer.retired or peer.endpoint is None:
            return ""  # a slot no runtime holds (yet, or any more): the communicator leaves it empty
        mine = self.runtimes[viewer].secure_endpoint
        if peer.secure_endpoint is None or mine is None or _host(mine) == _host(peer.secure_endpoint):
            return peer.endpoint
        return peer.secure_endpoint

    # ---- messages in: the router

    async def _read(self) -> None:
        while True:
            self.receive(await self.plane.recv())

    def receive(self, frames: list[bytes]) -> None:
        """Act on one control message [identity, message]; an invalid one is dropped and counted, never raised."""
        try:
            if self.launch is not None and self.launch.handle(frames):
                return  # a node agent's
            runtime, msg = self._check(frames)
            if runtime.retired:  # a scaled-in runtime's last words (a heartbeat before it stopped)
                return
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
        if isinstance(msg, _COMMANDS):
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
            runtime.joining = False  # a joiner serves from now on (hosting nothing until its rebalance)
            if runtime.lost is not None:
                self.watch.rejoined(runtime)
        elif isinstance(msg, wire.Failed):
            self.watch.lost(runtime, f"{runtime.name} failed: {msg.error}")
        elif isinstance(msg, wire.PLACEMENT_REPLIES) and not (
            self.placement is not None and self.placement.on_message(runtime, msg)
        ):
            self.drop(f"{runtime.name}'s {type(msg).__name__} of epoch {msg.epoch} answers nothing asked")

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
        if self.placement is not None:
            self.placement.on_hello(runtime, msg)
        if runtime.lost is None and not runtime.joining:
            loaded = sum(r.endpoint is not None for r in self.runtimes)
            logger.info(
                "%s loaded its weights (pid %d) [%d/%d]", runtime.name, msg.pid, loaded, len(self.runtimes)
            )
            return
        # A replacement or a runtime that joins (`amoe scale`), the same way: it gets the peer table; the
        # others, its endpoint.
        what = "joins" if runtime.joining else "is replaced"
        logger.info("%s %s: its process (pid %d) is up", runtime.name, what, msg.pid)
        self.send(runtime.id, self._welcome(runtime.id))
        for other in self.active:
            if other is not runtime:
                reach = self._reach(other.id, runtime)
                self.send(other.id, wire.Reconnect(runtime.id, reach, runtime.generation))

    def _beat(self, runtime: RuntimeProc, stats: dict[str, Any]) -> None:
        """A heartbeat's report: stats for /metrics, KV in use, the loop's progress, and peers it lost."""
        runtime.stats = stats
        if runtime.role == "attention":
            runtime.kv_free = max(0, runtime.num_kv_blocks - stats.get("kv_used_blocks", 0))
        if self.placement is not None:
            self.placement.on_report(runtime, stats)
        polls = stats.get("polls", 0)
        if polls != runtime.polls:
            runtime.polls, runtime.progressed = polls, time.monotonic()
        for peer in (stats.get("comm") or {}).get("failed_peers") or []:
            there = (
                peer < len(self.runtimes)
                and self.runtimes[peer].lost is None
                and not self.runtimes[peer].retired
            )
            if runtime.ready and there:
                self.watch.lost(
                    self.runtimes[peer], f"{runtime.name} lost its data link to {self.runtimes[peer].name}"
                )

    def describe(self) -> list[dict[str, Any]]:
        """Each runtime's state for /health (and, over several nodes, where it runs)."""
        return [
            r.describe() | (self.launch.describe(r.id, r.proc) if self.launch else {}) for r in self.active
        ]

    # ---- shutdown

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Shutdown to every runtime, wait up to timeout_s, kill the stragglers, reap all; idempotent."""
        self.watch.stopping = True
        if self.plane is not None:
            self.broadcast(wire.Shutdown())
        deadline = time.monotonic() + timeout_s
        while any(r.proc.poll() is None for r in self.runtimes) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.launch is not None:
            self.launch.stop()
        self.kill_all()
        if self.launch is not None:
            self.launch.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.plane is not None:
            self.plane.close()
        atexit.unregister(self.kill_all)

    def kill_all(self) -> None:
        """SIGKILL and reap every runtime still alive (also the atexit safety net)."""
        for r in self.runtimes:
            if r.proc.poll() is None:
                logger.warning("%s (pid %d) did not stop; killing it", r.name, r.proc.pid)
                r.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(5.0)


def open_launcher(
    config: AmoeConfig, model_dir: str, plane: ControlPlane, num_runtimes: int, startup_timeout_s: float
) -> Launcher:
    """The launcher this config starts its runtimes with, its control endpoints bound on `plane`."""
    if not config.dist.multi_node:
        return LocalLauncher.on_plane(config, model_dir, plane, startup_timeout_s)
    if config.dist.backend == "ray":
        return RayLauncher(config, model_dir, plane, num_runtimes, startup_timeout_s)
    return AgentLauncher(config, model_dir, plane, num_runtimes, startup_timeout_s)


def live_placement(config: AmoeConfig) -> bool:
    """Whether the expert map can change while serving (docs/rebalancing.md): aep's experts are queues a replica
    can join; an offloading expert store owns its residency itself."""
    return config.parallel.mode == "aep" and config.offload.budget is None


def heals(config: AmoeConfig) -> bool:
    """Whether a lost runtime can be replaced while the others serve on: only an AEP runtime can rejoin a running
    cluster (a synchronous group has no place for a newcomer). The tensor plane does not matter: gloo / nccl groups
    are per pair, and a replacement gets new ones (docs/healing.md)."""
    return config.parallel.mode == "aep"


def no_healing_reason(config: AmoeConfig) -> str:
    """The one start-up line of a configuration that cannot heal (docs/healing.md)."""
    return (
        f"self-healing is off: --parallel {config.parallel.mode} runs its runtimes in lock-step, so a lost one "
        "cannot rejoin; it fails the cluster (requests end with a retryable 503, the server drains and exits 1); "
        "--parallel aep replaces lost runtimes"
    )


def _host(endpoint: str) -> str:
    """The address of a tcp://host:port endpoint."""
    return endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
