"""What every family shares: reading the common fields of a transformers config.json, and the tensor names
transformers gives a decoder (`model.layers.N.self_attn.*`, `input_layernorm`, ...). A family module subclasses
`Family`: it names its architecture, reads its own fields into a ModelConfig, and says where its MoE tensors live."""

from __future__ import annotations

from typing import Any

from amoe.model.spec import ModelConfig, Yarn

HF_NAMES = ("gate_proj", "up_proj", "down_proj")


class Family:
    """One architecture of config.json's `architectures` (and its `model_type`, for files without that list).

    Tensor naming (how transformers saves the family): the MoE block's prefix inside a layer (`moe`), the names of
    one expert's gate, up and down projections (`expert_projs`), where the shared expert lives (`shared`) and its
    gate (`shared_gate`). Packed experts (`<moe>.experts.gate_up_proj` / `down_proj`) load for every family.
    """

    architecture: str = ""
    model_type: str = ""
    default_rope_theta: float = 10_000.0  # transformers' default when config.json has none
    default_rms_norm_eps: float = 1e-6
    default_bos_eos: tuple[int | None, int | None] = (None, None)
    moe: str = "mlp"
    expert_projs: tuple[str, str, str] = HF_NAMES
    shared: str = ""
    shared_gate: str = ""

    def config(self, hf: dict[str, Any]) -> ModelConfig:
        """The ModelConfig of a config.json of this family."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        return ModelConfig(**{**self.common_fields(hf), **self.fields(hf)})

    def fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The family's own ModelConfig fields (experts, layers, attention and router variants)."""
        raise NotImplementedError

    def common_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        bos, eos = self.default_bos_eos
        eos = hf.get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        theta, yarn = rope(hf, self.default_rope_theta)
        return dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or head_dim(hidden, heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", self.default_rms_norm_eps)),
            rope_theta=theta,
            rope_yarn=yarn,
            max_position_embeddings=hf.get("max_position_embeddings", 4096 * 32),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id", bos),
            eos_token_id=eos_ids[0] if eos_ids else None,
            eos_token_ids=eos_ids,
            dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch."),
            architecture=self.architecture,
        )


def head_dim(hidden: int, heads: int) -> int:
    if heads <= 0 or hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return hidden // heads


def rope(hf: dict[str, Any], default_theta: float) -> tuple[float, Yarn | None]:
    """(theta, YaRN scaling or None). transformers 5 keeps rope settings under rope_parameters; older files have
    rope_theta / rope_scaling."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default' and 'yarn' RoPE)")
    original = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    original = original or hf["max_position_embeddings"]
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    optional = {k: params[k] for k in ("mscale", "mscale_all_dim", "attention_factor") if params.get(k)}
    return theta, Yarn(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        **{k: float(v) for k, v in optional.items()},
    )


def qwen_dense_layers(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Qwen's dense layers: those in mlp_only_layers, or off the decoder_sparse_step (or all without experts)."""
    only = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1) or 1
    moe = (hf.get("num_experts") or hf.get("num_local_experts") or 0) > 0
    return tuple(i for i in range(num_layers) if i in only or not (moe and (i + 1) % step == 0))


def either(hf: dict[str, Any], *names: str) -> Any:
    """The first of `names` config.json has (transformers renames some fields between versions); KeyError naming
    the first otherwise."""
    for name in names:
        if name in hf:
            return hf[name]
    raise KeyError(names[0])
