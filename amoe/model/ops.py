"""Small numeric building blocks that must match Hugging Face transformers bit for bit where possible: RMSNorm,
and RoPE in its three layouts (rotate_half, DeepSeek-V3's de-interleaved pairs, DeepSeek-V2's complex pairs) with
default or YaRN frequencies."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from amoe.model.spec import ModelConfig, Yarn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: variance in float32, then cast back before the weight multiply."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        # One fused op instead of seven, bitwise the same floats in float32 on the CPU (checked over hidden sizes
        # 16..7168); 16-bit inputs keep transformers' cast-then-multiply order below.
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


class RotaryEmbedding:
    """A model's RoPE, computed the way transformers does: inv_freq and the angles in float32, cos/sin scaled by
    the attention factor (YaRN) and cast to the model dtype. `table(positions)` once per batch, `apply` per tensor."""

    def __init__(self, cfg: ModelConfig, device: torch.device | None = None) -> None:
        inv_freq, self.scaling = _inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_yarn)
        self.inv_freq = inv_freq.to(device) if device is not None else inv_freq
        self.style = cfg.rope_style

    def table(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [N] → (cos, sin) [N, D] each, or (complex style) the rotations [N, D/2] complex."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [N, D/2]
        if self.style == "complex":
            return torch.polar(torch.ones_like(freqs), freqs) * self.scaling
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def apply(self, x: torch.Tensor, table) -> torch.Tensor:
        """x [N, heads, D] → rotated x [N, heads, D]."""
        if self.style == "complex":
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [N, heads, D/2]
            return torch.view_as_real(pairs * table[:, None, :]).flatten(2).type_as(x)
        cos, sin = table[0][:, None, :], table[1][:, None, :]
        if self.style == "interleave":  # pairs (x0, x1), (x2, x3)... rotated, written out de-interleaved
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return (x * cos) + (_rotate_half(x) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _inv_freq(dim: int, theta: float, yarn: Yarn | None) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2], attention factor): default RoPE, or YaRN's blend of interpolated and extrapolated
    frequencies (transformers' _compute_yarn_parameters, same float32 steps)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = float(
                yarn_mscale(factor, yarn.mscale) / yarn_mscale(factor, yarn.mscale_all_dim)
            )
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the pretraining one."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
