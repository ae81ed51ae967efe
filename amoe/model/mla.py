"""Multi-head latent attention (DeepSeek-V2/V3) over the latent KV cache.

Per token and layer the cache holds what transformers' cache holds: the normalised compressed latent
(kv_lora_rank) and the rotated rope key (qk_rope_head_dim), side by side in one paged row (LatentKVCache). The
attention rank decodes every head's keys and values from the context's latents (kv_b_proj) when it attends, as
transformers does, so the scores are the same floats; the cache is (kv_lora_rank + rope) wide instead of
heads × (qk_head_dim + v_head_dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from amoe.model.attention import AttnInput, AttnPlan, ChunkGroup, gather_rows, linear_bias, scatter_rows
from amoe.model.kv_cache import LatentKVCache
from amoe.model.ops import RotaryEmbedding, rms_norm, yarn_mscale
from amoe.model.spec import ModelConfig

# transformers builds the latents' RMSNorms with their default eps, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention:
    """MLA of decoder layer `layer`: x [N, H] (normed) → [N, H] after o_proj, writing this chunk's latent and
    rope key at its slots first."""

    def __init__(
        self, layer: int, cfg: ModelConfig, w: dict[str, torch.Tensor], rope: RotaryEmbedding
    ) -> None:
        self.layer, self.cfg, self.rope, self.m = layer, cfg, rope, cfg.mla
        self.q_proj = w.get("q_proj.weight")  # [heads * qk, H] without a query LoRA
        self.q_a, self.q_a_bias = w.get("q_a_proj.weight"), linear_bias(w, "q_a_proj")  # [q_rank, H]
        self.q_a_norm, self.q_b = w.get("q_a_layernorm.weight"), w.get("q_b_proj.weight")
        self.kv_a, self.kv_a_bias = w["kv_a_proj_with_mqa.weight"], linear_bias(w, "kv_a_proj_with_mqa")
        self.kv_a_norm = w["kv_a_layernorm.weight"]  # [kv_rank]
        self.kv_b = w["kv_b_proj.weight"]  # [heads * (nope + v), kv_rank]
        self.o_proj, self.o_bias = w["o_proj.weight"], linear_bias(w, "o_proj")  # [H, heads * v]
        self.scale = self.m.qk_head_dim**-0.5
        yarn = cfg.rope_yarn
        if yarn is not None and yarn.mscale_all_dim:
            self.scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2

    def __call__(
        self, x: torch.Tensor, inp: AttnInput, kv: LatentKVCache, table, plan: AttnPlan
    ) -> torch.Tensor:
        m, n = self.m, x.shape[0]
        if self.q_proj is not None:
            q = F.linear(x, self.q_proj)
        else:
            q = F.linear(
                rms_norm(F.linear(x, self.q_a, self.q_a_bias), self.q_a_norm, LATENT_NORM_EPS), self.q_b
            )
        q_nope, q_rot = q.view(n, -1, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rot = F.linear(x, self.kv_a, self.kv_a_bias).split(
            [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1
        )
        latent = rms_norm(latent, self.kv_a_norm, LATENT_NORM_EPS)  # [N, kv_rank]
        k_rot = self.rope.apply(k_rot.reshape(n, 1, -1), table)  # [N, 1, rope]: one key shared by every head
        kv.write(self.layer, inp.slot_mapping, torch.cat([latent, k_rot.view(n, -1)], dim=-1))
        query = torch.cat([q_nope, self.rope.apply(q_rot, table)], dim=-1)  # [N, heads, qk]
        out = x.new_empty(n, self.cfg.num_heads, m.v_head_dim)
        for group in plan.groups:
            self._attend_group(query, kv, group, out)
        return F.linear(out.view(n, -1), self.o_proj, self.o_bias)

    def _attend_group(self, query: torch.Tensor, kv: LatentKVCache, g: ChunkGroup, out: torch.Tensor) -> None:
        m = self.m
        G, L = g.slots.shape  # noqa: N806 (shape names)
        decoded, k_rot = self._decode_context(kv, g)  # [G * L, heads * (nope + v)], [G * L, rope]
        # Keys and values laid out as transformers lays them out ([G, heads, L, *], keys contiguous): SDPA's CPU
        # kernel rounds differently with other strides when key and value widths differ.
        decoded = decoded.view(G, L, -1, m.qk_nope_head_dim + m.v_head_dim).transpose(1, 2)
        k_nope, values = decoded.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)  # [G, heads, L, *]
        keys = decoded.new_empty(*k_nope.shape[:-1], m.qk_head_dim)
        keys[..., : m.qk_nope_head_dim].copy_(k_nope)
        keys[..., m.qk_nope_head_dim :].copy_(k_rot.view(G, 1, L, -1))  # the one rope key, every head
        queries = gather_rows(query, g)  # [G, Q, heads, qk]
        o = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys, values, attn_mask=g.mask, scale=self.scale
        ).transpose(1, 2)  # [G, Q, heads, v]
        scatter_rows(out, g, o)

    def _decode_context(self, kv: LatentKVCache, g: ChunkGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's keys and values decoded from the group's context latents [G * L, heads * (nope + v)], and
        the rope keys [G * L, rope]. Only positions inside their chunk's context are decoded: the others pad a
        shorter chunk to the group's length, are masked, and stay zero — decoding is most of MLA's arithmetic."""
        m, flat = self.m, g.slots.flatten()
        if g.context is not None:
            flat = flat.index_select(0, g.context)
        latent, k_rot = kv.gather(self.layer, flat).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        decoded = F.linear(latent, self.kv_b)  # [S, heads * (nope + v)]
        if g.context is None:
            return decoded, k_rot
        padded = decoded.new_zeros(g.slots.numel(), decoded.shape[1]).index_copy_(0, g.context, decoded)
        return padded, k_rot.new_zeros(g.slots.numel(), k_rot.shape[1]).index_copy_(0, g.context, k_rot)
