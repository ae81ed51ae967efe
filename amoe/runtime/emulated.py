"""Emulated GPUs behind the runtime's executor interfaces: each layer holds the runtime for the time the cost model
predicts on a named GPU and returns placeholder rows of the right shape.

`EmulatedExpertExecutor` stands in for the torch expert executor. `EmulatedAttention` is only the *compute* half of
an attention rank (the runtime composes it with the rank's real request state, exactly as it composes the torch
compute): routing comes from the routing override, and the head emits a fixed placeholder token that is never EOS,
so every request runs to max_tokens. The rest of the system (engines, queues, scheduler, transport) is real.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from amoe.config import EmulationSection
from amoe.errors import ConfigError
from amoe.model.config import ModelConfig
from amoe.model.logprobs import HeadSample
from amoe.perf.model import cost_model, kernels
from amoe.perf.model.check import check_emulation
from amoe.perf.model.gpus import PCIE4_X16, gpu_profile
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.offload_tiers import EmulatedTiers, OffloadSpec, SequenceTracker, build_tiers
from amoe.perf.model.routing import RouterOverride, RoutingSpec
from amoe.perf.model.shapes import model_config_of, profile_of
from amoe.perf.model.variance import StepVariance
from amoe.runtime.emulated_clock import EmulatedClock

# Width of the placeholder rows emulated runtimes exchange: costs always use the profile's real hidden size, so
# a narrow wire only saves the host's copies (16 floats = 64 bytes per row instead of 16 kB for Mixtral).
WIRE_HIDDEN = 16


class Emulation:
    """The resolved profiles of one emulated deployment (the config's emulation section), and the factory of its
    compute parts.

    With a profile name the runtime's ModelConfig comes from the profile; otherwise from `checkpoint` (a local
    checkpoint's), whose shapes are then also what the cost model prices. `wire_hidden` narrows the placeholder
    rows (None: the model's hidden size); `spin_s` busy-waits the end of each hold (0: sleep only, kind to shared
    cores).
    """

    def __init__(
        self,
        emulation: EmulationSection,
        checkpoint: ModelConfig | None = None,
        *,
        wire_hidden: int | None = WIRE_HIDDEN,
        spin_s: float = 0.0,
        offload: OffloadSpec | None = None,
    ) -> None:
        if emulation.profile is None and checkpoint is None:
            raise ConfigError("emulation needs a model profile name or a checkpoint's ModelConfig")
        if wire_hidden is not None and wire_hidden <= 0:
            raise ConfigError(f"wire_hidden must be positive; got {wire_hidden}")
        check_emulation(emulation)
        self.config = emulation
        self.spin_s = spin_s
        self.offload = offload  # None: every expert is resident (the default)
        self.gpu = gpu_profile(emulation.gpu)
        self.expert_gpu = gpu_profile(
            emulation.expert_gpu or emulation.gpu
        )  # what expert layers are timed on
        self.host = host_overhead(emulation.host_overhead)
        self.variance = StepVariance.parse(emulation.step_variance)
        if emulation.profile is not None:
            self.profile = model_profile(emulation.profile, emulation.top_k)
            runtime_cfg = model_config_of(self.profile)
        else:
            self.profile = profile_of(checkpoint)
            if emulation.top_k is not None:
                self.profile = dataclasses.replace(self.profile, top_k=emulation.top_k)
            runtime_cfg = checkpoint
        # The runtime sees the cost profile's top-k and the wire width of the placeholder rows.
        self.model_config = dataclasses.replace(
            runtime_cfg, top_k=self.profile.top_k, hidden_size=wire_hidden or runtime_cfg.hidden_size
        )

    def router(self) -> RouterOverride:
        """A router; every runtime builds it from the same seed, so all ranks agree on which experts are hot."""
        spec = RoutingSpec.parse(self.config.routing)
        cfg = self.model_config
        return RouterOverride(
            spec, cfg.num_experts, cfg.top_k, cfg.num_blocks, seed=self.config.seed,
            num_shared=cfg.num_shared_experts,
        )  # fmt: skip

    def clock(self, device: int = 0, stream: int = 0) -> EmulatedClock:
        """The clock of GPU `device` (its runtime id: the key of its speed and jitter draws, so every process
        and the simulation agree on which GPU is slow); `stream`: one jitter sequence per clock of a device."""
        v = self.variance
        rng = v.jitter_rng(device, stream)
        jitter = (lambda: float(v.draw(rng))) if v.jitter else None
        return EmulatedClock(self.config.time_scale, self.spin_s, v.speed(device), jitter)

    def num_kv_blocks(self, block_size: int, local_experts: Sequence[int] = ()) -> int:
        """KV blocks an attention GPU holds beside the attention rank's weights and, in EP, the experts (ids) that
        share the GPU."""
        weights = cost_model.attention_rank_weight_bytes(self.profile)
        if local_experts:
            weights += cost_model.expert_rank_weight_bytes(self.profile, local_experts)
        blocks = cost_model.kv_capacity_tokens(self.gpu, self.profile, weights) // block_size
        if blocks < 1:
            raise ConfigError(f"{self.profile.name}'s weights leave no room for KV on a {self.gpu.name}")
        return int(blocks)

    def expert_executor(self, device: int = 0) -> EmulatedExpertExecutor:
        """Expert layers on GPU `device` (its runtime id)."""
        return EmulatedExpertExecutor(self, self.clock(device, stream=1), tiers=self.offload_tiers())

    def offload_tiers(self) -> EmulatedTiers | None:
        """Device ← host ← SSD tiers for one expert runtime under the offload budget (None without one)."""
        if self.offload is None:
            return None
        expert_bytes = self.profile.params_of(0) * self.profile.bytes_per_param
        return build_tiers(self.offload, self.profile, expert_bytes)

    def attention(self, device: int = 0) -> EmulatedAttention:
        """Attention and head on GPU `device` (its runtime id; in EP the device's experts share its speed)."""
        return EmulatedAttention(self, self.router(), self.clock(device))


class EmulatedExpertExecutor:
    """Holds for an expert layer's predicted time; returns zero rows [N, H]."""

    def __init__(
        self,
        em: Emulation,
        clock: EmulatedClock,
        dtype: torch.dtype = torch.float32,
        tiers: EmulatedTiers | None = None,
    ) -> None:
        self.em, self.clock, self.dtype = em, clock, dtype
        self.hidden = em.model_config.hidden_size
        self.tiers = tiers
        self._sequences = SequenceTracker(tiers) if tiers is not None else None
        self._step_start = self._step_end = (
            0.0  # emulated times of the step (offloading's copies are timed by them)
        )

    def run(self, batch) -> torch.Tensor:
        """One expert's rows, or (an AEP grouped step: batch.group_experts) several experts' rows in one grouped
        GEMM, costed as EP's grouped step is."""
        n, groups = batch.num_rows, batch.group_experts
        if groups is not None and len(groups) > 1:
            rows = batch.cu_rows.diff().tolist()
            t = cost_model.grouped_expert_time(
                self.em.profile, self.em.expert_gpu, rows, self.em.host, groups.tolist()
            )
        else:
            expert = batch.index if groups is None else int(groups[0])
            t = cost_model.expert_layer_time(self.em.profile, self.em.expert_gpu, n, self.em.host, expert)
        if self.tiers is not None:
            experts = [batch.index] if groups is None else groups.tolist()
            cu = [0, n] if groups is None else batch.cu_rows.tolist()
            t += self._wait_for_copies(batch.block, experts, cu, batch.request_ids.tolist())
        self._hold(t, n)
        return torch.zeros(n, self.hidden, dtype=self.dtype)  # [N, H]

    def run_grouped(self, batches: list) -> list[torch.Tensor]:
        """An EP device's experts of one block in one grouped GEMM: one hold for all of them (cost_model)."""
        rows = [b.num_rows for b in batches]
        experts = [b.index for b in batches]
        t = cost_model.grouped_expert_time(self.em.profile, self.em.expert_gpu, rows, self.em.host, experts)
        if self.tiers is not None:
            rids = [rid for b in batches for rid in b.request_ids.tolist()]
            cu = [0, *itertools.accumulate(rows)]
            t += self._wait_for_copies(batches[0].block, experts, cu, rids)
        self._hold(t, sum(rows))
        return [torch.zeros(n, self.hidden, dtype=self.dtype) for n in rows]  # [N_i, H] each

    def run_experts(self, batches: list, kernel: str) -> list[torch.Tensor]:
        """A chunk of an EP expert pipeline: one hold for its routed experts as one grouped GEMM or one GEMM per
        expert, priced by the GPU's kernel curves (amoe.perf.model.eps), a shared expert as a GEMM of its own (as the
        torch executor runs it, whatever the chunk's kernel), plus one host step."""
        rows = [b.num_rows for b in batches]
        model, gpu = self.em.profile, self.em.expert_gpu
        curves = kernels.curves_for(gpu)
        by_gemm: dict[tuple[str, int], list[int]] = {}  # (kernel, width) -> rows of its experts
        for b in batches:
            k = kernel if b.index < model.num_experts else "dense"
            by_gemm.setdefault((k, model.intermediate_of(b.index)), []).append(b.num_rows)
        t = sum(
            kernels.experts_time(gpu, curves.curve(k), k, r, model.hidden_size, inter)
            for (k, inter), r in by_gemm.items()
        )
        if sum(rows):
            t += self.em.host.expert_step_s + sum(rows) * self.em.host.expert_row_s
        self.clock.hold(t, "expert", sum(rows))
        return [torch.zeros(n, self.hidden, dtype=self.dtype) for n in rows]  # [N_i, H] each

    def _wait_for_copies(
        self, block: int, experts: list[int], cu: list[int], request_ids: list[int]
    ) -> float:
        """Emulated seconds the step waits for its experts to reach the device (expert offloading): each expert's
        rows tell the policy their requests' routing, then the experts are fetched one after another. Shared
        experts (ids >= num_experts) are part of the resident dense model."""
        # The GPU starts a step no earlier than the previous one ended on its own timeline: the clock's sleeps carry
        # over- and under-shoot as debt, so now() alone can fall behind the copies the last step already paid for.
        now = self._step_start = max(self.clock.now(), self._step_end)
        routed = [(e, i) for i, e in enumerate(experts) if e < self.em.profile.num_experts]
        for e, i in routed:
            self._sequences.routed(block, e, request_ids[cu[i] : cu[i + 1]])
        self.tiers.pinned = {(block, e) for e, _ in routed}
        ready = now
        for e, _ in routed:
            ready = self.tiers.acquire((block, e), ready)
        return ready - now

    def _hold(self, t: float, rows: int) -> None:
        self.clock.hold(t, "expert", rows)
        if self.tiers is not None:
            self._step_end = self._step_start + t  # t includes the wait for copies

    def layer_bytes(self, layers) -> int:
        """The weight bytes of these (block, expert) layers on the emulated GPU."""
        p = self.em.profile
        # An int: the join's and drain's answers carry it on the wire, where a byte count is an integer field (a
        # profile's bytes_per_param is a float: FP8 and NVFP4 weights take 1 and 0.5).
        return int(sum(p.params_of(e) * p.bytes_per_param for _, e in layers))

    def join_wall_s(self, layers) -> float:
        """Wall seconds a join's weights take to land: host memory to the GPU over PCIe (the checkpoint read
        counted as cached), stretched by the time scale like every emulated step."""
        emulated = PCIE4_X16.latency + self.layer_bytes(layers) / PCIE4_X16.usable_bandwidth
        return emulated * self.em.config.time_scale

    def add(self, layers) -> int:
        """A join's layers landed (there are no weights to hold): their bytes."""
        return self.layer_bytes(layers)

    def remove(self, keys) -> int:
        """A drain's layers freed: their bytes."""
        return self.layer_bytes(keys)

    def stats(self) -> dict:
        """The clock's busy time; with offloading also the tiers' hits, misses, bytes, recall and stall time."""
        stats = self.clock.stats()
        if self.tiers is not None:
            stats["offload"] = {**dataclasses.asdict(self.tiers.stats), "recall": self.tiers.stats.recall}
        return stats


class EmulatedAttention:
    """The compute of an attention rank without weights: predicted step times, override routing, a placeholder
    token from the head (the interface of amoe.runtime.executors.TorchAttention)."""

    def __init__(
        self, em: Emulation, router: RouterOverride, clock: EmulatedClock, dtype: torch.dtype = torch.float32
    ) -> None:
        cfg = em.model_config
        if (router.num_experts, router.top_k) != (cfg.num_experts, cfg.top_k):
            raise ConfigError("the router's experts/top-k differ from the runtime's model config")
        self.em, self.router, self.clock, self.dtype = em, router, clock, dtype
        self.hidden = cfg.hidden_size
        self.token = _placeholder_token(cfg)

    def attend(self, batch, request_ids: list[int], requests) -> tuple[torch.Tensor, ...]:
        """Hold for attention(batch.block), then route each row by the override (keyed by request and position,
        so every schedule routes a token alike)."""
        n = batch.num_rows
        chunk_lens = np.diff(batch.cu_rows.numpy())  # [R]
        ctx = batch.context_lens.numpy()
        t = cost_model.attention_layer_time(self.em.profile, self.em.gpu, chunk_lens, ctx, self.em.host)
        self.clock.hold(t, "attention", n)
        ids, weights = self.router.route(
            batch.block, n, request_ids=batch.request_ids.numpy(), positions=batch.positions.numpy(),
            now_s=self.clock.now(),
        )  # fmt: skip
        # One placeholder serves as residual and moe_input: nothing computes on it, and it halves the allocation.
        rows = torch.zeros(n, self.hidden, dtype=self.dtype)  # [N, H]
        return rows, rows, torch.from_numpy(ids), torch.from_numpy(weights)  # ids, weights [N, K]

    def sample(self, batch, rows, seqs) -> HeadSample:
        """Hold for the head's time; the same placeholder token for every sequence (no logits: a request asking
        for log-probabilities is refused when it arrives, RankRequests.computes_logits)."""
        n, num_chunks = batch.num_rows, len(set(rows))
        self.clock.hold(
            cost_model.head_time(self.em.profile, self.em.gpu, num_chunks, n, self.em.host), "head", n
        )
        return HeadSample([self.token] * len(seqs))

    def copy_kv(self, copies) -> None:
        """No KV is held: a fork copies nothing."""

    def stats(self) -> dict:
        return self.clock.stats()


def _placeholder_token(cfg: ModelConfig) -> int:
    """The first id after the usual specials (<unk>, <s>, </s>) that no stop rule of the model matches."""
    stops = set(cfg.stop_token_ids)
    return next(t for t in range(3, cfg.vocab_size) if t not in stops)
