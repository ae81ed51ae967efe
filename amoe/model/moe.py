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


def merge_expert_outputs(
    residual: torch.Tensor, expert_out: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """residual [N, H] + the K weighted outputs [N, K, H], summed in ascending expert id as HF's index_add_ does;
    the shared expert (the highest id) comes last, as transformers adds it to the routed sum."""
    order = expert_ids.argsort(dim=1)  # [N, K]
    ordered = expert_out.gather(1, order[..., None].expand_as(expert_out))  # [N, K, H]
    total = ordered[:, 0]
    for k in range(1, ordered.shape[1]):
        total = total + ordered[:, k]
    return residual + total
