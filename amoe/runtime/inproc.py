"""Several virtual runtimes in one process: attention ranks and expert ranks, each a C++ engine plus a Python
thread running the main loop, wired by the loopback communicator. Used by tests and single-host experiments."""

from __future__ import annotations

import itertools
import logging
import threading
from pathlib import Path

import torch

from amoe import core
from amoe.errors import EngineDeadError
from amoe.model.config import load_model_config
from amoe.model.layers import build_attention_rank, build_expert_layers
from amoe.runtime.executors import AttentionExecutor, ExpertExecutor
from amoe.runtime.loop import run_loop
from amoe.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class InProcessCluster:
    """`num_attn_ranks` attention runtimes and `num_expert_ranks` expert runtimes over one LoopbackHub."""

    def __init__(
        self,
        model_dir: str | Path,
        num_attn_ranks: int = 2,
        num_expert_ranks: int = 3,
        *,
        policy: str = "defrag",
        lookahead: int = 3,
        decay: float = 0.5,
        attn_cap: int = 256,
        expert_cap: int = 512,
        kv_blocks: int = 256,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
    ) -> None:
        cfg = load_model_config(model_dir)
        self.model_config = cfg
        self.placement = core.Placement.disaggregated(num_attn_ranks, num_expert_ranks, cfg.num_experts)
        hub = core.LoopbackHub(self.placement.num_runtimes)
        self.engines, self.executors = [], []
        max_model_len = min(cfg.max_position_embeddings, kv_blocks * block_size)
        for runtime in range(self.placement.num_runtimes):
            ecfg = core.engine_config(
                runtime, self.placement, num_blocks=cfg.num_blocks, num_experts=cfg.num_experts,
                top_k=cfg.top_k, hidden=cfg.hidden_size, policy=policy, lookahead=lookahead, decay=decay,
                attn_cap=attn_cap, expert_cap=expert_cap,
            )  # fmt: skip
            engine = core.Engine(ecfg, hub.communicator(runtime))
            if ecfg.is_attention:
                model = build_attention_rank(model_dir, cfg, dtype)
                executor = AttentionExecutor(engine, model, cfg, kv_blocks, block_size, max_model_len)
            else:
                executor = ExpertExecutor(build_expert_layers(model_dir, cfg, ecfg.experts, dtype))
            self.engines.append(engine)
            self.executors.append(executor)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count(1)

    @property
    def attention(self) -> list[AttentionExecutor]:
        return [self.executors[r] for r in self.placement.attn_runtime]

    def start(self) -> InProcessCluster:
        for runtime, (engine, executor) in enumerate(zip(self.engines, self.executors)):
            engine.start()
            thread = threading.Thread(
                target=run_loop,
                args=(engine, executor, self._stop),
                name=f"amoe-runtime-{runtime}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop every loop and engine; idempotent."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
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
        ranks = self.attention
        reqs = [ranks[i % len(ranks)].add_request(next(self._ids), p, params) for i, p in enumerate(prompts)]
        for req in reqs:
            if not req.done.wait(timeout):
                raise EngineDeadError(f"a request did not finish within {timeout} s: {self.stats()}")
        return [req.output for req in reqs]

    def stats(self) -> list[dict]:
        return [engine.stats() for engine in self.engines]
