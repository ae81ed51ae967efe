"""Qwen2-MoE (Qwen1.5-MoE): biased q/k/v, softmax top-k *not* renormalised (norm_topk_prob false), and a shared
expert whose output is scaled by sigmoid(shared_expert_gate(x)); dense layers by mlp_only_layers or
decoder_sparse_step."""

from __future__ import annotations

from typing import Any

from amoe.model.families.base import Family, either, qwen_dense_layers
from amoe.model.spec import RouterSpec


class Qwen2Moe(Family):
    architecture = "Qwen2MoeForCausalLM"
    model_type = "qwen2_moe"
    shared = "mlp.shared_expert"
    shared_gate = "mlp.shared_expert_gate"

    def fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        if hf.get("use_sliding_window"):
            # Its layers alternate sliding and full attention (layer_types); amoe has one window per model.
            raise ValueError("use_sliding_window is not supported for qwen2_moe")
        layers = hf["num_hidden_layers"]
        dense = qwen_dense_layers(hf, layers)
        return dict(
            intermediate_size=hf["moe_intermediate_size"],
            num_blocks=layers - len(dense),
            dense_layers=dense,
            dense_intermediate_size=hf["intermediate_size"] if dense else 0,
            num_experts=either(hf, "num_experts", "num_local_experts"),
            top_k=hf["num_experts_per_tok"],
            shared_intermediate_size=hf["shared_expert_intermediate_size"],
            shared_gate=True,
            attention_bias=bool(hf.get("qkv_bias", True)),
            router=RouterSpec(
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), weights_in_model_dtype=True
            ),
        )


QWEN2_MOE = Qwen2Moe()
