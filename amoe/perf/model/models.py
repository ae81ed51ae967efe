"""Model profiles: the shapes of each model the cost model prices (weights, KV bytes and attention FLOPs per
block), from the models' config.json files, and the `NAME:N` truncation benchmarks run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from amoe.errors import ConfigError
from amoe.perf.model.gpus import PRECISION_BYTES, lookup

PRECISIONS = tuple(PRECISION_BYTES)


@dataclass(frozen=True)
class ModelProfile:
    """The shapes a cost model needs: per-block weights, KV bytes and attention FLOPs per context token."""

    name: str
    vocab_size: int
    hidden_size: int
    num_blocks: int
    num_experts: int
    top_k: int
    expert_intermediate: int  # per routed expert; SwiGLU: gate, up [H, I] and down [I, H]
    attn_params: int  # per block: attention projections + router (weights, not bytes)
    kv_bytes_per_token: int  # per block, per context token
    attn_flops_per_context_token: int  # per block, per query row, per token of context (QK and PV)
    num_heads: int  # for the runtime's ModelConfig only; the cost uses the fields above
    num_kv_heads: int
    head_dim: int
    # Shared expert layers (0 or 1): expert id num_experts of every block, run on the expert GPU that hosts it and
    # picked by every token, as amoe runs it (docs/engine.md "Families").
    num_shared_experts: int = 0
    shared_intermediate: int = 0
    max_position_embeddings: int = 32768
    bytes_per_activation: int = 2  # BF16 activations and KV
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    source: str = ""
    full_blocks: int | None = None  # a `NAME:N` profile: the model's own depth (None: num_blocks)
    # The precision of the attention side's GEMM weights and of the experts' (gpus.PRECISION_BYTES: bf16, fp8,
    # fp4): bytes per weight, and the GPU's tensor-core rate at it (GpuProfile.peak_at). The attention core
    # (FlashMLA, FlashAttention) and the lm_head stay BF16.
    attn_precision: str = "bf16"
    expert_precision: str = "bf16"
    head_bytes_per_param: int = 2  # embedding and lm_head
    dispatch_precision: str = (
        "bf16"  # rows sent to the experts (fp8: DeepEP's FP8 dispatch); combines stay BF16
    )
    num_layers: int | None = None  # decoder layers the blocks stand for (None: num_blocks)
    # Params of the attention side before its core (the projections in, the shared expert and dense MLPs that run
    # beside them): the first stage of a two-batch-overlap step (ep_scale.block_time). None: half of attn_params.
    attn_in_params: int | None = None
    # Prefill's attention core FLOPs per query row per context token where prefill runs another form than decode
    # (MLA: un-absorbed, 128-wide keys and values per head, as FlashAttention runs it); None: the decode form's.
    prefill_attn_flops_per_context_token: int | None = None
    # Group-limited routing (DeepSeek-V3: a token's experts in topk_group of n_group expert groups); 0: none.
    n_group: int = 0
    topk_group: int = 0

    def __post_init__(self) -> None:
        if self.top_k > self.num_experts:
            raise ConfigError(f"{self.name}: top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.num_shared_experts not in (0, 1):
            raise ConfigError(f"{self.name}: num_shared_experts must be 0 or 1 (several are one wider MLP)")
        for field, value in (("attn_precision", self.attn_precision), ("expert_precision", self.expert_precision),
                             ("dispatch_precision", self.dispatch_precision)):  # fmt: skip
            if value not in PRECISIONS:
                raise ConfigError(f"{self.name}: {field} {value!r}; choose from {', '.join(PRECISIONS)}")
        if self.dispatch_precision == "fp4":
            raise ConfigError(
                f"{self.name}: dispatch_precision fp4 is not modelled (DeepEP sends BF16 or FP8)"
            )

    @property
    def attn_bytes_per_param(self) -> float:
        """Bytes per weight of the attention side's GEMMs (projections, router, shared expert, dense MLPs)."""
        return PRECISION_BYTES[self.attn_precision]

    @property
    def bytes_per_param(self) -> float:
        """Bytes per weight of an expert (what an expert GPU holds and streams)."""
        return PRECISION_BYTES[self.expert_precision]

    @property
    def layers(self) -> int:
        return self.num_layers or self.num_blocks

    @property
    def attn_in(self) -> int:
        """Params of the attention side before its core (attn_in_params, or half of attn_params)."""
        return self.attn_params // 2 if self.attn_in_params is None else self.attn_in_params

    @property
    def prefill_flops_per_context_token(self) -> int:
        return self.prefill_attn_flops_per_context_token or self.attn_flops_per_context_token

    @property
    def head_share(self) -> float:
        """What part of the head a truncated profile pays: N / full depth. The head runs once per token whatever
        the depth, so a profile keeping 4 of 32 blocks would otherwise spend 8x the model's share of an
        iteration in it (18 % instead of ~3 %), and ratios between deployments would move with the truncation."""
        return self.num_blocks / (self.full_blocks or self.num_blocks)

    @property
    def head_bytes(self) -> int:
        """Bytes per parameter of the embedding and lm_head."""
        return self.head_bytes_per_param

    @property
    def dispatch_bytes(self) -> float:
        """Bytes per element of a hidden row on its way to the experts: an FP8 dispatch sends a byte per element and
        a float32 scale per 128 (DeepEP's and DeepSeek-V3's per-token block scales); the combine stays BF16."""
        if self.dispatch_precision == "fp8":
            return 1 + 4 / 128
        return self.bytes_per_activation

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_intermediate

    @property
    def num_expert_ids(self) -> int:
        """Expert layers per block: the routed experts, then the shared one."""
        return self.num_experts + self.num_shared_experts

    @property
    def experts_per_token(self) -> int:
        """Expert layers each token visits per block: its top-k and the shared expert."""
        return self.top_k + self.num_shared_experts

    def intermediate_of(self, expert: int) -> int:
        """SwiGLU width of expert id `expert` (the shared expert's from num_experts on)."""
        return self.shared_intermediate if expert >= self.num_experts else self.expert_intermediate

    def params_of(self, expert: int) -> int:
        return 3 * self.hidden_size * self.intermediate_of(expert)


