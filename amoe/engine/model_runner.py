"""Runs one step's chunks through the whole model in one process, block by block, the way AEP routes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from amoe import core
from amoe.device import CPU, Device, kv_block_bytes
from amoe.engine.scheduler import ScheduledChunk
from amoe.model.config import ModelConfig
from amoe.model.head import Head
from amoe.model.kv_cache import LatentKVCache, PagedKVCache, kv_cache_for
from amoe.model.layers import AttnInput, AttnPlan, ExpertLayer, build_attention_rank, build_expert_layers
from amoe.model.moe import GroupedExperts
from amoe.offload.wiring import Offload


@dataclass
class HeadRows:
    """The head's input after the last block: each chunk's last row (`last` [R]) and, for a scored chunk c,
    all its rows from `first[c]` on (in chunk order), indexed into residual / expert_out / expert_ids."""

    head: Head
    residual: torch.Tensor  # [M, H]
    expert_out: torch.Tensor  # [M, K, H]
    expert_ids: torch.Tensor  # [M, K]
    last: torch.Tensor  # [R]
    first: dict[int, int]  # scored chunk -> its first row's index

    def logits(self) -> torch.Tensor:
        """Next-token logits of each chunk's last row [R, V] float32."""
        return self.logits_at(self.last)

    def logits_at(self, rows: torch.Tensor) -> torch.Tensor:
        return self.head.logits_at(self.residual, self.expert_out, self.expert_ids, rows)


def _head_rows(
    cu_rows: torch.Tensor, scored: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
    """The rows the head reads (each chunk's last; every row of a scored chunk), where each chunk's last one
    lands among them, and where each scored chunk's rows start."""
    if not scored:  # the usual step: each chunk's last row, without a Python loop over them
        return cu_rows[1:] - 1, torch.arange(len(cu_rows) - 1), {}
    bounds, scored = cu_rows.tolist(), set(scored)
    keep: list[int] = []
    last: list[int] = []
    first: dict[int, int] = {}
    for c in range(len(bounds) - 1):
        if c in scored:
            first[c] = len(keep)
            keep += range(bounds[c], bounds[c + 1])
        else:
            keep.append(bounds[c + 1] - 1)
        last.append(len(keep) - 1)
    return torch.tensor(keep, dtype=torch.int64), torch.tensor(last, dtype=torch.int64), first


@dataclass
class _Batch:
    token_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N]
    cu_rows: torch.Tensor  # [R + 1]
    context_lens: torch.Tensor  # [R]
    block_tables: torch.Tensor  # [R, max_blocks]


