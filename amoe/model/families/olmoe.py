"""OLMoE (OLMoE-1B-7B): RMSNorm over the whole query and key projections (before the split into heads),
optional clipping of q/k/v, softmax top-k not renormalised, no shared expert."""

from __future__ import annotations

from typing import Any

from amoe.model.families.base import Family, either
from amoe.model.spec import RouterSpec


class Olmoe(Family):
    architecture = "OlmoeForCausalLM"
    model_type = "olmoe"
    default_rms_norm_eps = 1e-5
    default_bos_eos = (None, 50279)

    def fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        bias = bool(hf.get("attention_bias", False))
        clip = hf.get("clip_qkv")
        return dict(
            head_dim=hf["hidden_size"] // hf["num_attention_heads"],  # OLMoE's k_norm width assumes it
            intermediate_size=hf["intermediate_size"],
            num_blocks=hf["num_hidden_layers"],
            num_experts=either(hf, "num_experts", "num_local_experts"),
            top_k=hf["num_experts_per_tok"],
            attention_bias=bias,
            o_bias=bias,
            qk_norm="proj",
            clip_qkv=None if clip is None else float(clip),
            router=RouterSpec(
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), weights_in_model_dtype=True
            ),
        )


OLMOE = Olmoe()
