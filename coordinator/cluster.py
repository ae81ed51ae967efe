"""Cluster manager: spawns the runtime processes of the placement, wires them (control ROUTER, peer table, a
FileStore in the private run directory for gloo / nccl), tracks their heartbeats and stats, notices a runtime that died, and stops them all.

Everything runs on the API's asyncio event loop: one ROUTER socket (zmq.asyncio), a reader task that decodes
runtime messages, and a watchdog task that polls each process and its heartbeat age. Runtimes are started in
parallel (each imports torch and loads its weights) from the event loop's thread, which lives as long as they do:
their PR_SET_PDEATHSIG is tied to the thread that forked them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from amoe import wire
from amoe.config import AmoeConfig
from amoe.errors import AmoeError
from amoe.placement import runtime_roles

logger = logging.getLogger(__name__)

_WATCH_S = 0.1  # how often processes are polled: a killed runtime is noticed within this


@dataclass
class RuntimeProc:
    """One runtime process as the coordinator sees it."""

    id: int
    role: str  # "attention" | "expert"
    proc: subprocess.Popen
    endpoint: str | None = None  # set by Hello, with the three below
    num_kv_blocks: int = 0
    max_model_len: int = 0
    vocab_size: int = 0
    kv_free: int = 0  # the latest of its heartbeat and token reports
    ready: bool = False
    last_seen: float = field(default_factory=time.monotonic)  # any message (the control thread is alive)
    polls: int = 0  # the loop thread's progress counter, from heartbeats
    progressed: float = field(default_factory=time.monotonic)  # when it last moved (the loop is alive)
    stats: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"{self.role} runtime {self.id}"

    def describe(self) -> dict[str, Any]:
        code = self.proc.poll()
        return {
            "runtime": self.id,
            "role": self.role,
            "pid": self.proc.pid,
            "alive": code is None,
            "exit": None if code is None else _exit_text(code),
            "ready": self.ready,
            "heartbeat_age_s": round(time.monotonic() - self.last_seen, 3),
            "loop_progress_age_s": round(time.monotonic() - self.progressed, 3),
        }


class ClusterManager:
    """The runtimes of one `amoe serve`: attention runtimes 0..A-1, then expert runtimes A..A+M-1 (none in ep)."""

    def __init__(
        self,
        config: AmoeConfig,
        model_dir: str | Path,
        on_tokens: Callable[[wire.TokenOut], None],
        on_death: Callable[[str], None],
        *,
        control_bind: str = "ipc",
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.config = config
        self.model_dir = str(model_dir)
        # aep / pingpong: A attention + M expert runtimes; ep: N runtimes that each take requests and host experts.
        self.roles = list(runtime_roles(config.parallel))
        self._on_tokens = on_tokens
        self._on_death = on_death
        self._control_bind = control_bind
        self._startup_timeout_s = startup_timeout_s
        # A dead runtime stops beating; process exit is noticed sooner by polling.
        self._heartbeat_timeout_s = max(config.transport.timeout_s, 5.0)
        self.runtimes: list[RuntimeProc] = []
        self.failure: str | None = None
        self.num_dropped = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tmpdir: str | None = None  # the private run directory (0700): control socket, rendezvous file
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._started = False

    @property
    def attn_runtimes(self) -> list[RuntimeProc]:
        return [r for r in self.runtimes if r.role == "attention"]

    # ---- start-up

    async def start(self) -> None:
        """Spawn, wire and wait for every runtime; on any failure stop them all and raise one clear AmoeError."""
        atexit.register(self.kill_all)
        try:
            endpoint = self._bind()
            self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]
            logger.info("starting %d %s runtimes (%d attention, %d expert)", len(self.roles),
                        self.config.parallel.mode, self.roles.count("attention"),
                        self.roles.count("expert"))  # fmt: skip
            self._spawn_all(endpoint)
            await self._wait_for(lambda r: r.endpoint is not None, "load its weights")
            self.broadcast(wire.Welcome([r.endpoint for r in self.runtimes]))
            await self._wait_for(lambda r: r.ready, "connect to its peers")
        except BaseException:
            await self.shutdown(timeout_s=2.0)
            raise
        self._started = True
        logger.info("all %d runtimes up", len(self.runtimes))

    def _bind(self) -> str:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._tmpdir = tempfile.mkdtemp(prefix="amoe-")  # private (0700): only this user's processes
        if self._control_bind == "ipc":
            endpoint = f"ipc://{self._tmpdir}/control"
            self._sock.bind(endpoint)
        else:
            host = self._control_bind.removeprefix("tcp://").rsplit(":", 1)[0]
            port = self._sock.bind_to_random_port(f"tcp://{host}")
            endpoint = f"tcp://{host}:{port}"
        logger.debug("control plane on %s", endpoint)
        return endpoint

    def _spawn_all(self, endpoint: str) -> None:
        tcp_host = self._control_bind.rsplit(":", 1)[0]
        # gloo / nccl rendezvous: a file in the private run directory (torch's FileStore), so nothing listens on
        # the network for it and the coordinator needs no torch.
        store = os.path.join(self._tmpdir, "rendezvous") if self.config.transport.plane != "inline" else None
        for runtime, role in enumerate(self.roles):
            spec = wire.WorkerSpec(
                runtime=runtime, role=role, coordinator=endpoint, model_dir=self.model_dir,
                config=self.config.to_dict(), parent_pid=os.getpid(), store_path=store,
                # ipc sockets live in the private run directory: only this user's processes can reach them
                data_bind=f"ipc://{self._tmpdir}/rt{runtime}.data" if self._control_bind == "ipc" else f"{tcp_host}:0",
                startup_timeout_s=self._startup_timeout_s,
            )  # fmt: skip
            proc = subprocess.Popen(
                [sys.executable, "-m", "amoe.runtime.worker"], stdin=subprocess.PIPE, close_fds=True
            )
            proc.stdin.write(wire.encode_spec(spec))  # a few kB: fits the pipe buffer, never blocks
            proc.stdin.close()
            self.runtimes.append(RuntimeProc(runtime, role, proc))

    async def _wait_for(self, done: Callable[[RuntimeProc], bool], what: str) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while not all(done(r) for r in self.runtimes):
            if self.failure is not None:
                raise AmoeError(f"a runtime failed to start: {self.failure}")
            if time.monotonic() > deadline:
                slow = ", ".join(r.name for r in self.runtimes if not done(r))
                raise AmoeError(f"{slow} did not {what} within {self._startup_timeout_s:.0f} s")
            await asyncio.sleep(0.02)

    # ---- messages

    def send(self, runtime: int, msg: wire.Message) -> None:
        """To one runtime's control socket; never blocks (a dead runtime's messages are dropped)."""
        identity = f"rt{runtime}".encode()
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([identity, wire.encode(msg)], flags=zmq.NOBLOCK)

    def broadcast(self, msg: wire.Message) -> None:
        for r in self.runtimes:
            self.send(r.id, msg)

    async def _read(self) -> None:
        while True:
            self.receive(await self._sock.recv_multipart())

    def receive(self, frames: list[bytes]) -> None:
        """Act on one control message [identity, message]; an invalid one is dropped and counted, never raised."""
        try:
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
        if isinstance(msg, (wire.Welcome, wire.AddRequest, wire.Abort, wire.Shutdown)):
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
            self._on_tokens(msg)
        elif isinstance(msg, wire.Heartbeat):
            self._beat(runtime, msg.stats)
        elif isinstance(msg, wire.Hello):
            runtime.endpoint, runtime.num_kv_blocks, runtime.kv_free = (
                msg.endpoint,
                msg.num_kv_blocks,
                msg.num_kv_blocks,
            )
            runtime.max_model_len, runtime.vocab_size = msg.max_model_len, msg.vocab_size
            loaded = sum(r.endpoint is not None for r in self.runtimes)
            logger.info(
                "%s loaded its weights (pid %d) [%d/%d]", runtime.name, msg.pid, loaded, len(self.runtimes)
            )
        elif isinstance(msg, wire.Ready):
            runtime.ready, runtime.progressed = True, time.monotonic()  # its loop starts now
        elif isinstance(msg, wire.Failed):
            self._fail(f"{runtime.name} failed: {msg.error}")

    def _beat(self, runtime: RuntimeProc, stats: dict[str, Any]) -> None:
        """A heartbeat's report: stats for /metrics, KV in use, the loop's progress, and peers it lost."""
        runtime.stats = stats
        if runtime.role == "attention":
            runtime.kv_free = max(0, runtime.num_kv_blocks - stats.get("kv_used_blocks", 0))
        polls = stats.get("polls", 0)
        if polls != runtime.polls:
            runtime.polls, runtime.progressed = polls, time.monotonic()
        lost = (stats.get("comm") or {}).get("failed_peers") or []
        if lost and runtime.ready:
            names = ", ".join(self.runtimes[p].name for p in lost if p < len(self.runtimes))
            self._fail(f"{runtime.name} lost its data link to {names}")

    # ---- death

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            if self._stopping:
                continue
            now = time.monotonic()
            for r in self.runtimes:
                code = r.proc.poll()
                if code is not None:
                    self._fail(f"{r.name} (pid {r.proc.pid}) {_exit_text(code)}")
                elif r.ready and now - r.last_seen > self._heartbeat_timeout_s:
                    self._fail(f"{r.name} (pid {r.proc.pid}) sent nothing for {now - r.last_seen:.1f} s")
                elif r.ready and now - r.progressed > self._heartbeat_timeout_s:
                    # Heartbeats come from the control thread; only the loop's own counter shows it still runs.
                    self._fail(
                        f"{r.name} (pid {r.proc.pid}): its loop made no progress for {now - r.progressed:.1f} s"
                    )

    def _fail(self, reason: str) -> None:
        if self.failure is not None or self._stopping:
            return
        self.failure = reason
        # During start-up `amoe serve` reports it as its one error line; afterwards the log is the report.
        logger.log(logging.ERROR if self._started else logging.DEBUG, "%s", reason)
        self._on_death(reason)

    # ---- shutdown

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Shutdown to every runtime, wait up to timeout_s, kill the stragglers, reap all; idempotent."""
        self._stopping = True
        if self._sock is not None:
            self.broadcast(wire.Shutdown())
        deadline = time.monotonic() + timeout_s
        while any(r.proc.poll() is None for r in self.runtimes) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.kill_all()
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


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
