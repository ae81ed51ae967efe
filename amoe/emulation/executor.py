"""Emulated executors: the same run(batch) as amoe/runtime/executors.py, but each layer holds the runtime for the
time the cost model predicts on a named GPU and returns placeholder rows of the right shape.

Attention routing comes from the routing override; the head emits a fixed placeholder token that is never EOS,
so every request runs to max_tokens. The rest of the system (engines, queues, scheduler, transport) is real.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from amoe import core
from amoe.emulation import cost_model
from amoe.emulation.clock import EmulatedClock
from amoe.emulation.profiles import (
    GpuProfile,
    HostOverhead,
    ModelProfile,
    gpu_profile,
    host_overhead,
    model_profile,
    profile_from_config,
)
from amoe.emulation.routing import RouterOverride, RoutingSpec, row_keys
from amoe.errors import ConfigError
from amoe.model.config import ModelConfig
from amoe.model.kv_cache import BlockManager
from amoe.runtime.executors import AttentionExecutor, RankRequest


@dataclass(frozen=True)
class EmulationConfig:
    """`--executor emulated` settings: which GPU and model shapes to cost, time dilation, routing, host overhead."""

    gpu: str = "a100-40g"
    model: str | None = None  # a profile name (mixtral-8x7b-mqa, ...); None: the checkpoint's shapes
    top_k: int | None = None  # override the profile's top-k (the paper runs Mixtral at top-1 and top-2)
    time_scale: float = 1.0  # wall seconds per emulated second
    routing: str = "skew-exp"  # uniform | skew-exp[:λ]; emulated GPUs have no router weights
    seed: int = 0
    host: str = "amoe-paper"  # host overhead of the emulated serving system: amoe-paper | none
    wire_hidden: int | None = None  # width of placeholder rows on the wire; None: the model's hidden size
    spin_s: float = 0.0  # wall seconds each hold busy-waits at its end (0: sleep only, kind to shared cores)
    decode_only: bool = False  # skip prefill: a prompt's KV is taken as written (the AMoE paper's §5 set-up)

    def __post_init__(self) -> None:
        gpu_profile(self.gpu)
        host_overhead(self.host)
        if self.model is not None:
            model_profile(self.model, self.top_k)
        if not self.time_scale > 0:
            raise ConfigError(f"time_scale must be positive; got {self.time_scale}")
        if not RoutingSpec.parse(self.routing).is_override:
            raise ConfigError("emulated GPUs have no router weights: use --routing uniform or skew-exp[:λ]")
        if self.wire_hidden is not None and self.wire_hidden <= 0:
            raise ConfigError(f"wire_hidden must be positive; got {self.wire_hidden}")


class Emulation:
    """Resolved profiles of one emulated deployment, and the factory of its executors.

    With a profile name the runtime's ModelConfig comes from the profile; otherwise from `model_config` (a local
    checkpoint's), whose shapes are then also what the cost model prices.
    """

    def __init__(self, config: EmulationConfig, model_config: ModelConfig | None = None) -> None:
        if config.model is None and model_config is None:
            raise ConfigError("emulation needs a model profile name or a checkpoint's ModelConfig")
        self.config = config
        self.gpu = gpu_profile(config.gpu)
        self.host = host_overhead(config.host)
        if config.model is not None:
            self.profile = model_profile(config.model, config.top_k)
        else:
            self.profile = profile_from_config(model_config)
            if config.top_k is not None:
                self.profile = dataclasses.replace(self.profile, top_k=config.top_k)
        runtime_cfg = self.profile.to_model_config() if config.model is not None else model_config
        # The runtime sees the cost profile's top-k and the wire width of the placeholder rows.
        self.model_config = dataclasses.replace(
            runtime_cfg, top_k=self.profile.top_k, hidden_size=config.wire_hidden or runtime_cfg.hidden_size
        )

    def router(self) -> RouterOverride:
        """A router; every runtime builds it from the same seed, so all ranks agree on which experts are hot."""
        spec = RoutingSpec.parse(self.config.routing)
        cfg = self.model_config
        return RouterOverride(spec, cfg.num_experts, cfg.top_k, cfg.num_blocks, seed=self.config.seed)

    def clock(self) -> EmulatedClock:
        return EmulatedClock(self.config.time_scale, self.config.spin_s)

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks an attention GPU holds beside the attention rank's weights."""
        weights = cost_model.attention_rank_weight_bytes(self.profile)
        blocks = cost_model.kv_capacity_tokens(self.gpu, self.profile, weights) // block_size
        if blocks < 1:
            raise ConfigError(
                f"{self.profile.name}'s attention weights leave no room for KV on a {self.gpu.name}"
            )
        return blocks

    def expert_executor(self) -> EmulatedExpertExecutor:
        return EmulatedExpertExecutor(
            self.profile, self.gpu, self.clock(), self.host, self.model_config.hidden_size
        )

    def attention_executor(
        self,
        engine: core.Engine,
        *,
        kv_blocks: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
    ) -> EmulatedAttentionExecutor:
        """An attention rank; kv_blocks None: as many as the GPU's memory holds."""
        return EmulatedAttentionExecutor(
            engine,
            self.model_config,
            self.profile,
            self.gpu,
            self.router(),
            self.clock(),
            host=self.host,
            kv_blocks=kv_blocks or self.kv_blocks(block_size),
            block_size=block_size,
            max_model_len=max_model_len or self.model_config.max_position_embeddings,
            decode_only=self.config.decode_only,
        )


