"""A runtime process: `python -m amoe.runtime.worker` with a WorkerSpec (JSON) on stdin, spawned by the coordinator's
cluster manager.

Start-up: name the process, die with the parent, load only this runtime's weights, build the communicator, say
Hello (data endpoint, KV blocks), receive the peer table (Welcome), connect, start the engine and the loop thread,
say Ready. Then the main thread serves control commands and heartbeats until Shutdown. Any failure is reported as
one Failed message and exit code 1.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import Any

import torch
import zmq

from amoe import core, wire
from amoe.config import AmoeConfig
from amoe.errors import EngineDeadError, TransportError
from amoe.log import setup_logging
from amoe.runtime import build
from amoe.runtime.build import max_model_len  # noqa: F401 - re-exported for the coordinator
from amoe.runtime.control import Channel, serve_commands, token_reporter
from amoe.runtime.loop import run_loop
from amoe.runtime.report import RuntimeReporter

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class Runtime:
    """One AEP runtime's engine, executor (torch or emulated), communicator and loop thread."""

    def __init__(self, spec: wire.WorkerSpec) -> None:
        self.id, self.role = spec.runtime, spec.role
        self.config = AmoeConfig.from_dict(spec.config)
        self.emulation = (
            build.emulation(self.config, spec.model_dir) if build.is_emulated(self.config) else None
        )
        self.model_config = build.runtime_model_config(self.config, spec.model_dir)
        par = self.config.parallel
        self.placement = core.Placement.disaggregated(
            par.attn_ranks, par.expert_ranks, self.model_config.num_experts
        )
        self.comm = communicator(spec, self.placement.num_runtimes, self.config, self.emulation)
        self.engine = core.Engine(self._engine_config(), self.comm)
        self.executor = self._executor(spec.model_dir)
        self.reporter = RuntimeReporter(self.id, self.engine, self.executor, self.comm)  # times each layer
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _engine_config(self) -> core.EngineConfig:
        cfg, sched = self.model_config, self.config.scheduler
        return core.engine_config(
            self.id, self.placement, num_blocks=cfg.num_blocks, num_experts=cfg.num_experts, top_k=cfg.top_k,
            hidden=cfg.hidden_size, policy=sched.policy, lookahead=sched.lookahead, decay=sched.decay,
            attn_cap=sched.attn_batch_cap, expert_cap=sched.expert_batch_cap,
        )  # fmt: skip

    def _executor(self, model_dir: str) -> Any:
        cfg, em = self.model_config, self.emulation
        if self.role == "attention":
            return build.attention_executor(self.config, model_dir, cfg, self.engine, em)
        experts = list(self.placement.experts_of(self.id))
        return build.expert_executor(self.config, model_dir, cfg, experts, em)

    @property
    def kv_blocks(self) -> int:
        return self.executor.blocks.num_total_blocks if self.role == "attention" else 0

    def start(self, endpoints: list[str], on_output) -> None:
        self.comm.connect(endpoints)
        if self.role == "attention":
            self.executor.on_output = on_output
        self.engine.start()
        self._thread = threading.Thread(target=self._loop, name=f"amoe-loop-{self.id}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            run_loop(self.engine, self.reporter, self._stop)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread as Failed, then exit
            self.error = exc

    def check(self) -> None:
        """Raise if the loop thread died."""
        if self.error is not None:
            raise EngineDeadError(f"the runtime loop failed: {type(self.error).__name__}: {self.error}")

    def stats(self) -> dict[str, Any]:
        """The runtime report of docs/CONTRACTS.md "Runtime stats"."""
        report = self.reporter.report()
        if self.emulation is not None:
            report["emulated"] = self.executor.stats()
        return report

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        self.engine.stop()
        self.comm.close()  # says goodbye, so peers tell a clean stop from a death


def make_runtime(spec: wire.WorkerSpec) -> Any:
    """The runtime of the configured mode: AEP (C++ engine) or a synchronous baseline (ep / pingpong)."""
    mode = AmoeConfig.from_dict(spec.config).parallel.mode
    if mode in ("ep", "pingpong"):
        from amoe.runtime.sync_runtime import SyncRuntime

        return SyncRuntime(spec)
    return Runtime(spec)


def communicator(spec: wire.WorkerSpec, num_runtimes: int, config: AmoeConfig, em: Any = None) -> Any:
    """This runtime's ZmqCommunicator; with an emulation `em`, its links hold messages for their time in flight."""
    plane = config.transport.plane
    make = getattr(core, "ZmqCommunicator", None) or getattr(core._core, "ZmqCommunicator", None)
    if make is None:
        raise TransportError("this build of amoe._core has no ZmqCommunicator; rebuild with `make install`")
    group = None if plane == "inline" else _process_group(spec, num_runtimes, plane)
    comm = make(
        spec.runtime, num_runtimes, bind=spec.data_bind, plane=plane, process_group=group,
        timeout_s=config.transport.timeout_s,
    )  # fmt: skip
    if em is not None:
        # Loopback delivers at once; an emulated GPU's messages should take the time its links would.
        comm.set_link_delays(*build.link_delays(config, em, spec.runtime))
    return comm


def _process_group(spec: wire.WorkerSpec, num_runtimes: int, plane: str) -> Any:
    """The gloo / nccl group of every runtime, met through the coordinator's TCPStore."""
    import torch.distributed as dist

    timeout = timedelta(seconds=spec.startup_timeout_s)
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
    store = dist.PrefixStore(spec.store_prefix, store)
    dist.init_process_group(plane, store=store, rank=spec.runtime, world_size=num_runtimes, timeout=timeout)
    return dist.group.WORLD


def name_process(title: str) -> None:
    """So `ps` shows the role: the full title via setproctitle, else at least the 15-char comm name."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the coordinator dies (even by SIGKILL), so no runtime is ever orphaned."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


def run(spec: wire.WorkerSpec) -> int:
    """Start, serve until Shutdown; 0 on a clean stop, 1 after reporting a failure."""
    ctx = zmq.Context()
    identity = f"rt{spec.runtime}".encode()
    control = Channel(ctx, spec.coordinator, identity)
    outputs = Channel(ctx, spec.coordinator, identity + b".out")  # the loop thread's own socket
    runtime = None
    try:
        runtime = make_runtime(spec)
        control.send(
            wire.Hello(spec.runtime, spec.role, os.getpid(), runtime.comm.endpoint, runtime.kv_blocks)
        )
        welcome = control.wait_for(wire.Welcome, spec.startup_timeout_s)
        runtime.start(welcome.endpoints, token_reporter(outputs, spec.runtime, runtime.executor))
        control.send(wire.Ready(spec.runtime))
        logger.debug("runtime %d: %s runtime up", spec.runtime, spec.role)
        serve_commands(control, runtime)
        return 0
    except Exception as exc:  # noqa: BLE001 - any failure becomes one Failed line at the coordinator
        # The coordinator prints the one line users see; the traceback is for -v.
        logger.debug("runtime %d: failed", spec.runtime, exc_info=exc)
        control.send(wire.Failed(spec.runtime, f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        if runtime is not None:
            runtime.stop()
        control.close()
        outputs.close()
        ctx.term()


def main() -> int:
    spec = wire.decode_spec(sys.stdin.buffer.read())
    name_process(f"amoe: {spec.role} runtime {spec.runtime}")
    die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the coordinator drains us
    setup_logging()
    threads = AmoeConfig.from_dict(spec.config).parallel.threads_per_rank
    torch.set_num_threads(threads)
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
