"""Several virtual runtimes in one process: attention ranks and expert ranks, each a C++ engine plus a Python
thread running the real main loop, wired by the loopback communicator. For tests and single-host experiments."""

from __future__ import annotations

import itertools
import logging
import threading
from pathlib import Path

import torch

from amoe import core
from amoe import device as devices
from amoe.config import SchedulerSection
from amoe.errors import ConfigError, EngineDeadError
from amoe.model.config import load_model_config
from amoe.model.layers import build_attention_rank, build_expert_layers
from amoe.placement import Placement
from amoe.runtime.executors import AttentionExecutor, ExpertExecutor, TorchAttention
from amoe.runtime.loop import run_loop
from amoe.runtime.report import RuntimeReporter
from amoe.runtime.requests import HeadOutput, RankRequest, RankRequests
from amoe.sampling_params import SamplingParams
from amoe.structured import Grammars

logger = logging.getLogger(__name__)


def _attention_executor(
    runtime: int, model_dir: str | Path | None, cfg, emulation, num_kv_blocks: int, block_size: int,
    dtype: torch.dtype | None,
) -> AttentionExecutor:  # fmt: skip
    """An attention runtime's executor: its requests' state over `num_kv_blocks` KV blocks, and its attention
    computed by torch on the checkpoint or by the emulation."""
    requests = RankRequests(
        vocab_size=cfg.vocab_size, eos_token_ids=cfg.stop_token_ids, num_kv_blocks=num_kv_blocks,
        block_size=block_size, max_model_len=min(cfg.max_position_embeddings, num_kv_blocks * block_size),
        grammars=Grammars.for_model(model_dir, cfg.vocab_size, cfg.stop_token_ids),
    )  # fmt: skip
    if emulation is not None:
        compute = emulation.attention(runtime)
    else:
        model = build_attention_rank(model_dir, cfg, dtype)
        compute = TorchAttention(model, cfg, num_kv_blocks, block_size)
    return AttentionExecutor(requests, compute, cfg)