def gqa_attention(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, num_experts: int):
    """(attn_params, kv_bytes_per_token, attn_flops_per_context_token) of a Mixtral-style GQA/MQA block, BF16."""
    q_and_o = 2 * hidden * num_heads * head_dim
    k_and_v = 2 * hidden * num_kv_heads * head_dim
    router = hidden * num_experts
    kv_bytes = 2 * num_kv_heads * head_dim * 2  # K and V, 2 bytes each
    flops = 4 * num_heads * head_dim  # QK^T and PV: 2 FLOPs per multiply-add, every query head
    return q_and_o + k_and_v + router, kv_bytes, flops


def _mixtral_8x7b(name: str, num_experts: int, top_k: int, source: str) -> ModelProfile:
    # mistralai/Mixtral-8x7B-v0.1 config.json: vocab 32000, hidden 4096, intermediate 14336, 32 layers,
    # 32 query heads of 128, 8 KV heads, max_position_embeddings 32768. AMoE §5 replaces GQA with MQA:
    # one KV head, which cuts the KV cache 8x (to 512 bytes per token per block).
    attn, kv, flops = gqa_attention(4096, 32, 1, 128, num_experts)
    return ModelProfile(
        name=name,
        vocab_size=32000,
        hidden_size=4096,
        num_blocks=32,
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate=14336,
        attn_params=attn,
        kv_bytes_per_token=kv,
        attn_flops_per_context_token=flops,
        num_heads=32,
        num_kv_heads=1,
        head_dim=128,
        source=source,
    )


def _deepseek_v3_like() -> ModelProfile:
    # deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 61 layers, vocab 129280, 256 routed experts of
    # intermediate 2048, 1 shared expert, top-8; MLA with 128 heads, q_lora_rank 1536, kv_lora_rank 512,
    # qk_nope 128 + qk_rope 64 head dims, v_head_dim 128.
    # Simplifications: all 61 blocks are MoE (the real first 3 are dense); weights costed in BF16 (the real model
    # serves FP8, which halves weight bytes). Attention weights per block: q_a 7168x1536 + q_b 1536x(128x192)
    # + kv_a 7168x(512+64) + kv_b 512x(128x256) + o (128x128)x7168 + router 7168x256.
    h, heads = 7168, 128
    attn = h * 1536 + 1536 * heads * 192 + h * 576 + 512 * heads * 256 + heads * 128 * h + h * 256
    return ModelProfile(
        name="deepseek-v3-like",
        vocab_size=129280,
        hidden_size=h,
        num_blocks=61,
        num_experts=256,
        top_k=8,
        expert_intermediate=2048,
        attn_params=attn,
        kv_bytes_per_token=(512 + 64) * 2,  # MLA caches the compressed latent and the rope key only
        # Decode with the absorbed MLA: every head scores 576-wide keys and sums 512-wide values.
        attn_flops_per_context_token=2 * heads * 576 + 2 * heads * 512,
        num_heads=heads,
        num_kv_heads=1,
        head_dim=128,
        num_shared_experts=1,
        shared_intermediate=2048,
        max_position_embeddings=163840,
        bos_token_id=0,
        eos_token_id=1,
        source="DeepSeek-V3 config.json shapes (MLA, 256 routed + 1 shared expert, top-8), BF16",
    )


