"""The MoE side: one SwiGLU (a routed expert, the shared expert, or a dense layer's MLP), an expert layer as the
expert runtimes run it, and the merge of a token's expert outputs into its residual."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from amoe.model.weights import ExpertWeights


class SwiGLU:
    """down(silu(gate x) * up x). `fused`: one matmul for gate and up, as transformers runs its packed experts;
    otherwise two, as it runs a plain MLP (dense layers, shared experts) — the same floats either way."""

    def __init__(self, weights: ExpertWeights, fused: bool) -> None:
        self.gate_up = weights.gate_up  # [2I, H]
        self.gate, self.up = weights.gate_up.chunk(2, dim=0)  # [I, H] views: contiguous row ranges
        self.down = weights.down  # [H, I]
        self.fused = fused

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] → [n, H]."""
        if self.fused:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)  # [n, I] each
        else:
            gate, up = F.linear(x, self.gate), F.linear(x, self.up)
        return F.linear(F.silu(gate) * up, self.down)


class ExpertLayer:
    """Expert `expert` of block `block` (id num_experts: the shared expert): weight * SwiGLU(x)."""

    def __init__(self, block: int, expert: int, weights: ExpertWeights, fused: bool = True) -> None:
        self.block = block
        self.expert = expert
        self.mlp = SwiGLU(weights, fused)

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [n, H], weight [n] (its top-k weight, or the shared expert's gate) → [n, H]."""
        out = self.mlp(x)  # [n, H]
        return (out * weight[:, None]).to(x.dtype)  # HF multiplies by the float32 weight, then casts

    __call__ = forward


class GroupedExperts:
    """The routed experts of one block as one grouped GEMM per projection (torch._grouped_mm), for a process that
    holds them all (the local engine). On the CPU each row gets the very floats ExpertLayer's F.linear gives it
    (checked bitwise), in two calls instead of two per expert: decode batches are small, per-call overhead counts."""

    def __init__(self, layers: list[ExpertLayer]) -> None:
        self.gate_up = torch.stack([layer.mlp.gate_up for layer in layers])  # [E, 2I, H]
        self.down = torch.stack([layer.mlp.down for layer in layers])  # [E, H, I]

    @staticmethod
    def supported(device: torch.device, dtype: torch.dtype) -> bool:
        # Where we have checked it bitwise against F.linear (float32 on the CPU); elsewhere experts run one by one.
        return device.type == "cpu" and dtype == torch.float32 and hasattr(torch, "_grouped_mm")

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [S, H] grouped by expert (expert e's rows end at offsets[e], int32 [E]), weight [S] → [S, H]."""
        gate, up = torch._grouped_mm(x, self.gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(-2, -1), offs=offsets)  # [S, H]
        return (out * weight[:, None]).to(x.dtype)


def merge_expert_outputs(
    residual: torch.Tensor, expert_out: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """residual [N, H] + the K weighted outputs [N, K, H], summed in ascending expert id as transformers' eager
    experts (index_add_) do; the shared expert (the highest id) comes last, as transformers adds it to the routed
    sum. (Its default grouped-GEMM experts sum a token's top-k in router order instead: the same floats for two,
    possibly a last-bit difference for three or more.)"""
    ordered = expert_out
    if expert_out.shape[1] > 2:  # two terms add alike in either order (a + b == b + a in IEEE arithmetic)
        order = expert_ids.argsort(dim=1)  # [N, K]
        ordered = expert_out.gather(1, order[..., None].expand_as(expert_out))  # [N, K, H]
    total = ordered[:, 0]
    for k in range(1, ordered.shape[1]):
        total = total + ordered[:, k]
    return residual + total
