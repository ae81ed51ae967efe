"""Routers: which experts each token goes to, with what weight — Mixtral's softmax top-k (renormalised or not, for
Qwen and OLMoE) and DeepSeek's grouped top-k (V2's softmax greedy / group-limited, V3's sigmoid with a correction
bias). Each mirrors transformers' op sequence, so the picks and their weights are the same floats. A shared expert
is appended as one more pick of every token (id num_experts), weighted by its gate or by 1."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from amoe.model.spec import ModelConfig
from amoe.model.weights import LayerWeights


class Router:
    """The router of one MoE layer: moe_input [N, H] → (ids [N, K'] int64, weights [N, K'] float32), K' = top-k
    plus the shared expert."""

    def __init__(self, cfg: ModelConfig, w: LayerWeights) -> None:
        self.cfg, self.spec = cfg, cfg.router
        self.weight = w.router  # [E, H]
        self.bias = w.router_bias  # [E] (V3)
        self.shared_gate = w.shared_gate  # [1, H] (Qwen2-MoE)
        # Qwen and OLMoE hand the experts weights rounded to the model dtype (a no-op in float32).
        self._weights_dtype = self.weight.dtype if self.spec.weights_in_model_dtype else None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec.method == "softmax":
            ids, weights = self._softmax(x)
        else:
            ids, weights = self._deepseek(x)
        if self.cfg.num_shared_experts:
            ids, weights = self._with_shared(x, ids, weights)
        return ids, weights

    def _softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # [N, E]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self._weights_dtype is not None:
            weights = weights.to(self._weights_dtype).float()
        return ids, weights

    def _deepseek(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec, k = self.spec, self.cfg.top_k
        logits = F.linear(
            x.float(), self.weight.float()
        )  # DeepSeek routes in float32 whatever the model dtype
        if spec.method == "noaux_tc":
            scores = logits.sigmoid()
            choice = _keep_best_groups(
                scores + self.bias, spec.num_groups, spec.topk_groups, "top2", float("-inf")
            )
            ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if spec.norm_topk_prob:
                weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if spec.method == "group_limited_greedy":
                scores = _keep_best_groups(scores, spec.num_groups, spec.topk_groups, "max", 0.0)
            weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
        return ids, weights * spec.scaling_factor

    def _with_shared(self, x, ids, weights) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        if self.shared_gate is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_gate)).float()  # [N, 1], in the model dtype first
        else:
            gate = torch.ones(n, 1, dtype=torch.float32, device=x.device)
        shared = torch.full((n, 1), self.cfg.num_experts, dtype=ids.dtype, device=ids.device)
        return torch.cat([ids, shared], dim=1), torch.cat([weights.float(), gate], dim=1)


def _keep_best_groups(
    scores: torch.Tensor, num_groups: int, topk_groups: int, score: str, fill: float
) -> torch.Tensor:
    """Node-limited routing: experts in `num_groups` equal groups; only the `topk_groups` best groups (by their
    best score, or the sum of their two best) keep their scores, the others get `fill`."""
    if num_groups == 1:
        return scores
    grouped = scores.view(-1, num_groups, scores.shape[-1] // num_groups)  # [N, G, E/G]
    if score == "top2":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]  # [N, topk_groups]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    keep = group_mask.unsqueeze(-1).expand_as(grouped).reshape(scores.shape)
    return scores.masked_fill(~keep.bool(), fill)
