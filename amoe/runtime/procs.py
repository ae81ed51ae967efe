"""Runtimes as separate local processes, wired by ZmqCommunicator: attention ranks and expert ranks of one model,
each a process with its own engine, executor and main loop. The test and experiment counterpart of
`InProcessCluster`; `amoe serve` uses the cluster manager and `amoe.runtime.worker` instead.

The parent talks to its children over `multiprocessing` pipes (prompts in, generated tokens and stats out):
plumbing between a process and the ones it spawned. Runtimes talk to each other only through the communicator.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from amoe import core
from amoe.errors import EngineDeadError
from amoe.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeSpec:
    """What one runtime process needs to build itself (sent once over its pipe)."""

    runtime: int
    model_dir: str
    num_attn_ranks: int
    num_expert_ranks: int
    plane: str
    store_port: int  # TCPStore of the parent for the gloo / nccl group; 0 for inline
    policy: str
    kv_blocks: int
    block_size: int
    timeout_s: float
    num_threads: int


def _build(spec: RuntimeSpec):
    """The communicator, engine and executor of one runtime (runs in the child)."""
    from amoe.model.config import load_model_config
    from amoe.model.layers import build_attention_rank, build_expert_layers
    from amoe.runtime.executors import AttentionExecutor, ExpertExecutor

    cfg = load_model_config(spec.model_dir)
    placement = core.Placement.disaggregated(spec.num_attn_ranks, spec.num_expert_ranks, cfg.num_experts)
    group = None
    if spec.plane != "inline":
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False)
        dist.init_process_group(spec.plane, store=store, rank=spec.runtime, world_size=placement.num_runtimes)
        group = dist.group.WORLD
    comm = core.ZmqCommunicator(
        spec.runtime, placement.num_runtimes, bind="ipc", plane=spec.plane, process_group=group,
        timeout_s=spec.timeout_s,
    )  # fmt: skip
    ecfg = core.engine_config(
        spec.runtime, placement, num_blocks=cfg.num_blocks, num_experts=cfg.num_experts, top_k=cfg.top_k,
        hidden=cfg.hidden_size, policy=spec.policy,
    )  # fmt: skip
    engine = core.Engine(ecfg, comm)
    if ecfg.is_attention:
        max_len = min(cfg.max_position_embeddings, spec.kv_blocks * spec.block_size)
        model = build_attention_rank(spec.model_dir, cfg)
        executor = AttentionExecutor(engine, model, cfg, spec.kv_blocks, spec.block_size, max_len)
    else:
        executor = ExpertExecutor(build_expert_layers(spec.model_dir, cfg, ecfg.experts))
    return comm, engine, executor


def _runtime_main(spec: RuntimeSpec, conn) -> None:
    """A runtime process: build, report the endpoint, connect, serve, then answer the parent's commands."""
    from amoe.runtime.loop import run_loop

    torch.set_num_threads(spec.num_threads)
    try:
        comm, engine, executor = _build(spec)
    except BaseException:  # noqa: BLE001 - the parent raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("endpoint", comm.endpoint))
    comm.connect(conn.recv())
    stop = threading.Event()
    loop = threading.Thread(target=run_loop, args=(engine, executor, stop), daemon=True)
    engine.start()
    loop.start()
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "generate":
            try:
                reqs = [executor.add_request(rid, prompt, params) for rid, prompt, params in arg]
                conn.send(("outputs", [r.output if r.done.wait(spec.timeout_s * 6) else None for r in reqs]))
            except BaseException:  # noqa: BLE001 - the parent raises it
                conn.send(("error", traceback.format_exc()))
        elif cmd == "stats":
            conn.send(("stats", {"engine": engine.stats(), "comm": comm.stats()}))
        else:
            break
    stop.set()
    loop.join(10)
    engine.stop()
    stats = {"engine": engine.stats(), "comm": comm.stats()}
    comm.close()
    conn.send(("stopped", stats))


