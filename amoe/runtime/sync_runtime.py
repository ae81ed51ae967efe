"""A runtime process of `--parallel ep|pingpong`: one device of the synchronous baselines (docs/baselines.md,
"Hook for the process runtime") behind the same control plane as an AEP runtime.

The worker's main thread drives it exactly like the AEP runtime (amoe/runtime/aep_runtime.py: Hello, Welcome,
`start`, commands, heartbeats, `stop`). The loop thread runs `run_sync_loop` over the ZeroMQ communicator instead of
the C++ engine's μ-queues.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from amoe import wire
from amoe.config import AmoeConfig
from amoe.errors import EngineDeadError
from amoe.runtime import build
from amoe.runtime.comm import communicator
from amoe.runtime.requests import HeadOutput, RankCapacity, RankRequest
from amoe.runtime.sync import SyncDevice, run_sync_loop
from amoe.runtime.sync.rebalance import stop_the_world
from amoe.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class SyncRuntime(RankCapacity):
    """One device of ep (attention rank + its experts) or pingpong (attention rank, or expert device)."""

    def __init__(self, spec: wire.WorkerSpec) -> None:
        self.id, self.role = spec.runtime, spec.role
        self.config = AmoeConfig.from_dict(spec.config)
        self.mode = self.config.parallel.mode
        self.emulation = build.emulation(self.config, spec.model_dir)
        self.model_config = cfg = build.runtime_model_config(self.emulation, spec.model_dir)
        self.placement = place = build.placement(self.config, cfg.num_expert_ids)
        self.gpu = build.device(self.config, self.id)  # the torch device; current before any CUDA work
        self.comm, self.groups = communicator(spec, place.num_runtimes, self.config, self.emulation)
        self.device = self._device(spec.model_dir)
        if self.config.eplb.live:  # a lock-step group moves experts only by stopping (docs/rebalancing.md)
            load = build.expert_loader(self.config, spec.model_dir, cfg, self.emulation, None, self.gpu)
            stop_the_world([self.device], self.config.eplb, place, cfg, self.mode, self.emulation, load)
        self.pipeline = build.ep_pipeline(self.config, place, cfg, self.emulation)
        self.attention = self.device.attention  # None on an expert device
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _device(self, model_dir: str) -> SyncDevice:
        cfg, place, em = self.model_config, self.placement, self.emulation
        hosted = place.experts_of(self.id)
        rank = place.attn_rank_of(self.id)
        attention = experts = None
        if hosted:  # first: in EP the KV cache gets what the experts leave of the device's memory
            experts = build.expert_executor(self.config, model_dir, cfg, hosted, em, self.gpu, self.id)
        if rank is not None:
            local = hosted if self.mode == "ep" else []  # EP: the experts share the GPU's memory
            attention = build.attention_executor(
                self.config, model_dir, cfg, em, local, dev=self.gpu, runtime=self.id
            )
        return SyncDevice(
            self.id, cfg, place.expert_runtime, attn_devices=place.attn_runtime, expert_devices=place.hosts,
            attention=attention, experts=experts, attn_rank=rank or 0,
            max_batch_rows=self.config.scheduler.attn_batch_cap,
        )  # fmt: skip

    # ---- what the control plane asks of a runtime (amoe.runtime.interface.Runtime)

    def add_request(
        self,
        request_id: int,
        prompt: list[int],
        params: SamplingParams,
        num_generated: int = 0,
        seq_ids: Sequence[int] = (),
    ) -> RankRequest:
        return self.device.add_request(request_id, prompt, params, num_generated, seq_ids)

    def reconnect(self, runtime: int, endpoint: str, generation: int = 0) -> int:
        raise EngineDeadError("a synchronous group cannot take a replaced device: it restarts as a whole")

    def resend_overdue(self) -> None:
        """Nothing to ask again: a synchronous iteration ends all together or not at all."""

    def abort(self, request_id: int) -> bool:
        return self.device.abort(request_id)

    def expire_aborts(self) -> list[int]:
        """Nothing expires here: every device leaves an iteration together, so an aborted request always reaches
        its head within the iteration (or the whole group stops)."""
        return []

    def place(self, msg: wire.Message) -> None:
        raise EngineDeadError("a synchronous group has no live placement (docs/rebalancing.md)")

    def placement_replies(self) -> list[wire.Message]:
        return []

    @property
    def placement_busy(self) -> bool:
        return False

    @property
    def hosted_layers(self) -> list[tuple[int, int]]:
        return []  # a synchronous group's experts never move

    def start(
        self,
        endpoints: list[str],
        generations: list[int],
        publish: Callable[[HeadOutput], None],
        placement: wire.PlacementState | None = None,
    ) -> None:
        self.comm.connect(endpoints)
        if self.groups is not None:
            self.groups.connect(generations)
        self._thread = threading.Thread(
            target=self._loop, args=(publish,), name=f"amoe-{self.mode}-{self.id}", daemon=True
        )
        self._thread.start()

    def _loop(self, publish: Callable[[HeadOutput], None]) -> None:
        par, timeout = self.config.parallel, self.config.transport.timeout_s
        try:
            run_sync_loop(
                self.mode,
                self.device,
                self.comm,
                self._stop,
                publish,
                micro_batches=par.micro_batches,
                timeout_s=timeout,
                pipeline=self.pipeline,
            )
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread as Failed, then exit
            self.error = exc
        else:
            if not self._stop.is_set():  # a peer stopped the group: nothing is served any more
                self.error = EngineDeadError("a peer left the synchronous group")

    def linked(self) -> bool:
        """Every peer's tensor-plane link is built (always, on the inline plane)."""
        return self.groups is None or self.groups.linked()

    def check(self) -> None:
        """Raise if the loop thread died, or a start-up group could not be made."""
        if self.error is not None:
            raise EngineDeadError(f"the runtime loop failed: {type(self.error).__name__}: {self.error}")
        if self.groups is not None:
            self.groups.check()

    def stats(self) -> dict[str, Any]:
        """The runtime report (docs/CONTRACTS.md): the device's barrier stats, KV, the communicator's, and its
        stop-the-world rebalances."""
        snap = self.device.stats.snapshot()
        report: dict[str, Any] = {
            "runtime": self.id,
            "role": self.role,
            "mode": self.mode,
            "incarnation": self.incarnation,
            "busy_s": snap["busy_s"],
            "uptime_s": time.monotonic() - self._started,  # read with busy_s: see RuntimeReporter.report
            "idle_s": snap["idle_s"],
            "wait_s": snap["wait_s"],
            "stall_fraction": snap["stall_fraction"],
            "barrier_idle_s": snap["barrier_idle_s"],
            "attention_idle_s": snap["attention_idle_s"],
            "iterations": snap["iterations"],
            "polls": snap["polls"],
            "dropped": {"barrier": snap["dropped"]},
            "rebalances": {k: snap[k] for k in ("rebalances", "rebalance_s", "moved_bytes")},
            "comm": self.comm.stats(),
        }
        if self.attention is not None:
            blocks = self.attention.requests.blocks
            report["kv_total_blocks"] = blocks.num_total_blocks
            report["kv_used_blocks"] = blocks.num_total_blocks - blocks.num_free_blocks
            report["routed"] = self.attention.routed.tolist()
            report["waiting_chunks"] = len(self.device.inbox)  # the synchronous modes' only queue
        if self.emulation is not None:
            parts = (("attention", self.device.attention), ("experts", self.device.experts))
            report["emulated"] = {kind: ex.stats() for kind, ex in parts if ex is not None}
        return report

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # The group leaves together at the next BEGIN; a peer already gone makes it wait out the timeout.
            self._thread.join(self.config.transport.timeout_s + 5.0)
        self.comm.close()
