"""DeepSeek-V2 / V3 (V2-Lite, V3, R1): multi-head latent attention (the KV cache holds a compressed latent and one
rope key), the first `first_k_dense_replace` layers dense, `n_shared_experts` shared experts (one MLP of their
combined width), and grouped (node-limited) routing:

* V2: softmax scores; `greedy` top-k, or `group_limited_greedy` (only the `topk_group` groups with the best single
  score compete); weights × routed_scaling_factor, not renormalised (transformers ignores norm_topk_prob here).
* V3: sigmoid scores plus a learnt correction bias choose (groups ranked by the sum of their two best), the
  unbiased scores weigh, renormalised when norm_topk_prob, × routed_scaling_factor.

RoPE: V2 rotates interleaved pairs as complex numbers; V3 rotates the same pairs de-interleaved (rope_interleave)."""

from __future__ import annotations

from typing import Any

from amoe.model.families.base import Family, either
from amoe.model.spec import MlaShape, RouterSpec


class _DeepSeek(Family):
    shared = "mlp.shared_experts"
    default_first_dense = 0
    default_shared = 2

    def fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported (no released DeepSeek model has it)")
        layers, first_dense = (
            hf["num_hidden_layers"],
            hf.get("first_k_dense_replace", self.default_first_dense),
        )
        shared = hf.get("n_shared_experts", self.default_shared) or 0
        mla = MlaShape(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
        )
        bias = bool(hf.get("attention_bias", False))
        return dict(
            head_dim=mla.qk_head_dim,
            num_kv_heads=hf["num_attention_heads"],  # MLA: every head reads the one latent
            intermediate_size=hf["moe_intermediate_size"],
            num_blocks=layers - first_dense,
            dense_layers=tuple(range(first_dense)),
            dense_intermediate_size=hf["intermediate_size"] if first_dense else 0,
            num_experts=either(hf, "n_routed_experts", "num_local_experts"),
            top_k=hf["num_experts_per_tok"],
            shared_intermediate_size=hf["moe_intermediate_size"] * shared,
            attention_bias=bias,
            o_bias=bias,
            mla=mla,
            router=self.router(hf),
        )

    def router(self, hf: dict[str, Any]) -> RouterSpec:
        raise NotImplementedError


class DeepseekV2(_DeepSeek):
    architecture = "DeepseekV2ForCausalLM"
    model_type = "deepseek_v2"
    default_bos_eos = (1, 2)

    def fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(hf), "rope_style": "complex"}

    def router(self, hf: dict[str, Any]) -> RouterSpec:
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(
                f"topk_method {method!r} is not supported for deepseek_v2 (greedy, group_limited_greedy)"
            )
        grouped = method == "group_limited_greedy"
        return RouterSpec(
            method=method,
            norm_topk_prob=False,
            num_groups=hf["n_group"] if grouped else 1,
            topk_groups=hf["topk_group"] if grouped else 1,
            scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        )


class DeepseekV3(_DeepSeek):
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    default_bos_eos = (0, 1)
    default_first_dense = 3
    default_shared = 1

    def fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            **super().fields(hf),
            "rope_style": "interleave" if hf.get("rope_interleave", True) else "half",
        }

    def router(self, hf: dict[str, Any]) -> RouterSpec:
        return RouterSpec(
            method="noaux_tc",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            num_groups=hf.get("n_group") or 1,
            topk_groups=hf.get("topk_group") or 1,
            scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
        )


DEEPSEEK_V2 = DeepseekV2()
DEEPSEEK_V3 = DeepseekV3()