class ProcessCluster:
    """`num_attn_ranks` attention and `num_expert_ranks` expert runtimes, one process each, over `plane`."""

    def __init__(
        self,
        model_dir: str | Path,
        num_attn_ranks: int = 2,
        num_expert_ranks: int = 3,
        *,
        plane: str = "inline",
        policy: str = "defrag",
        kv_blocks: int = 256,
        block_size: int = 16,
        timeout_s: float = 10.0,
        num_threads: int = 1,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if plane not in ("inline", "gloo"):
            raise ValueError(f"ProcessCluster runs on the CPU planes 'inline' and 'gloo', not {plane!r}")
        self.num_attn_ranks = num_attn_ranks
        self.num_runtimes = num_attn_ranks + num_expert_ranks
        self.startup_timeout_s = startup_timeout_s
        self._store = None
        if plane != "inline":
            import torch.distributed as dist

            # Rendezvous for the process group; port 0 = any free port, the children get the real one.
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._specs = [
            RuntimeSpec(
                r,
                str(model_dir),
                num_attn_ranks,
                num_expert_ranks,
                plane,
                self._store.port if self._store else 0,
                policy,
                kv_blocks,
                block_size,
                timeout_s,
                num_threads,
            )  # fmt: skip
            for r in range(self.num_runtimes)
        ]
        self._conns: list[Any] = []
        self._procs: list[mp.process.BaseProcess] = []
        self._ids = itertools.count(1)
        self.final_stats: list[dict] = []

    def start(self) -> ProcessCluster:
        """Spawns every runtime at once (each imports torch), wires their endpoints, waits until all serve."""
        ctx = mp.get_context("spawn")  # never fork a process that has torch threads
        for spec in self._specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_runtime_main, args=(spec, child), name=f"amoe-rt-{spec.runtime}")
            proc.daemon = True
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            endpoints = [
                self._expect(r, "endpoint", self.startup_timeout_s) for r in range(self.num_runtimes)
            ]
            for conn in self._conns:
                conn.send(endpoints)
            for r in range(self.num_runtimes):
                self._expect(r, "ready", self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _expect(self, runtime: int, kind: str, timeout: float) -> Any:
        conn, deadline = self._conns[runtime], time.monotonic() + timeout
        while not conn.poll(0.1):
            if not self._procs[runtime].is_alive() or time.monotonic() > deadline:
                raise EngineDeadError(
                    f"runtime {runtime} did not send {kind!r} (alive: {self._procs[runtime].is_alive()})"
                )
        got, arg = conn.recv()
        if got == "error":
            raise EngineDeadError(f"runtime {runtime} failed:\n{arg}")
        if got != kind:
            raise EngineDeadError(f"runtime {runtime} sent {got!r} instead of {kind!r}")
        return arg

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | None = None, timeout: float = 120.0
    ) -> list[list[int]]:
        """Token ids generated for each prompt; prompt i is bound to attention rank i mod num_attn_ranks."""
        params = params or SamplingParams(temperature=0)
        per_rank: list[list[tuple[int, int, list[int], SamplingParams]]] = [
            [] for _ in range(self.num_attn_ranks)
        ]
        for i, prompt in enumerate(prompts):
            per_rank[i % self.num_attn_ranks].append((i, next(self._ids), prompt, params))
        for rank, items in enumerate(per_rank):
            if items:
                self._conns[rank].send(("generate", [(rid, p, sp) for _, rid, p, sp in items]))
        out: list[list[int] | None] = [None] * len(prompts)
        for rank, items in enumerate(per_rank):
            if not items:
                continue
            for (i, *_), tokens in zip(items, self._expect(rank, "outputs", timeout)):
                if tokens is None:
                    raise EngineDeadError(
                        f"prompt {i} did not finish on attention rank {rank}: {self.stats()}"
                    )
                out[i] = tokens
        return out  # type: ignore[return-value]

    def stats(self) -> list[dict]:
        """Per runtime: {"engine": Engine.stats(), "comm": ZmqCommunicator.stats()}."""
        for conn in self._conns:
            conn.send(("stats", None))
        return [self._expect(r, "stats", 30.0) for r in range(self.num_runtimes)]

    def stop(self) -> None:
        """Stops every runtime (final stats in `final_stats`); kills what does not exit. Idempotent."""
        if not self._procs:
            return
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(("stop", None))
        stats = []
        for r, proc in enumerate(self._procs):
            try:
                stats.append(self._expect(r, "stopped", 30.0))
            except EngineDeadError as exc:
                logger.warning("[procs] %s", exc)
                stats.append({})
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.final_stats = stats
        self._procs, self._conns = [], []

    __enter__ = start

    def __exit__(self, *exc) -> None:
        self.stop()
