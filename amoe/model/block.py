"""What an attention rank runs for one engine block: merge the previous block's expert outputs into the residual,
run the block's dense decoder layers whole (attention + MLP: DeepSeek's first k, Qwen's mlp_only_layers — no
expert hop for them), then its MoE layer's attention, post-attention norm and router."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from amoe.model.attention import AttnInput, AttnOutput, AttnPlan, GQAttention
from amoe.model.kv_cache import LatentKVCache, PagedKVCache
from amoe.model.mla import MLAttention
from amoe.model.moe import SwiGLU, merge_expert_outputs
from amoe.model.ops import RotaryEmbedding, rms_norm
from amoe.model.routing import Router
from amoe.model.spec import ModelConfig
from amoe.model.weights import LayerWeights


class DecoderLayer:
    """Decoder layer `layer` on the attention rank: its attention, and its dense MLP or its router."""

    def __init__(self, layer: int, cfg: ModelConfig, w: LayerWeights, rope: RotaryEmbedding) -> None:
        self.layer, self.cfg = layer, cfg
        self.input_norm, self.post_norm = w.input_norm, w.post_norm  # [H]
        attention = MLAttention if cfg.mla is not None else GQAttention
        self.attention = attention(layer, cfg, w.attention, rope)
        self.mlp = SwiGLU(w.mlp, fused=False) if w.mlp is not None else None  # transformers' MLP: two matmuls
        self.router = Router(cfg, w) if w.router is not None else None

    def attend(self, hidden: torch.Tensor, inp: AttnInput, kv, table, plan: AttnPlan) -> torch.Tensor:
        """hidden [N, H] → the residual after the attention add."""
        return hidden + self.attention(
            rms_norm(hidden, self.input_norm, self.cfg.rms_norm_eps), inp, kv, table, plan
        )

    def dense(self, residual: torch.Tensor) -> torch.Tensor:
        """A dense layer's second half: residual + MLP(norm(residual))."""
        return residual + self.mlp(rms_norm(residual, self.post_norm, self.cfg.rms_norm_eps))


class AttentionLayer:
    """The attention step of engine block `block` (decoder layers cfg.block_layers(block)); block 0 also embeds
    token ids."""

    def __init__(
        self,
        block: int,
        cfg: ModelConfig,
        layers: list[DecoderLayer],
        rope: RotaryEmbedding,
        embed: torch.Tensor | None = None,
    ) -> None:
        if block == 0 and embed is None:
            raise ValueError("the attention layer of block 0 needs the embedding table")
        self.block, self.cfg, self.rope = block, cfg, rope
        self.embed = embed  # [V, H] for block 0
        self.dense_layers, self.moe_layer = layers[:-1], layers[-1]

    def forward(self, inp: AttnInput, kv: PagedKVCache | LatentKVCache) -> AttnOutput:
        """Merge, run the dense layers, attend (writing this chunk's cache rows first), add, norm and route."""
        hidden = self._input_hidden(inp)  # [N, H]
        plan = inp.plan or AttnPlan.build(
            inp.positions,
            inp.cu_rows,
            inp.context_lens,
            inp.block_tables,
            kv.block_size,
            self.cfg.sliding_window,
        )
        table = self.rope.table(inp.positions, hidden.dtype)
        for layer in self.dense_layers:
            hidden = layer.dense(layer.attend(hidden, inp, kv, table, plan))
        residual = self.moe_layer.attend(hidden, inp, kv, table, plan)
        moe_input = rms_norm(residual, self.moe_layer.post_norm, self.cfg.rms_norm_eps)
        topk_ids, topk_weights = self.moe_layer.router(moe_input)
        return AttnOutput(
            residual=residual, moe_input=moe_input, topk_ids=topk_ids, topk_weights=topk_weights
        )

    __call__ = forward

    def _input_hidden(self, inp: AttnInput) -> torch.Tensor:
        if self.block == 0:
            return F.embedding(inp.token_ids, self.embed)
        return merge_expert_outputs(inp.residual, inp.expert_out, inp.expert_ids)
