"""The MoE side: Mixtral's router, one expert's SwiGLU, and the top-k merge of expert outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from amoe.model.weights import ExpertWeights


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MixtralTopKRouter: softmax in float32, top-k, renormalise → (topk_ids [N, K] int64, weights [N, K] f32)."""
    logits = F.linear(x, router)  # [N, E]
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights /= weights.sum(dim=-1, keepdim=True)
    return ids, weights


def merge_expert_outputs(
    residual: torch.Tensor, expert_out: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """residual [N, H] + the K weighted outputs [N, K, H], summed in ascending expert id as HF's index_add_ does."""
    order = expert_ids.argsort(dim=1)  # [N, K]
    ordered = expert_out.gather(1, order[..., None].expand_as(expert_out))  # [N, K, H]
    total = ordered[:, 0]
    for k in range(1, ordered.shape[1]):
        total = total + ordered[:, k]
    return residual + total


class ExpertLayer:
    """Expert `expert` of block `block`: weight * w2(silu(w1 x) * w3 x)."""

    def __init__(self, block: int, expert: int, weights: ExpertWeights) -> None:
        self.block = block
        self.expert = expert
        self.gate_up = weights.gate_up  # [2I, H]
        self.down = weights.down  # [H, I]

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [n, H], weight [n] (its top-k weight) → [n, H]."""
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)  # [n, I] each
        out = F.linear(F.silu(gate) * up, self.down)  # [n, H]
        return (out * weight[:, None]).to(x.dtype)  # HF multiplies by the float32 weight, then casts

    __call__ = forward