class InProcessCluster:
    """`num_attn_ranks` attention runtimes and `num_expert_ranks` expert runtimes over one LoopbackHub, with torch
    executors on a checkpoint (`model_dir`) or emulated ones (`emulation`, an amoe.runtime.emulated.Emulation).

    KV blocks per rank: `num_kv_blocks`, else 256 (torch) or what the emulated GPU holds. Each head step's output
    goes to `publish(runtime, HeadOutput)` when given (on that runtime's loop thread). With `report`, every loop
    runs its executor through a RuntimeReporter (`reporters[runtime].report()` is the runtime's live report).
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        num_attn_ranks: int = 2,
        num_expert_ranks: int = 3,
        *,
        emulation=None,
        scheduler: SchedulerSection | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        publish=None,
        report: bool = False,
        offload=None,
    ) -> None:
        if (model_dir is None) == (emulation is None):
            raise ConfigError("give a checkpoint directory (torch executors) or an emulation, not both")
        cfg = emulation.model_config if emulation is not None else load_model_config(model_dir)
        # None: auto, as every engine picks it (float32 on the CPU, whatever the checkpoint stores).
        dtype = dtype or devices.model_dtype("auto", cfg.dtype, devices.CPU)
        if num_kv_blocks is None:
            num_kv_blocks = emulation.num_kv_blocks(block_size) if emulation is not None else 256
        self.model_config = cfg
        self.placement = Placement.disaggregated(num_attn_ranks, num_expert_ranks, cfg.num_expert_ids)
        hub = core.LoopbackHub(self.placement.num_runtimes)
        self.engines, self.executors = [], []
        for runtime in range(self.placement.num_runtimes):
            ecfg = core.engine_config(
                runtime, self.placement, num_blocks=cfg.num_blocks, num_experts=cfg.num_expert_ids,
                top_k=cfg.experts_per_token, hidden=cfg.hidden_size, scheduler=scheduler, track_requests=True,
                time_scale=emulation.config.time_scale if emulation is not None else 1.0,
            )  # fmt: skip
            engine = core.Engine(ecfg, hub.communicator(runtime))
            if ecfg.is_attention:
                executor = _attention_executor(
                    runtime, model_dir, cfg, emulation, num_kv_blocks, block_size, dtype
                )
            elif emulation is not None:
                executor = emulation.expert_executor(runtime)
            elif (
                offload is not None and offload.budget is not None
            ):  # config.OffloadSection: a store per runtime
                executor = _offloaded_experts(offload, model_dir, cfg, list(ecfg.experts), dtype)
            else:
                executor = ExpertExecutor(build_expert_layers(model_dir, cfg, ecfg.experts, dtype))
            self.engines.append(engine)
            self.executors.append(executor)
        self.reporters = (
            [
                RuntimeReporter(runtime, engine, executor)
                for runtime, (engine, executor) in enumerate(zip(self.engines, self.executors))
            ]
            if report
            else []
        )
        self._publish = publish
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count(1)

    @property
    def attention(self) -> list[AttentionExecutor]:
        return [self.executors[r] for r in self.placement.attn_runtime]

    def add_request(
        self, rank: int, request_id: int, prompt: list[int], params: SamplingParams, seq_ids=()
    ) -> RankRequest:
        """Bind a request to attention rank `rank`; its prompt enters that runtime's engine. Any thread. With
        n > 1, `seq_ids` name its other sequences (they appear in its `children` once forked)."""
        runtime = self.placement.attn_runtime[rank]
        req, rows = self.executors[runtime].requests.add(request_id, prompt, params, seq_ids=seq_ids)
        core.enter(self.engines[runtime], rows)
        return req

    def start(self) -> InProcessCluster:
        runs = self.reporters or self.executors
        for runtime, (engine, executor) in enumerate(zip(self.engines, runs)):
            engine.start()
            thread = threading.Thread(
                target=run_loop,
                args=(engine, executor, self._stop, self._publisher(runtime)),
                name=f"amoe-runtime-{runtime}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        return self

    def _publisher(self, runtime: int):
        if self._publish is None:
            return lambda out: None  # the requests' own state (output, done) is what generate() reads

        def publish(out: HeadOutput) -> None:
            self._publish(runtime, out)

        return publish

    def stop(self) -> None:
        """Stop every loop and engine; idempotent."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        for executor in self.executors:
            if getattr(executor, "offload", None) is not None:
                executor.offload.close()
        for engine in self.engines:
            engine.stop()

    __enter__ = start

    def __exit__(self, *exc) -> None:
        self.stop()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | None = None, timeout: float = 120.0
    ) -> list[list[int]]:
        """Token ids generated for each prompt; prompt i is bound to attention rank i mod num_attn_ranks."""
        params = params or SamplingParams(temperature=0)
        num_ranks = len(self.placement.attn_runtime)
        reqs = [self.add_request(i % num_ranks, next(self._ids), p, params) for i, p in enumerate(prompts)]
        for req in reqs:
            if not req.done.wait(timeout):
                raise EngineDeadError(f"a request did not finish within {timeout} s: {self.stats()}")
        return [req.output for req in reqs]

    def stats(self) -> list[dict]:
        return [engine.stats() for engine in self.engines]


def _offloaded_experts(offload, model_dir, cfg, experts: list[int], dtype) -> ExpertExecutor:
    """An expert runtime whose routed experts come from a store (amoe.runtime.build.expert_executor's way)."""
    from amoe.device import CPU
    from amoe.offload.wiring import Offload

    dtype = dtype or torch.float32
    off = Offload.expert_runtime(offload, model_dir, cfg, experts, dtype, CPU)
    shared = [e for e in experts if e >= cfg.num_experts]
    layers = build_expert_layers(model_dir, cfg, shared, dtype) if shared else {}
    if off.store is None:
        return ExpertExecutor(build_expert_layers(model_dir, cfg, experts, dtype))
    return ExpertExecutor(layers, CPU, offload=off)