def _deepseek_v2() -> ModelProfile:
    # deepseek-ai/DeepSeek-V2 config.json (huggingface.co/deepseek-ai/DeepSeek-V2): hidden_size 5120,
    # num_hidden_layers 60, vocab_size 102400, n_routed_experts 160, num_experts_per_tok 6, moe_intermediate_size
    # 1536, n_shared_experts 2, num_attention_heads 128, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
    # qk_rope_head_dim 64, v_head_dim 128, max_position_embeddings 163840, bos 100000, eos 100001. What EPS-MoE
    # (arXiv 2410.12247) runs on H800s. Simplifications: the two shared experts are one SwiGLU of width 2 x 1536
    # (the same FLOPs and bytes), every block is MoE (the real first one is dense), BF16.
    h, heads = 5120, 128
    attn = h * 1536 + 1536 * heads * 192 + h * 576 + 512 * heads * 256 + heads * 128 * h + h * 160
    return ModelProfile(
        name="deepseek-v2",
        vocab_size=102400,
        hidden_size=h,
        num_blocks=60,
        num_experts=160,
        top_k=6,
        expert_intermediate=1536,
        attn_params=attn,
        kv_bytes_per_token=(512 + 64) * 2,  # MLA's latent and rope key
        attn_flops_per_context_token=2 * heads * 576 + 2 * heads * 512,
        num_heads=heads,
        num_kv_heads=1,
        head_dim=128,
        num_shared_experts=1,
        shared_intermediate=2 * 1536,
        max_position_embeddings=163840,
        bos_token_id=100000,
        eos_token_id=100001,
        source="DeepSeek-V2 config.json shapes (MLA, 160 routed + 2 shared experts as one, top-6), BF16",
    )


def _mla_layer(
    h: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v: int
) -> tuple[int, int, int]:
    """(params, KV bytes per token (BF16 latent + rope key), FLOPs per query row per context token) of one MLA
    layer, decoded in its absorbed form as FlashMLA runs it: every head scores (kv_lora + rope)-wide latent keys
    and sums kv_lora-wide values."""
    params = h * q_lora + q_lora * heads * (nope + rope) + h * (kv_lora + rope) + kv_lora * heads * (nope + v)
    params += heads * v * h
    return params, (kv_lora + rope) * 2, 2 * heads * (kv_lora + rope) + 2 * heads * kv_lora


def _deepseek_v3() -> ModelProfile:
    # deepseek-ai/DeepSeek-V3 config.json: hidden 7168, 61 layers of which the first 3 dense (first_k_dense_replace
    # 3, intermediate 18432), vocab 129280, 256 routed experts (moe_intermediate 2048) top-8 with group-limited
    # routing (n_group 8, topk_group 4: a token's experts lie on at most 4 nodes when a group is a node), 1 shared
    # expert; MLA: 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v_head_dim 128;
    # max_position_embeddings 163840; bos 0, eos 1. FP8 weights (quantization_config fp8 e4m3, 128x128 blocks)
    # except the embedding, lm_head and router; DeepEP dispatches FP8 and combines BF16.
    # A profile prices uniform blocks, so each of the 58 MoE blocks carries 61/58 of a layer's attention and KV
    # and 1/58 of the three dense MLPs. The shared expert runs beside attention, data-parallel on every GPU, as
    # DeepSeek (decode: "MLA/Shared Expert DP144", Open-Infra Day 6) and SGLang deploy it: folded into the
    # attention step (3 x 7168 x 2048 more GEMM weights per block), so dispatches carry the 8 routed rows only.
    h, layers, blocks, dense = 7168, 61, 58, 3
    attn, kv, flops = _mla_layer(h, 128, 1536, 512, 128, 64, 128)
    # Before the core (DeepSeek's decode stage ATTN-0, github.com/deepseek-ai/profile-data): q_a, q_b, kv_a and
    # half of kv_b (its key half, absorbed into the query); after it (ATTN-1): kv_b's value half and o_proj.
    attn_in = h * 1536 + 1536 * 128 * 192 + h * 576 + 512 * 128 * 128
    shared = 3 * h * 2048
    router = h * 256
    return ModelProfile(
        name="deepseek-v3",
        vocab_size=129280,
        hidden_size=h,
        num_blocks=blocks,
        num_experts=256,
        top_k=8,
        expert_intermediate=2048,
        attn_params=round((layers * attn + dense * 3 * h * 18432) / blocks) + router + shared,
        kv_bytes_per_token=round(layers * kv / blocks),
        attn_flops_per_context_token=round(layers * flops / blocks),
        num_heads=128,
        num_kv_heads=1,
        head_dim=128,
        max_position_embeddings=163840,
        bos_token_id=0,
        eos_token_id=1,
        source="DeepSeek-V3 config.json (61 layers, 3 dense, MLA absorbed, 256 routed top-8, shared expert on the "
        "attention side), FP8 GEMMs",
        attn_precision="fp8",
        expert_precision="fp8",
        head_bytes_per_param=2,
        dispatch_precision="fp8",
        num_layers=layers,
        attn_in_params=round((layers * attn_in + dense * 3 * h * 18432) / blocks) + shared,
        prefill_attn_flops_per_context_token=round(layers * 2 * 128 * (128 + 64 + 128) / blocks),
        n_group=8,
        topk_group=4,
    )


