"""The attention layer of one block: top-k merge → RMSNorm → GQA attention over the paged KV cache → router."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from amoe.model.config import ModelConfig
from amoe.model.kv_cache import PagedKVCache
from amoe.model.moe import merge_expert_outputs, route
from amoe.model.ops import RotaryEmbedding, apply_rope, rms_norm
from amoe.model.weights import AttentionWeights


@dataclass
class _ChunkGroup:
    """Chunks attended in one padded SDPA call: [G chunks, Q query rows, L context keys]."""

    rows: torch.Tensor  # [G, Q] row of each query (padding repeats the chunk's first row)
    valid: torch.Tensor | None  # [G, Q] bool; None when no padding
    slots: torch.Tensor  # [G, L] KV slot of each context position
    mask: torch.Tensor  # [G, 1, Q, L] bool: True = may attend


@dataclass
class AttnPlan:
    """Gather indices and masks derived from the chunk metadata; the same for every block of one step."""

    groups: list[_ChunkGroup]

    def to(self, device: torch.device) -> AttnPlan:
        """The plan's indices and masks on `device` (built on the host, used where the KV cache is)."""
        if all(g.slots.device == device for g in self.groups):
            return self

        def put(t):
            return None if t is None else t.to(device, non_blocking=True)

        return AttnPlan(
            [_ChunkGroup(put(g.rows), put(g.valid), put(g.slots), put(g.mask)) for g in self.groups]
        )

    @classmethod
    def build(
        cls,
        positions: torch.Tensor,
        cu_rows: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        sliding_window: int | None,
    ) -> AttnPlan:
        """Decode rows (one-row chunks) and longer chunks form separate groups so padding stays small."""
        q_lens = cu_rows[1:] - cu_rows[:-1]  # [R]
        is_decode = q_lens == 1
        groups = []
        for selected in (is_decode, ~is_decode):
            chunks = selected.nonzero().flatten()
            if chunks.numel():
                groups.append(
                    _group(
                        chunks,
                        positions,
                        cu_rows,
                        q_lens,
                        context_lens,
                        block_tables,
                        block_size,
                        sliding_window,
                    )
                )
        return cls(groups)


