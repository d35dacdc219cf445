"""Tensor-parallel MoonViT, Kimi-K2.5's vision tower, with its projector: equal to transformers'
``Kimi_K25VisionModel`` followed by ``Kimi_K25MultimodalProjection`` (``mm_projector``) on still
images (issue 56; docs/design.md §10).

A ``NativeTower`` (``mimo.encoders.qwen3_vl``): the same pack, blocks, TP and SP as Qwen3-VL's
tower, with MoonViT's own pieces:

* patch embedding: HF's Conv2d (kernel = stride = p, 3 channels) as a GEMM of each row with the
  weight's ``[D, C*p*p]`` view (stored ``[D, C, p, p]``, as HF stores it); one frame per row;
* learned positions: the ``side x side`` table (stored ``[side, side, D]``) resampled to each
  image's ``(h, w)`` bicubically (Keys, a = -0.75) with ``align_corners=False`` (sixteen taps per
  patch, weights in float32 as transformers computes them); the temporal sinusoid transformers adds
  is its zero row for a still image (videos are refused: ``DataError``);
* 2-D rotary over the whole head: K/4 frequencies, each rotating a (column, row) pair of channels
  in the first half (the second half repeats it; ``rotate_half``), transformers'
  ``recomposition_frequencies`` layout;
* blocks: pre-norm LayerNorm (eps 1e-5), q | k | v fused (HF: three projections), MLP with
  ``hidden_act``; attention inside each image;
* a final LayerNorm (eps 1e-5) after the blocks, then the projector: LayerNorm over each patch's
  D features (``projector_eps``), the ``merge x merge`` window's rows fused into one of M =
  merge^2 * D, Linear (M -> M), exact GELU, Linear (M -> out_hidden): the main merger of
  Qwen3-VL's tower (``PatchMerger``, norm before fusing).

Row order. transformers' processor lists an image's patches in raster order and
``temporal_merge`` gathers each ``merge x merge`` window of that raster into one output row
(window by window, row-major; row-major inside a window). This tower takes the patches window by
window instead (``mimo.data.native_images``' merge-block order, as Qwen3-VL's processor lists
them): every per-row step and the attention inside an image are the same under any order of an
image's rows, and the merger then fuses ``merge^2`` consecutive rows into exactly
``temporal_merge``'s row. ``hf_pixels`` turns the rows into the processor's ``pixel_values``.

Parameter names are mimo's own (``blocks.3.attn.qkv.weight``, ``final_norm.weight``,
``merger.fc1.weight``); ``encoders.hf_kimi_k25`` maps them to and from the Hugging Face names.
``lora.targets`` are the ViT's (``q``, ``k``, ``v``, ``proj``, ``fc1``, ``fc2``: transformers'
MoonViT has separate q / k / v projections, one adapter each).

Shape suffixes: those of ``mimo.encoders.qwen3_vl``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.encoders.config import MoonViTArch  # (defined there: check-config reads it without torch)
from mimo.encoders.qwen3_vl import NativeTower, PackPlan, PatchEmbed3d, PatchMerger, position_taps, rotary_angles
from mimo.encoders.vit import LORA_TARGETS, LayerNorm
from mimo.parallel.context import ParallelContext

__all__ = ["MoonViTArch", "MoonViTTower", "LORA_TARGETS", "blocks_to_raster"]


def blocks_to_raster(pixels_PJ: torch.Tensor, grids_N3: torch.Tensor, merge: int) -> torch.Tensor:
    """Rows listed window by window (merge-block order) -> the same rows in each image's raster
    order, image after image (the inverse permutation of the processor's ``patchify`` order)."""
    out, first = [], 0
    for t, h, w in grids_N3.tolist():
        n = t * h * w
        rows = pixels_PJ[first:first + n].reshape(t, h // merge, w // merge, merge, merge, -1)
        out.append(rows.permute(0, 1, 3, 2, 4, 5).reshape(n, -1))
        first += n
    return torch.cat(out) if out else pixels_PJ[:0]


class MoonViTTower(NativeTower):
    """Kimi-K2.5's MoonViT and its projector: ``forward(pixels_PJ, grids_N3) -> rows_RO`` (module doc)."""

    title = "Kimi-K2.5 (MoonViT)"
    videos = False

    def __init__(self, arch: MoonViTArch, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__(arch, ctx, device=device, dtype=dtype)
        dd = {"device": device, "dtype": dtype}
        self.patch_embed = PatchEmbed3d(arch, kernel=(arch.channels, arch.patch, arch.patch), **dd)
        self.pos_embed = nn.Parameter(torch.empty(arch.pos_emb_side, arch.pos_emb_side, arch.hidden, **dd))
        self.final_norm = LayerNorm(arch.hidden, arch.norm_eps, self.ctx, **dd)
        self.merger = PatchMerger(arch, False, self.ctx, eps=arch.projector_eps, **dd)

    @staticmethod
    def hf_pixels(arch: MoonViTArch, pixels_PJ: torch.Tensor, grids_N3: torch.Tensor) -> torch.Tensor:
        """transformers' ``pixel_values`` ``[P, C, p, p]`` of these rows: raster order per image."""
        raster = blocks_to_raster(pixels_PJ, grids_N3, arch.spatial_merge)
        return raster.reshape(-1, arch.channels, arch.patch, arch.patch)

    def embed(self, pixels_PJ: torch.Tensor, plan: PackPlan) -> torch.Tensor:
        """[P, D]: patch embedding plus the bicubically resampled learned positions."""
        x_PD = self.patch_embed(pixels_PJ.to(self.patch_embed.weight.dtype))
        idx_PN, weight_PN = position_taps(plan, self.arch.grid_side, "bicubic", align_corners=False)
        wide = torch.promote_types(x_PD.dtype, torch.float32)
        table = self.pos_embed.flatten(0, 1)
        pos_PD = (F.embedding(idx_PN, table).to(wide) * weight_PN[:, :, None].to(wide)).sum(1)
        return x_PD + pos_PD.to(x_PD.dtype)

    def rotary(self, plan: PackPlan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_angles(plan, self.arch.head_dim, self.arch.rope_theta, dtype, interleaved=True)

    def head(self, x_TD: torch.Tensor, levels: list[torch.Tensor]) -> torch.Tensor:
        return self.merger(self.final_norm(x_TD))
