"""Small numeric building blocks that must match Hugging Face Mixtral bit for bit where possible."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """MixtralRMSNorm: variance in float32, then cast back before the weight multiply."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


class RotaryEmbedding:
    """Default RoPE, computed the way HF does: inv_freq and the angles in float32, cos/sin cast to the model dtype."""

    def __init__(self, head_dim: int, theta: float, device: torch.device | None = None) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.inv_freq = inv_freq.to(device) if device is not None else inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] → cos, sin [N, head_dim]."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D], cos/sin [N, D] → rotated x [N, heads, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (_rotate_half(x) * sin)