def _group(chunks, positions, cu_rows, q_lens, context_lens, block_tables, block_size, sliding_window):
    starts, lens, ctx = cu_rows[:-1][chunks], q_lens[chunks], context_lens[chunks]  # [G] each
    i = torch.arange(int(lens.max()))
    valid = i[None, :] < lens[:, None]  # [G, Q]
    rows = torch.where(valid, starts[:, None] + i[None, :], starts[:, None])  # [G, Q]
    qpos = positions[rows]  # [G, Q]
    j = torch.arange(int(ctx.max()))  # [L]
    table_col = (j // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables[chunks][:, table_col] * block_size + j % block_size  # [G, L]
    mask = (j <= qpos[..., None]) & (j < ctx[:, None, None])  # [G, Q, L]
    if sliding_window is not None:
        mask &= j > qpos[..., None] - sliding_window  # HF: kv_idx > q_idx - sliding_window
    return _ChunkGroup(rows=rows, valid=None if bool(valid.all()) else valid, slots=slots, mask=mask[:, None])


@dataclass
class AttnInput:
    """One batch of chunks entering attention(b). Block 0 takes token_ids; later blocks the previous MoE outputs."""

    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64 flat KV slots
    cu_rows: torch.Tensor  # [R + 1] int64 chunk boundaries
    context_lens: torch.Tensor  # [R] int64 tokens of the request after this chunk
    block_tables: torch.Tensor  # [R, max_blocks] int64
    token_ids: torch.Tensor | None = None  # [N] int64, block 0 only
    residual: torch.Tensor | None = None  # [N, H]
    expert_out: torch.Tensor | None = None  # [N, K, H] already multiplied by their top-k weight
    expert_ids: torch.Tensor | None = None  # [N, K] int64
    plan: AttnPlan | None = None  # optional cache of derived indices, reusable across blocks of one step


@dataclass
class AttnOutput:
    residual: torch.Tensor  # [N, H] after the attention add
    moe_input: torch.Tensor  # [N, H] post-attention RMSNorm
    topk_ids: torch.Tensor  # [N, K] int64
    topk_weights: torch.Tensor  # [N, K] float32


class AttentionLayer:
    """Attention of block `block` (with its router); block 0 also embeds token ids."""

    def __init__(
        self, block: int, cfg: ModelConfig, weights: AttentionWeights, embed: torch.Tensor | None = None
    ) -> None:
        if block == 0 and embed is None:
            raise ValueError("the attention layer of block 0 needs the embedding table")
        self.block = block
        self.cfg = cfg
        self.embed = embed  # [V, H] for block 0
        self.input_norm, self.post_norm = weights.input_norm, weights.post_norm  # [H]
        # One matmul instead of three: decode batches are small, so per-call overhead matters.
        self.qkv_proj = torch.cat([weights.q_proj, weights.k_proj, weights.v_proj])  # [(heads + 2 kv) * D, H]
        self._qkv_sizes = [weights.q_proj.shape[0], weights.k_proj.shape[0], weights.v_proj.shape[0]]
        self.o_proj = weights.o_proj  # [H, heads * D]
        self.router = weights.router  # [E, H]
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, self.o_proj.device)

    def forward(self, inp: AttnInput, kv: PagedKVCache) -> AttnOutput:
        """Merge, attend (writing this chunk's K/V at inp.slot_mapping first), add, norm and route."""
        hidden = self._input_hidden(inp)  # [N, H]
        attn = self._attend(rms_norm(hidden, self.input_norm, self.cfg.rms_norm_eps), inp, kv)
        residual = hidden + F.linear(attn, self.o_proj)  # [N, H]
        moe_input = rms_norm(residual, self.post_norm, self.cfg.rms_norm_eps)
        topk_ids, topk_weights = route(moe_input, self.router, self.cfg.top_k)
        return AttnOutput(
            residual=residual, moe_input=moe_input, topk_ids=topk_ids, topk_weights=topk_weights
        )

    __call__ = forward

    def _input_hidden(self, inp: AttnInput) -> torch.Tensor:
        if self.block == 0:
            return F.embedding(inp.token_ids, self.embed)
        return merge_expert_outputs(inp.residual, inp.expert_out, inp.expert_ids)

    def _attend(self, x: torch.Tensor, inp: AttnInput, kv: PagedKVCache) -> torch.Tensor:
        """x [N, H] → attention output [N, heads * D] (before o_proj)."""
        n, d = x.shape[0], self.cfg.head_dim
        qkv = F.linear(x, self.qkv_proj)  # [N, (heads + 2 * kv_heads) * D]
        q, k, v = qkv.split(self._qkv_sizes, dim=-1)
        q, k, v = q.view(n, -1, d), k.reshape(n, -1, d), v.reshape(n, -1, d)  # [N, heads | kv_heads, D]
        cos, sin = self.rope.cos_sin(inp.positions, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.write(self.block, inp.slot_mapping, k, v)
        plan = inp.plan or AttnPlan.build(
            inp.positions,
            inp.cu_rows,
            inp.context_lens,
            inp.block_tables,
            kv.block_size,
            self.cfg.sliding_window,
        )
        out = torch.empty_like(q)  # [N, heads, D]
        for group in plan.groups:
            self._attend_group(q, kv, group, out)
        return out.view(n, -1)

    def _attend_group(self, q: torch.Tensor, kv: PagedKVCache, g: _ChunkGroup, out: torch.Tensor) -> None:
        keys, values = kv.gather(self.block, g.slots)  # [G, L, kv_heads, D]
        queries = q.index_select(0, g.rows.flatten()).view(*g.rows.shape, *q.shape[1:])  # [G, Q, heads, D]
        o = F.scaled_dot_product_attention(
            queries.transpose(1, 2),  # [G, heads, Q, D]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=g.mask,
            enable_gqa=True,
        ).transpose(1, 2)  # [G, Q, heads, D]
        if g.valid is None:
            out.index_copy_(0, g.rows.flatten(), o.flatten(0, 1))
        else:
            out[g.rows[g.valid]] = o[g.valid]
