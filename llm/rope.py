"""Rotary position embeddings (RoPE) over packed sequences.

Positions come from the pack (``SeqContext.positions``, restarting at 0 for every sample), so
each sample is rotated as if it ran alone. The tables are computed per call from those
positions (``[T, head_dim]``, fp32): cheap next to attention, and no cache to keep in sync
with ``max_seq_len`` or the device. The arithmetic follows Hugging Face's default, linear and
llama3 rope types bit for bit (same fp32 operations in the same order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mimo.llm.config import HybridArch, RopeScaling


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    theta: float = 10000.0
    scaling: RopeScaling | None = None

    @classmethod
    def from_arch(cls, arch: HybridArch) -> "RopeConfig":
        return cls(arch.head_dim, arch.rope_theta, arch.rope_scaling)


def inv_freq(cfg: RopeConfig, device=None) -> torch.Tensor:
    """``[head_dim / 2]`` fp32 inverse frequencies, scaled as ``cfg.scaling`` says."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).float() / cfg.head_dim
    freq = 1.0 / (cfg.theta ** exponents)
    s = cfg.scaling
    if s is None:
        return freq
    if s.type == "linear":
        return freq / s.factor
    if s.type == "llama3":
        old_len = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / s.factor, freq)  # long wavelengths: scale
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"unknown rope scaling type {s.type!r}")


def rope_tables(positions_T: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, head_dim]`` (fp32) for the given positions."""
    freqs_TF = positions_T.float()[:, None] * freq.to(positions_T.device)[None, :]
    emb_TD = torch.cat((freqs_TF, freqs_TF), dim=-1)
    return emb_TD.cos(), emb_TD.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_THD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """Rotate every head of ``x_THD`` (HF's half-split convention, in x's dtype)."""
    cos = cos_TD.to(x_THD.dtype)[:, None, :]
    sin = sin_TD.to(x_THD.dtype)[:, None, :]
    return x_THD * cos + _rotate_half(x_THD) * sin
