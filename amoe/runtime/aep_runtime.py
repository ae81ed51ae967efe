"""One AEP runtime (`--parallel aep`): its C++ engine, executor (torch or emulated), communicator and loop thread.

The worker's main thread drives it (amoe/runtime/worker.py): build, `start(endpoints, publish)`, then requests and
heartbeats from the control plane until `stop()`. The loop thread runs `run_loop`; sampled tokens leave through
`publish`, the function the worker hands to `start`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from amoe import core, wire
from amoe.config import AmoeConfig
from amoe.errors import EngineDeadError
from amoe.placement import runtime_slots
from amoe.runtime import build
from amoe.runtime.comm import communicator
from amoe.runtime.loop import run_loop
from amoe.runtime.replicas import AttentionReplicas, ExpertReplicas
from amoe.runtime.report import RuntimeReporter
from amoe.runtime.requests import HeadOutput, RankCapacity, RankRequest
from amoe.sampling_params import SamplingParams


class AepRuntime(RankCapacity):
    """One AEP runtime: attention rank r (requests enter here) or a set of experts."""

    def __init__(self, spec: wire.WorkerSpec) -> None:
        self.id, self.role = spec.runtime, spec.role
        self.config = AmoeConfig.from_dict(spec.config)
        self.emulation = build.emulation(self.config, spec.model_dir)
        self.model_config = cfg = build.runtime_model_config(self.emulation, spec.model_dir)
        self.placement = build.placement(self.config, cfg.num_expert_ids)
        self.expert_map = build.expert_map(self.config, self.placement, cfg)  # the coordinator's, at Welcome
        self.device = build.device(
            self.config, self.id
        )  # current before any CUDA work (the NCCL group's too)
        # Every slot the cluster may grow to (`amoe scale`): a runtime that joins later is a slot filled.
        self.slots = runtime_slots(self.config.parallel)
        self.comm, self.groups = communicator(spec, self.slots, self.config, self.emulation)
        self.engine = core.Engine(
            core.engine_config(
                self.id, self.placement, num_blocks=cfg.num_blocks, num_experts=cfg.num_expert_ids,
                top_k=cfg.experts_per_token, hidden=cfg.hidden_size, scheduler=self.config.scheduler,
                track_requests=self.role == "attention",
                time_scale=self.config.emulation.time_scale if self.emulation is not None else 1.0,
                max_requests=self.config.cache.max_num_seqs, expert_map=self.expert_map,
            ),
            self.comm,
        )  # fmt: skip
        if self.role == "attention":
            self.attention = build.attention_executor(
                self.config, spec.model_dir, cfg, self.emulation, dev=self.device, runtime=self.id
            )
            executor = self.attention
            self.replicas = AttentionReplicas(self.id, self.engine, self.expert_map, self.slots)
        else:
            self.attention = None
            experts, hosted = self.placement.experts_of(self.id), self.expert_map.hosted_by(self.id)
            executor = build.expert_executor(
                self.config, spec.model_dir, cfg, experts, self.emulation, self.device, runtime=self.id,
                layers=hosted,
            )  # fmt: skip
            load = build.expert_loader(
                self.config, spec.model_dir, cfg, self.emulation, executor, self.device
            )
            shape = (cfg.num_blocks, cfg.num_expert_ids)
            self.replicas = ExpertReplicas(self.id, self.engine, executor, load, hosted, shape)
        self.executor = executor
        self.reporter = RuntimeReporter(self.id, self.engine, executor, self.comm)  # times each layer
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ---- what the control plane asks of a runtime (amoe.runtime.interface.Runtime)

    def add_request(
        self,
        request_id: int,
        prompt: list[int],
        params: SamplingParams,
        num_generated: int = 0,
        seq_ids: Sequence[int] = (),
    ) -> RankRequest:
        """Bind a request to this attention rank; its prompt enters ATTN (0, rank). Control thread."""
        req, rows = self.attention.requests.add(request_id, prompt, params, num_generated, seq_ids)
        core.enter(self.engine, rows)
        return req

    def abort(self, request_id: int) -> bool:
        return self.attention.requests.abort(request_id)

    def expire_aborts(self) -> list[int]:
        """Aborted requests whose tokens never came back (lost with a failed peer or batch) end after
        server.abort_timeout_s: the engine forgets them (and drops whatever of them still waits), then their KV
        is freed (at once, or when the batch running them ends). Control thread; returns their ids."""
        if self.attention is None:
            return []
        requests = self.attention.requests
        expired = requests.expire_aborts(self.config.server.abort_timeout_s)
        if expired:
            self.engine.forget(
                torch.tensor(expired, dtype=torch.int64), purge=True
            )  # no batch gets them again
            requests.collect_expired()
        return expired

    def reconnect(self, runtime: int, endpoint: str, generation: int = 0) -> int:
        """A peer was replaced (by its process of `generation`): send to its new process, and (attention) ask it
        again for every expert output the old one never answered. Returns the rows sent again. Control thread:
        never waits for the peer (on a gloo / nccl plane the new group is built on a thread of its own, and the
        rows wait for it in the communicator)."""
        self.comm.reconnect(runtime, endpoint, generation)
        if self.groups is not None:
            self.groups.rebuild(runtime, generation)
        return self.engine.resend(runtime, 0.0) if self.attention is not None else 0

    def resend_overdue(self) -> None:
        """Ask again for expert outputs awaited longer than transport.timeout_s (a lost message)."""
        if self.attention is not None:
            self.engine.resend(-1, self.config.transport.timeout_s)

    def place(self, msg: wire.Message) -> None:
        """A placement command (control thread): joins and drains (amoe.runtime.replicas)."""
        self.replicas.apply(msg)

    def placement_replies(self) -> list[wire.Message]:
        return self.replicas.replies()

    @property
    def placement_busy(self) -> bool:
        return self.replicas.busy

    @property
    def hosted_layers(self) -> list[tuple[int, int]]:
        return sorted(self.replicas.hosted) if self.attention is None else []

    def start(
        self,
        endpoints: list[str],
        generations: list[int],
        publish: Callable[[HeadOutput], None],
        placement: wire.PlacementState | None = None,
    ) -> None:
        """Connect (the tensor-plane groups build in the background: see `linked`), take on the coordinator's
        placement, and start the loop."""
        self.comm.connect(endpoints)  # an empty endpoint: a slot no runtime holds (yet, or any more)
        if self.groups is not None:
            self.groups.connect({r: g for r, (e, g) in enumerate(zip(endpoints, generations)) if e})
        if placement is not None:
            if self.attention is not None:
                self.replicas.settle(placement.replicas)
            else:
                self.replicas.settle(tuple(layer) for layer in placement.hosted)
        self.engine.start()
        self._thread = threading.Thread(
            target=self._loop, args=(publish,), name=f"amoe-loop-{self.id}", daemon=True
        )
        self._thread.start()

    def _loop(self, publish: Callable[[HeadOutput], None]) -> None:
        try:
            run_loop(self.engine, self.reporter, self._stop, publish, between=self.replicas.between_batches)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread as Failed, then exit
            self.error = exc

    def linked(self) -> bool:
        """Every peer's tensor-plane link is built (always, on the inline plane): the runtime may say Ready."""
        return self.groups is None or self.groups.linked()

    def check(self) -> None:
        """Raise if the loop thread died, or a start-up group could not be made."""
        if self.error is not None:
            raise EngineDeadError(f"the runtime loop failed: {type(self.error).__name__}: {self.error}")
        if self.groups is not None:
            self.groups.check()

    def stats(self) -> dict[str, Any]:
        """The runtime report of docs/CONTRACTS.md "Runtime stats"."""
        report = self.reporter.report()
        if self.emulation is not None:
            report["emulated"] = self.executor.stats()
        elif self.attention is None:
            report.update(self.executor.stats())  # "offload": the expert store's counters, when it offloads
        if self.attention is None:  # a join's progress, which its deadline follows
            report["loaded_layers"] = self.replicas.loaded_layers
        return report

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        self.engine.stop()
        offload = getattr(self.executor, "offload", None)
        if offload is not None:
            offload.close()  # the store's I/O thread; the routing record's file
        self.comm.close()  # says goodbye, so peers tell a clean stop from a death
