"""Multimodal rotary embeddings (M-RoPE) as Qwen3-VL's language model uses them.

Every token has three positions (time, height, width; ``mimo.data.positions`` computes them,
the pack carries them as ``PackedBatch.positions_3d``). The rotary table picks, for every
frequency, which of the three axes drives it. Qwen3-VL interleaves them (frequency ``i``
follows height when ``i % 3 == 1``, width when ``i % 3 == 2``, each only for its first
``3 * section`` frequencies, time otherwise), rather than Qwen2-VL's contiguous blocks, so that
every axis sees both high and low frequencies. Text tokens carry the same value on all three
axes, so a text-only sample is rotated exactly like plain RoPE.

The results match Hugging Face's ``Qwen3VLTextRotaryEmbedding`` (transformers 5.x) exactly;
tests/test_mrope.py checks it.
"""


from __future__ import annotations

from typing import Sequence

import torch

from mimo.core.errors import ConfigError
from mimo.llm.rope import RopeConfig, apply_rope, inv_freq

def mrope_axes(head_dim: int, sections: Sequence[int]) -> torch.Tensor:
    """``[head_dim / 2]`` int64: which axis (0 time, 1 height, 2 width) drives each frequency,
    in Qwen3-VL's interleaved layout. ``sections`` = (time, height, width) frequency counts,
    summing to head_dim / 2; as in Hugging Face, only height's and width's counts shape the
    layout (time takes the rest), and a count whose ``3 * count`` runs past the end is cut."""
    if head_dim % 2 or len(sections) != 3 or sum(sections) != head_dim // 2 or min(sections) < 0:
        raise ConfigError(f"mrope sections {list(sections)} must be 3 counts summing to head_dim/2 = {head_dim // 2}")
    i = torch.arange(head_dim // 2)
    axes = torch.zeros_like(i)
    axes[(i % 3 == 1) & (i < 3 * sections[1])] = 1
    axes[(i % 3 == 2) & (i < 3 * sections[2])] = 2
    return axes


def mrope_cos_sin(positions_3T: torch.Tensor, head_dim: int, theta: float, sections: Sequence[int],
                  attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, head_dim]`` (fp32) for 3-D positions: each frequency rotates by the
    position of its axis (``mrope_axes``), halves duplicated as in mimo's 1-D ``rope_tables``,
    so ``apply_mrope`` is the usual half-split rotation. Same fp32 operations as Hugging Face."""
    freq_F = inv_freq(RopeConfig(head_dim, float(theta)), device=positions_3T.device)
    cos_TD, sin_TD = mrope_tables(positions_3T, freq_F, mrope_axes(head_dim, sections).to(positions_3T.device))
    return cos_TD * attention_scaling, sin_TD * attention_scaling


def mrope_tables(positions_3T: torch.Tensor, freq_F: torch.Tensor, axes_F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, head_dim]`` (fp32) of 3-D positions for given frequencies (``inv_freq``,
    scaled as the arch says) and their axes (``mrope_axes``): what attention of an M-RoPE arch
    uses (``mimo.llm.attention``). Where the three axes agree (text), each frequency's angle is
    the 1-D ``rope_tables``' bit for bit."""
    pos_TF = positions_3T[axes_F].T.float()  # frequency f takes its axis' position
    freqs_TF = pos_TF * freq_F.to(positions_3T.device)[None, :]
    emb_TD = torch.cat((freqs_TF, freqs_TF), dim=-1)
    return emb_TD.cos(), emb_TD.sin()


def apply_mrope(q_THd: torch.Tensor, k_THd: torch.Tensor, cos_TD: torch.Tensor,
                sin_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (``[T, heads, head_dim]``) by M-RoPE tables. Once the tables are built the
    rotation is plain RoPE (Hugging Face's rotate_half convention, in q's/k's dtype), so this is
    mimo's ``apply_rope``."""
    return apply_rope(q_THd, cos_TD, sin_TD), apply_rope(k_THd, cos_TD, sin_TD)