def _qwen3_moe(
    name: str, hidden: int, layers: int, heads: int, expert_inter: int, source: str
) -> ModelProfile:
    # Qwen/Qwen3-235B-A22B and Qwen/Qwen3-30B-A3B config.json: every layer MoE (decoder_sparse_step 1, no
    # mlp_only_layers), 128 experts top-8 without a shared expert, GQA with 4 KV heads of head_dim 128, vocab
    # 151936, max_position_embeddings 40960, bos 151643, eos 151645. BF16 weights (the released checkpoints).
    attn, kv, flops = gqa_attention(hidden, heads, 4, 128, 128)
    return ModelProfile(
        attn_in_params=hidden * (heads + 2 * 4) * 128,  # q, k, v before the core; o and the router after
        name=name,
        vocab_size=151936,
        hidden_size=hidden,
        num_blocks=layers,
        num_experts=128,
        top_k=8,
        expert_intermediate=expert_inter,
        attn_params=attn,
        kv_bytes_per_token=kv,
        attn_flops_per_context_token=flops,
        num_heads=heads,
        num_kv_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=151645,
        source=source,
    )


MODELS: dict[str, ModelProfile] = {
    # AMoE §5: Mixtral 8x7B with MQA; Figure 9 runs it with top-1 and top-2 routing (pass top_k to override).
    "mixtral-8x7b-mqa": _mixtral_8x7b(
        "mixtral-8x7b-mqa", 8, 2, "Mixtral 8x7B config.json, GQA -> MQA (AMoE §5)"
    ),
    # AMoE §5.2: "increasing the number of experts of Mixtral 8x7B to 16 and using top 1 routing".
    "mixtral-8x7b-16e": _mixtral_8x7b(
        "mixtral-8x7b-16e", 16, 1, "Mixtral 8x7B with 16 experts, top-1 (AMoE §5.2)"
    ),
    "deepseek-v3-like": _deepseek_v3_like(),
    "deepseek-v2": _deepseek_v2(),
    # Frontier profiles (docs/cost-model.md "Profiles"), from their config.json shapes.
    "deepseek-v3": _deepseek_v3(),
    "qwen3-235b-a22b": _qwen3_moe(
        "qwen3-235b-a22b",
        4096,
        94,
        64,
        1536,
        "Qwen3-235B-A22B config.json (94 layers, 128 experts top-8, GQA 64/4), BF16",
    ),
    "qwen3-30b-a3b": _qwen3_moe(
        "qwen3-30b-a3b",
        2048,
        48,
        32,
        768,
        "Qwen3-30B-A3B config.json (48 layers, 128 experts top-8, GQA 32/4), BF16",
    ),
}


def model_profile(name: str, top_k: int | None = None) -> ModelProfile:
    """The named model profile, optionally with a different top-k (the paper runs Mixtral at top-1 and top-2).

    `NAME:N` keeps only N blocks of NAME (every other shape unchanged): per-layer costs and batch dynamics stay the
    model's, an iteration is ~N/blocks as long, so benchmarks reach steady state in proportionally less time.
    """
    name, _, blocks = name.partition(":")
    profile = lookup("model profile", MODELS, name)
    if blocks:
        if not blocks.isdigit() or not 1 <= int(blocks) <= profile.num_blocks:
            raise ConfigError(f"{name}:N needs 1 <= N <= {profile.num_blocks} blocks; got {blocks!r}")
        profile = dataclasses.replace(
            profile, name=f"{name}:{int(blocks)}", num_blocks=int(blocks), full_blocks=profile.num_blocks
        )
    if top_k is None or top_k == profile.top_k:
        return profile
    if not 1 <= top_k <= profile.num_experts:
        raise ConfigError(f"top_k must be in [1, {profile.num_experts}] for {name}; got {top_k}")
    return dataclasses.replace(profile, top_k=top_k)