class EmulatedExpertExecutor:
    """Holds for an expert layer's predicted time; returns zero rows [N, H]."""

    def __init__(
        self,
        profile: ModelProfile,
        gpu: GpuProfile,
        clock: EmulatedClock,
        host: HostOverhead,
        hidden: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.profile, self.gpu, self.clock, self.host = profile, gpu, clock, host
        self.hidden, self.dtype = hidden, dtype

    def run(self, batch: core.Batch) -> torch.Tensor:
        n = batch.num_rows
        self.clock.hold(cost_model.expert_layer_time(self.profile, self.gpu, n, self.host), "expert", n)
        return torch.zeros(n, self.hidden, dtype=self.dtype)  # [N, H]

    def stats(self) -> dict:
        return self.clock.stats()


class EmulatedAttentionExecutor(AttentionExecutor):
    """An attention rank without weights: AttentionExecutor's request lifecycle (add_request, abort, KV blocks,
    finish reasons, re-entry of tokens) with predicted step times, override routing and a placeholder sampler."""

    def __init__(
        self,
        engine: core.Engine,
        cfg: ModelConfig,
        profile: ModelProfile,
        gpu: GpuProfile,
        router: RouterOverride,
        clock: EmulatedClock,
        *,
        host: HostOverhead,
        kv_blocks: int,
        block_size: int = 16,
        max_model_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        decode_only: bool = False,
    ) -> None:
        if (router.num_experts, router.top_k) != (cfg.num_experts, cfg.top_k):
            raise ConfigError("the router's experts/top-k differ from the runtime's model config")
        # The parent sets up the request state (and whatever it grows later); a one-block KV cache and a weightless
        # model stand in for the real ones, then the block manager gets the emulated GPU's capacity.
        max_len = max_model_len or cfg.max_position_embeddings
        super().__init__(engine, _WEIGHTLESS, cfg, kv_blocks=1, block_size=block_size, max_model_len=max_len)
        self.kv = None
        self.blocks = BlockManager(kv_blocks, block_size)
        self.sampler = _PlaceholderSampler(_placeholder_token(cfg))
        self.profile, self.gpu, self.router, self.clock, self.host = profile, gpu, router, clock, host
        self.dtype = dtype
        self.decode_only = decode_only

    def add_request(self, request_id: int, prompt: list[int], params) -> RankRequest:
        """As AttentionExecutor's; decode-only: the prompt's KV counts as written (the paper fills it with dummy
        data and measures decoding only), so only its last token enters, as a decode row whose context is the
        whole prompt. Its KV blocks are reserved when that row first reaches block 0 (on the loop thread)."""
        if not self.decode_only:
            return super().add_request(request_id, prompt, params)
        req = self._bind(request_id, prompt, params)
        self._add_tokens([request_id], [prompt[-1]], [len(prompt) - 1], 1)
        return req

    @property
    def kv_capacity_tokens(self) -> int:
        return self.blocks.num_total_blocks * self.blocks.block_size

    def run(self, batch: core.Batch):
        n = batch.num_rows
        chunk_lens = np.diff(batch.cu_rows.numpy())  # [R]
        if batch.block == 0:
            if self.decode_only:
                self._reserve_prompts(batch)
            self._attn_input(batch)  # only for its KV slot allocation, taken when a chunk enters block 0
        if batch.block == self.cfg.num_blocks:
            t = cost_model.head_time(self.profile, self.gpu, len(chunk_lens), n, self.host)
            self.clock.hold(t, "head", n)
            self._sample(batch, None)  # the placeholder sampler needs no logits
            return None
        ctx = batch.context_lens.numpy()
        t = cost_model.attention_layer_time(self.profile, self.gpu, chunk_lens, ctx, self.host)
        self.clock.hold(t, "attention", n)
        keys = row_keys(batch.request_ids, batch.positions)
        topk_ids, topk_weights = self.router.route_tensors(batch.block, n, keys)  # [N, K] each
        self.routed[batch.block] += torch.bincount(topk_ids.flatten(), minlength=self.cfg.num_experts)
        # One placeholder serves as residual and moe_input: nothing computes on it, and it halves the allocation.
        rows = torch.zeros(n, self.cfg.hidden_size, dtype=self.dtype)  # [N, H]
        return rows, rows, topk_ids, topk_weights

    def stats(self) -> dict:
        return self.clock.stats()

    def _reserve_prompts(self, batch: core.Batch) -> None:
        """Decode-only: a request's first row reserves the KV its skipped prompt would have written."""
        starts = batch.positions[batch.cu_rows[:-1]].tolist()
        for rid, start in zip(batch.request_ids[batch.cu_rows[:-1]].tolist(), starts):
            if start > 0 and not self.blocks.has(str(rid)):
                self.blocks.allocate(str(rid), start)


class _PlaceholderSampler:
    """Stands in for Sampler: the same token for every request, whatever its sampling parameters."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, logits, params, generators) -> list[int]:
        return [self.token] * len(params)


# What AttentionExecutor.__init__ reads from a model: the lm_head's dtype (for its KV cache).
_WEIGHTLESS = SimpleNamespace(head=SimpleNamespace(lm_head=torch.empty(0)))


def _placeholder_token(cfg: ModelConfig) -> int:
    """The first id after the usual specials (<unk>, <s>, </s>) that no stop rule of the model matches."""
    stops = set(cfg.stop_token_ids)
    return next(t for t in range(3, cfg.vocab_size) if t not in stops)
