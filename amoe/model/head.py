"""The head: final top-k merge, final RMSNorm and lm_head on the last row of each chunk (or on any rows: a
prompt's, for its log-probabilities)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from amoe.model.moe import merge_expert_outputs
from amoe.model.ops import rms_norm
from amoe.model.spec import ModelConfig


class Head:
    """Block num_blocks on the attention rank: turns the last block's outputs into next-token logits."""

    def __init__(self, cfg: ModelConfig, final_norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.cfg = cfg
        self.final_norm = final_norm  # [H]
        self.lm_head = lm_head  # [V, H]

    def forward(
        self,
        residual: torch.Tensor,
        expert_out: torch.Tensor,
        expert_ids: torch.Tensor,
        cu_rows: torch.Tensor,
    ) -> torch.Tensor:
        """residual [N, H], expert_out [N, K, H], expert_ids [N, K], cu_rows [R + 1] → logits [R, V] float32."""
        last = cu_rows[1:] - 1  # only the last row of a chunk predicts a token
        return self.logits_at(residual, expert_out, expert_ids, last)

    def logits_at(
        self, residual: torch.Tensor, expert_out: torch.Tensor, expert_ids: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """Next-token logits [len(rows), V] float32 of the given rows (a prompt's rows score its next tokens)."""
        hidden = merge_expert_outputs(residual[rows], expert_out[rows], expert_ids[rows])  # [n, H]
        hidden = rms_norm(hidden, self.final_norm, self.cfg.rms_norm_eps)
        return F.linear(hidden, self.lm_head).float()

    __call__ = forward
