"""Attention over the paged KV cache: the per-step plan (which slots each chunk reads, its causal and sliding-window
mask), the batch that enters a block's attention step, and grouped-query attention (Mixtral, Qwen, OLMoE: optional
q/k/v biases, QK-norm per head or over the whole projection, q/k/v clipping). MLA (DeepSeek) is amoe.model.mla."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from amoe.model import weights as W
from amoe.model.kv_cache import PagedKVCache
from amoe.model.ops import RotaryEmbedding, rms_norm
from amoe.model.spec import ModelConfig


@dataclass
class ChunkGroup:
    """Chunks attended in one padded SDPA call: [G chunks, Q query rows, L context keys]."""

    rows: torch.Tensor  # [G, Q] row of each query (padding repeats the chunk's first row)
    valid: torch.Tensor | None  # [G, Q] bool; None when no padding
    slots: torch.Tensor  # [G, L] KV slot of each context position
    mask: torch.Tensor  # [G, 1, Q, L] bool: True = may attend
    whole: bool = False  # the rows are every row of the batch, in order: no gather or scatter of queries
    context: torch.Tensor | None = (
        None  # [S] flat (g, j) of the positions inside their chunk's context; None: all
    )


@dataclass
class AttnPlan:
    """Gather indices and masks derived from the chunk metadata; the same for every block of one step."""

    groups: list[ChunkGroup]

    def to(self, device: torch.device) -> AttnPlan:
        """The plan's indices and masks on `device` (built on the host, used where the KV cache is)."""
        if all(g.slots.device == device for g in self.groups):
            return self

        def put(t):
            return None if t is None else t.to(device, non_blocking=True)

        return AttnPlan(
            [
                ChunkGroup(put(g.rows), put(g.valid), put(g.slots), put(g.mask), g.whole, put(g.context))
                for g in self.groups
            ]
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
    whole = rows.numel() == positions.numel() and bool((rows.flatten() == torch.arange(rows.numel())).all())
    in_context = (
        j[None, :] < ctx[:, None]
    ).flatten()  # [G * L]: padding past a shorter chunk's context is not
    return ChunkGroup(
        rows=rows, valid=None if bool(valid.all()) else valid, slots=slots, mask=mask[:, None], whole=whole,
        context=None if bool(in_context.all()) else in_context.nonzero().flatten(),
    )  # fmt: skip


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
    topk_ids: torch.Tensor  # [N, K'] int64 (K' = top-k, plus the shared expert)
    topk_weights: torch.Tensor  # [N, K'] float32


def linear_bias(w: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    return w.get(f"{name}.bias")


class GQAttention:
    """Grouped-query attention of decoder layer `layer`: x [N, H] (normed) → [N, H] after o_proj, writing this
    chunk's K/V at its slots first."""

    def __init__(
        self, layer: int, cfg: ModelConfig, w: dict[str, torch.Tensor], rope: RotaryEmbedding
    ) -> None:
        self.layer, self.cfg, self.rope = layer, cfg, rope
        # One matmul instead of three: decode batches are small, so per-call overhead matters. The loader reads the
        # three into one tensor (a concatenation here would hold a second copy while the parts live).
        self.qkv_proj = w[f"{W.FUSED_QKV}.weight"]  # [(heads + 2 kv) * D, H]
        self.qkv_bias = w[f"{W.FUSED_QKV}.bias"] if cfg.attention_bias else None
        self._sizes = [w[f"{n}.weight"].shape[0] for n in W.QKV]
        self.o_proj, self.o_bias = w["o_proj.weight"], linear_bias(w, "o_proj")  # [H, heads * D]
        self.q_norm, self.k_norm = w.get("q_norm.weight"), w.get("k_norm.weight")
        self.scale = cfg.head_dim**-0.5  # as transformers passes it (not SDPA's own 1/sqrt(D))

    def __call__(
        self, x: torch.Tensor, inp: AttnInput, kv: PagedKVCache, table, plan: AttnPlan
    ) -> torch.Tensor:
        n, d, cfg = x.shape[0], self.cfg.head_dim, self.cfg
        q, k, v = F.linear(x, self.qkv_proj, self.qkv_bias).split(self._sizes, dim=-1)
        if cfg.qk_norm == "proj":  # OLMoE: over the whole projection, before the split into heads
            q, k = rms_norm(q, self.q_norm, cfg.rms_norm_eps), rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q, k, v = q.reshape(n, -1, d), k.reshape(n, -1, d), v.reshape(n, -1, d)  # [N, heads | kv_heads, D]
        if cfg.qk_norm == "head":  # Qwen3: per head
            q, k = rms_norm(q, self.q_norm, cfg.rms_norm_eps), rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = self.rope.apply(q, table), self.rope.apply(k, table)
        kv.write(self.layer, inp.slot_mapping, k, v)
        out = torch.empty_like(q)  # [N, heads, D]
        for group in plan.groups:
            self._attend_group(q, kv, group, out)
        return F.linear(out.view(n, -1), self.o_proj, self.o_bias)

    def _attend_group(self, q: torch.Tensor, kv: PagedKVCache, g: ChunkGroup, out: torch.Tensor) -> None:
        keys, values = kv.gather(self.layer, g.slots)  # [G, L, kv_heads, D]
        queries = gather_rows(q, g)  # [G, Q, heads, D]
        o = F.scaled_dot_product_attention(
            queries.transpose(1, 2),  # [G, heads, Q, D]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=g.mask,
            enable_gqa=True,
            scale=self.scale,
        ).transpose(1, 2)  # [G, Q, heads, D]
        scatter_rows(out, g, o)


def gather_rows(q: torch.Tensor, g: ChunkGroup) -> torch.Tensor:
    """The group's query rows of q [N, ...] as [G, Q, ...]."""
    if g.whole:
        return q.view(*g.rows.shape, *q.shape[1:])
    return q.index_select(0, g.rows.flatten()).view(*g.rows.shape, *q.shape[1:])


def scatter_rows(out: torch.Tensor, g: ChunkGroup, o: torch.Tensor) -> None:
    """Each query row's output [G, Q, ...] back to its row of `out` [N, ...] (padding rows dropped)."""
    if g.whole:
        out.copy_(o.reshape(out.shape))
    elif g.valid is None:
        out.index_copy_(0, g.rows.flatten(), o.flatten(0, 1))
    else:
        out[g.rows[g.valid]] = o[g.valid]