class ModelRunner:
    """Owns the attention layers, every expert layer, the head and the KV cache of a single-process engine."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device: Device = CPU,
        offload=None,
    ) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        # --offload-budget: the routed experts stay on disk behind a store (amoe.offload), the rest is loaded here;
        # a budget below the minimum fails before any weight loads.
        self.offload = Offload.local(offload, model_dir, cfg, dtype, device)
        rank = build_attention_rank(model_dir, cfg, dtype, device.torch)
        self.attention, self.head = rank.layers, rank.head
        hosted = (
            range(cfg.num_experts, cfg.num_expert_ids) if self.offload.store else range(cfg.num_expert_ids)
        )
        self.experts: dict[tuple[int, int], ExpertLayer] = build_expert_layers(
            model_dir, cfg, hosted, dtype, device.torch
        )
        self.grouped: dict[int, GroupedExperts] = {}  # block -> its routed experts, where grouped GEMMs run
        if GroupedExperts.supported(device.torch, dtype) and not self.offload.store:
            for b in range(cfg.num_blocks):  # block by block, so the stacked copy never doubles the model
                self.grouped[b] = GroupedExperts([self.experts.pop((b, e)) for e in range(cfg.num_experts)])
        self.kv: PagedKVCache | LatentKVCache | None = None

    def allocate_kv(self, num_kv_blocks: int) -> None:
        """The KV cache, once the weights are on the device (its size may depend on what they leave)."""
        self.kv = kv_cache_for(self.cfg, num_kv_blocks, self.block_size, self.dtype, self.device.torch)

    def kv_bytes(self) -> int:
        """The KV cache's size (on the CPU its pages become resident as requests write them)."""
        cfg = self.cfg
        block = kv_block_bytes(cfg.num_layers, self.block_size, cfg.kv_elements_per_token, self.dtype)
        return block * self.kv.num_kv_blocks

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], block_tables: list[list[int]]) -> torch.Tensor:
        """Chunks (with their requests' block tables) → next-token logits [R, V] float32."""
        return self.forward(chunks, block_tables).logits()

    @torch.inference_mode()
    def forward(
        self, chunks: list[ScheduledChunk], block_tables: list[list[int]], scored: Sequence[int] = ()
    ) -> HeadRows:
        """Run the chunks through every block; the head's input keeps each chunk's last row, and every row of
        the chunks in `scored` (whose prompts are scored: amoe/model/logprobs.py)."""
        batch = self._prepare(chunks, block_tables)
        plan = AttnPlan.build(
            batch.positions,
            batch.cu_rows,
            batch.context_lens,
            batch.block_tables,
            self.block_size,
            self.cfg.sliding_window,
        )  # on the host; its indices go up once for every block
        put = self.device.put
        inp = AttnInput(
            positions=put(batch.positions),
            slot_mapping=put(batch.slot_mapping),
            cu_rows=batch.cu_rows,
            context_lens=batch.context_lens,
            block_tables=batch.block_tables,
            token_ids=put(batch.token_ids),
            plan=plan.to(self.device.torch),
        )
        keep, last, first = _head_rows(batch.cu_rows, scored)
        keep_dev = put(keep)
        last_block = self.cfg.num_blocks - 1
        seqs = [c.request.request_id for c in chunks]
        for b, layer in enumerate(self.attention):
            out = layer(inp, self.kv)
            residual, moe_input, ids, weights = out.residual, out.moe_input, out.topk_ids, out.topk_weights
            self.offload.routed(b, seqs, ids, batch.cu_rows)  # the policy's and the recorder's hook
            if b == last_block:
                # Only the rows the head reads go on: skip the last block's experts for the others.
                residual, moe_input = residual[keep_dev], moe_input[keep_dev]
                ids, weights = ids[keep_dev], weights[keep_dev]
            inp.token_ids, inp.residual, inp.expert_ids = None, residual, ids
            inp.expert_out = self._run_experts(b, moe_input, ids, weights)
        self.offload.end_step()
        return HeadRows(self.head, inp.residual, inp.expert_out, inp.expert_ids, put(last), first)

    def _run_experts(
        self, block: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [N, H] routed to K experts each → weighted expert outputs [N, K, H] (slot k ↔ topk_ids[:, k])."""
        n, k = topk_ids.shape
        # Grouping is host work on the routing (which crosses to the CPU anyway); the permutation goes back up.
        perm, offsets = core.group_by_destination(
            self.device.host(topk_ids).flatten(), self.cfg.num_expert_ids
        )
        perm = self.device.put(perm)  # [N*K]; offsets [E+1] stay on the host
        grouped_x = x.index_select(0, perm // k)  # [N*K, H], rows of expert 0 first, then expert 1, ...
        grouped_w = topk_weights.flatten().index_select(0, perm)  # [N*K]
        grouped_out = torch.empty_like(grouped_x)
        bounds = offsets.tolist()
        first = 0
        if self.offload.store is not None:  # the routed experts from the store, one at a time, resident first
            first = self.cfg.num_experts
            self.offload.run_experts(block, grouped_x, grouped_w, grouped_out, bounds[: first + 1])
        elif block in self.grouped:  # the routed experts at once; the shared one (id E, own width) below
            first, end = self.cfg.num_experts, bounds[self.cfg.num_experts]
            ends = offsets[1 : first + 1].to(device=grouped_x.device, dtype=torch.int32)
            grouped_out[:end] = self.grouped[block](grouped_x[:end], ends, grouped_w[:end])
        for e in range(first, self.cfg.num_expert_ids):
            lo, hi = bounds[e], bounds[e + 1]
            if lo < hi:
                grouped_out[lo:hi] = self.experts[(block, e)](grouped_x[lo:hi], grouped_w[lo:hi])
        out = torch.empty_like(grouped_out).index_copy_(0, perm, grouped_out)
        return out.view(n, k, -1)

    @staticmethod
    def _prepare(chunks: list[ScheduledChunk], block_tables: list[list[int]]) -> _Batch:
        token_ids, positions, slots, cu_rows, context_lens = [], [], [], [0], []
        for chunk in chunks:
            n = len(chunk.token_ids)
            token_ids += chunk.token_ids
            positions += range(chunk.start_position, chunk.start_position + n)
            slots += chunk.slot_mapping
            cu_rows.append(cu_rows[-1] + n)
            context_lens.append(chunk.start_position + n)
        width = max(len(t) for t in block_tables)
        tables = [t + [0] * (width - len(t)) for t in block_tables]  # padding is never attended (masked)
        as_tensor = torch.tensor
        return _Batch(
            token_ids=as_tensor(token_ids),
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            cu_rows=as_tensor(cu_rows),
            context_lens=as_tensor(context_lens),
            block_tables=as_tensor(tables),
        )
