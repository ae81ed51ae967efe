"""ModelConfig: the model's shape, validated once — what every family's config.json becomes (amoe.model.config
reads one with the family module its `architectures` names)."""

from __future__ import annotations

from dataclasses import dataclass

from amoe.config import DTYPE_NAMES

QK_NORMS = ("none", "head", "proj")
ROPE_STYLES = ("half", "interleave", "complex")
ROUTER_METHODS = ("softmax", "greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (DeepSeek's long context), as transformers' `_compute_yarn_parameters` reads it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MlaShape:
    """DeepSeek's multi-head latent attention: queries through an optional low-rank pair, keys and values from one
    compressed latent (what the KV cache holds) plus a single rope key shared by every head."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class RouterSpec:
    """How a token picks its experts: `method` is transformers' name for it (softmax = Mixtral's top-k)."""

    method: str = "softmax"  # softmax | greedy | group_limited_greedy (DeepSeek-V2) | noaux_tc (V3)
    norm_topk_prob: bool = True  # renormalise the picked weights to sum to 1
    num_groups: int = 1  # node-limited routing: experts in groups, only the best `topk_groups` groups compete
    topk_groups: int = 1
    scaling_factor: float = 1.0  # routed_scaling_factor
    weights_in_model_dtype: bool = False  # Qwen, OLMoE: the weights are rounded to the model dtype

    def __post_init__(self) -> None:
        if self.method not in ROUTER_METHODS:
            raise ValueError(
                f"router method {self.method!r} is not supported (one of {', '.join(ROUTER_METHODS)})"
            )
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group ({self.topk_groups}) must be in [1, n_group ({self.num_groups})]")
        if not self.scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor must be positive, got {self.scaling_factor}")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of an MoE decoder; every field validated once in __post_init__.

    Blocks and layers: the model has `num_layers` decoder layers; `num_blocks` of them are MoE layers (the
    engine's blocks, each ending at a router), the others (`dense_layers`) have a dense MLP and run inside the
    attention step of the next MoE layer's block. Experts: `num_experts` routed experts pick `top_k` per token;
    a shared expert (`shared_intermediate_size` > 0) is expert id `num_experts` of every block, picked by every
    token (docs/engine.md "Families")."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # a routed expert's
    num_blocks: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    # Beyond the contract: HF allows several eos ids; all of them end a request.
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's dtype
    architecture: str = "MixtralForCausalLM"  # config.json's, which names the family module
    dense_layers: tuple[int, ...] = ()  # decoder layers with a dense MLP (DeepSeek's first k)
    dense_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output is scaled by sigmoid(gate(x))
    attention_bias: bool = False  # q/k/v projections have biases
    o_bias: bool = False
    qk_norm: str = "none"  # none | head (RMSNorm per head: Qwen3) | proj (over the whole projection: OLMoE)
    clip_qkv: float | None = None
    mla: MlaShape | None = None
    rope_style: str = "half"  # half (rotate_half) | interleave (DeepSeek-V3) | complex (DeepSeek-V2)
    rope_yarn: Yarn | None = None
    router: RouterSpec = RouterSpec()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_blocks",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_experts",
            "top_k",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rotary_dim % 2:
            raise ValueError(f"the rotary dimension must be even, got {self.rotary_dim}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or null, got {self.sliding_window}")
        specials = [("bos_token_id", self.bos_token_id), ("eos_token_id", self.eos_token_id)]
        specials += [("eos_token_id", t) for t in self.eos_token_ids]
        for name, value in specials:
            if value is not None and (not isinstance(value, int) or not 0 <= value < self.vocab_size):
                raise ValueError(f"{name} {value!r} is outside the vocabulary [0, {self.vocab_size})")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        self._check_layers()
        if self.qk_norm not in QK_NORMS or self.rope_style not in ROPE_STYLES:
            raise ValueError(f"qk_norm {self.qk_norm!r} / rope_style {self.rope_style!r} is not supported")
        if self.router.num_groups > 1 and self.num_experts % self.router.num_groups:
            raise ValueError(
                f"n_group ({self.router.num_groups}) must divide num_experts ({self.num_experts})"
            )

    def _check_layers(self) -> None:
        if len(set(self.dense_layers)) != len(self.dense_layers) or any(
            not 0 <= layer < self.num_layers for layer in self.dense_layers
        ):
            raise ValueError(f"dense layers {list(self.dense_layers)} are not distinct layers of the model")
        if self.num_layers - 1 in self.dense_layers:
            # The head would have to run attention for it: no family places a dense layer last.
            raise ValueError("the last decoder layer is dense; amoe needs it to be an MoE layer")
        if self.dense_layers and self.dense_intermediate_size <= 0:
            raise ValueError("dense layers need a positive intermediate_size")
        if self.shared_intermediate_size < 0:
            raise ValueError(
                f"shared expert intermediate size must be >= 0, got {self.shared_intermediate_size}"
            )

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every eos id of the model (the first is eos_token_id)."""
        if self.eos_token_ids:
            return self.eos_token_ids
        return () if self.eos_token_id is None else (self.eos_token_id,)

    @property
    def num_layers(self) -> int:
        """Decoder layers: every one has attention and a KV cache layer."""
        return self.num_blocks + len(self.dense_layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The decoder layer of each block, ascending."""
        dense = set(self.dense_layers)
        return tuple(layer for layer in range(self.num_layers) if layer not in dense)

    def block_layers(self, block: int) -> range:
        """The decoder layers the attention step of `block` runs: the dense ones before its MoE layer, then it."""
        moe = self.moe_layers
        return range(moe[block - 1] + 1 if block else 0, moe[block] + 1)

    @property
    def num_shared_experts(self) -> int:
        """Shared expert layers per block (0 or 1: several of a checkpoint's are one wider MLP)."""
        return 1 if self.shared_intermediate_size else 0

    @property
    def num_expert_ids(self) -> int:
        """Expert layers per block the engine routes to: the routed experts, then the shared one."""
        return self.num_experts + self.num_shared_experts

    @property
    def experts_per_token(self) -> int:
        """Expert outputs each token's next block merges: its top-k and the shared expert."""
        return self.top_k + self.num_shared_experts

    @property
    def rotary_dim(self) -> int:
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def kv_elements_per_token(self) -> int:
        """Cache entries per token and layer: K and V, or MLA's latent and rope key."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def expert_intermediate(self, expert: int) -> int:
        """Width of expert id `expert`'s SwiGLU (the shared one is usually wider)."""
        return self.shared_intermediate_size if expert >= self.num_experts else self.intermediate_size
