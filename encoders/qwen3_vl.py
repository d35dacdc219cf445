"""Tensor-parallel Qwen3-VL vision tower (native resolution, deepstack), equal to transformers'
``Qwen3VLVisionModel`` (issue 47, the tower; docs/design.md §10).

Input: every image of a batch as one pack of patch rows, ``pixels_PJ`` (``[P, C*tp*p*p]``,
exactly as the Hugging Face processor and ``mimo.data.native_images`` lay them out: each image's
patches merge block by merge block, a video's temporal patches one after another), and its grids
``grids_N3`` (``(t, h, w)`` in patches). Output: ``rows_RX``, one row per ``merge x merge`` block
(``R = P / merge^2``), the main merger's features followed by each deepstack level's, in the
order of ``deepstack_layers`` (docs/design.md §10: deepstack travels with its image).

The computation, as transformers computes it:

* patch embedding: the Conv3d with kernel = stride = (tp, p, p) is a GEMM of each row with the
  weight's ``[D, C*tp*p*p]`` view (stored ``[D, C, tp, p, p]``, as HF stores it);
* learned position embedding: the square table (``num_position_embeddings`` = side^2 rows)
  resampled to each image's ``(h, w)`` by bilinear interpolation with ``align_corners=True``
  (four taps per patch, weights computed in float32 as HF computes them), the same for every
  temporal patch, in the rows' merge-block order;
* 2-D rotary embedding: head size K, the first K/4 frequencies rotate by the patch's row, the
  next K/4 by its column (the whole head rotated, ``rotate_half`` style), in float32 or wider;
* attention bidirectional inside each temporal patch of each image (HF's ``cu_seqlens``: t
  segments of h*w rows per entry): no image or frame sees another, nothing is padded to the
  largest image. Consecutive segments of one length run as one batched attention call
  (a video's frames, a run of equal images), each other segment as its own call; exact;
* blocks: pre-norm LayerNorm (eps 1e-6), q|k|v fused, MLP with ``hidden_act``;
* mergers: ``merge^2`` consecutive rows fused into one of width M = merge^2 * D, then
  LayerNorm -> fc1 (M -> M) -> exact GELU -> fc2 (M -> out_hidden). The main merger
  (after the last block) norms each row before fusing (``use_postshuffle_norm=False``), the
  deepstack mergers (after the blocks ``deepstack_layers`` names) norm the fused row.

TP splits heads (fused q|k|v column parallel, output projection row parallel), the MLP hidden
units and each merger's M hidden units (fc1 column, fc2 row parallel), Megatron style, as
``encoders.vit`` does; the output is replicated over TP. With the context's
``sequence_parallel`` the residual stream holds this rank's block of rows, the pack padded to a
multiple of ``tp * merge^2`` rows so that every rank's block holds whole merge blocks (the
mergers then work on local rows and their outputs are gathered once at the end).

Parameter names are mimo's own (``blocks.3.mlp.fc1.weight``, ``merger.fc2.weight``,
``deepstack_mergers.1.norm.weight``); ``encoders.hf_qwen3_vl`` maps them to and from the
Hugging Face names.

The pack's plan, the position taps (bilinear or bicubic), the rotary angles (either channel
layout), the blocks, the merger and the forward over a pack (``NativeTower``) serve every
native-resolution tower: Kimi-K2.5's MoonViT (``mimo.encoders.moonvit``) is a ``NativeTower`` too.

Shape suffixes (this family's legend): P patch rows, J pixels of a patch (C*tp*p*p), N images
(or videos), T rows of the residual stream (P, padded under SP), D hidden, H this rank's heads,
K head size, I the attention output projection's input (this rank's H*K), R merged rows
(P / merge^2), M a merge block's width (merge^2 * D), O out_hidden, X an output row (O per level).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.core.errors import ConfigError, DataError, LayoutError, MimoError
from mimo.encoders.config import HF_ACTS, Qwen3VisionArch  # (defined there: check-config reads it without torch)
from mimo.encoders.tp_state import full_state, init_tp_invariant, load_full_
from mimo.encoders.vit import LayerNorm, Mlp
from mimo.parallel import gemm
from mimo.parallel.collectives import gather_along, scatter_along
from mimo.parallel.context import ParallelContext
from mimo.parallel.layers import ColumnParallelLinear, FusedColumnParallelLinear, RowParallelLinear
from mimo.parallel.lora import LoraTarget
from mimo.parallel.params import ParamInfo
from mimo.parallel.recompute import checkpoint, maybe, set_block_recompute

__all__ = ["Qwen3VisionArch", "NativeTower", "Qwen3VisionTower", "PackPlan", "plan_pack"]

def _context(ctx: ParallelContext | None) -> ParallelContext:
    return ParallelContext.for_tp() if ctx is None else ctx


# ---------------------------------------------------------------------------- the pack's plan


@dataclass
class PackPlan:
    """What the rows of one pack need besides their pixels: segment runs for attention, the
    rotary angles and the position-table taps (all from the grids, computed once per forward)."""

    real: int  # P: patch rows
    rows: int  # T: rows of the residual stream (P padded to whole merge blocks per rank under SP)
    runs: list[tuple[int, int, int]]  # (first row, segments, rows per segment): consecutive equal segments
    rowcol_P2: torch.Tensor  # each row's (row, column) in its image's patch grid
    hw_P2: torch.Tensor  # each row's image (h, w)


def plan_pack(grids_N3: torch.Tensor, merge: int, rows_multiple: int = 1, *, device=None) -> PackPlan:
    """The plan of a pack of images / videos with these ``(t, h, w)`` grids (``DataError`` for
    grids that cannot be cut into merge blocks). Rows follow the processor's order: image by
    image, temporal patch by temporal patch, merge block by merge block (row-major), row-major
    inside a block."""
    if not isinstance(grids_N3, torch.Tensor) or grids_N3.dim() != 2 or grids_N3.shape[1] != 3:
        shape = tuple(grids_N3.shape) if isinstance(grids_N3, torch.Tensor) else type(grids_N3).__name__
        raise DataError(f"grids must be a [N, 3] integer tensor of (t, h, w) patches, got {shape}")
    if grids_N3.dtype.is_floating_point or grids_N3.dtype.is_complex or grids_N3.dtype == torch.bool:
        raise DataError(f"grids must be integers (t, h, w in patches), got {grids_N3.dtype}")
    grids = [tuple(int(v) for v in g) for g in grids_N3.tolist()]
    for n, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1:
            raise DataError(f"image {n}: grid (t, h, w) = {(t, h, w)} has an empty side")
        if h % merge or w % merge:
            raise DataError(f"image {n}: grid (t, h, w) = {(t, h, w)}: h and w must be multiples of the "
                            f"spatial merge size {merge} (the processor resizes to whole merge blocks)")
    runs: list[tuple[int, int, int]] = []
    start = 0
    for t, h, w in grids:
        L = h * w
        for _ in range(t):
            if runs and runs[-1][2] == L:
                s, n, _ = runs[-1]
                runs[-1] = (s, n + 1, L)
            else:
                runs.append((start, 1, L))
            start += L
    real = start
    rows = -(-max(real, 1) // rows_multiple) * rows_multiple if rows_multiple > 1 else real
    # each row's place in its frame, decoded from merge-block order (as transformers decodes it)
    g_N3 = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    counts_N = g_N3.prod(1)
    h_P = torch.repeat_interleave(g_N3[:, 1], counts_N)
    w_P = torch.repeat_interleave(g_N3[:, 2], counts_N)
    start_P = torch.repeat_interleave(counts_N.cumsum(0) - counts_N, counts_N)
    within_P = (torch.arange(real) - start_P) % (h_P * w_P)
    blocks_w_P = w_P // merge
    in_col_P, in_row_P = within_P % merge, (within_P // merge) % merge
    block_col_P = (within_P // (merge * merge)) % blocks_w_P
    block_row_P = within_P // (merge * merge * blocks_w_P)
    rowcol_P2 = torch.stack([block_row_P * merge + in_row_P, block_col_P * merge + in_col_P], 1)
    return PackPlan(real, rows, runs, rowcol_P2.to(device), torch.stack([h_P, w_P], 1).to(device))


def _axis_taps(index_P: torch.Tensor, size_P: torch.Tensor, side: int, mode: str = "bilinear",
               align_corners: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The source positions of each target position on an axis of ``size`` points over ``side``
    table points, and their weights: ``bilinear`` (two taps) or ``bicubic`` (four, Keys' kernel
    with a = -0.75), border-clamped, as ``F.interpolate`` resamples with ``align_corners``
    (float32, the same operations as transformers' ``_interpolation_axis_taps_weights``, so the
    same bits)."""
    index_P = index_P.to(torch.float32)
    if align_corners:
        src_P = index_P * (side - 1) / torch.clamp(size_P - 1, min=1)
    else:
        src_P = (index_P + 0.5) * side / size_P - 0.5  # half-pixel centres
    floor_P = torch.floor(src_P)
    if mode == "bilinear":
        offsets = torch.arange(0, 2, device=index_P.device)
    elif mode == "bicubic":
        offsets = torch.arange(-1, 3, device=index_P.device)
    else:
        raise ValueError(f"interpolation mode {mode!r}: bilinear or bicubic")
    taps_PN = (floor_P.long()[:, None] + offsets).clamp(0, side - 1)
    distance_PN = (src_P[:, None] - floor_P[:, None] - offsets).abs()
    if mode == "bilinear":
        return taps_PN, (1 - distance_PN).clamp(min=0)
    a = -0.75
    near = ((a + 2) * distance_PN - (a + 3)) * distance_PN * distance_PN + 1
    far = ((a * distance_PN - 5 * a) * distance_PN + 8 * a) * distance_PN - 4 * a
    return taps_PN, torch.where(distance_PN <= 1, near, far)


def position_taps(plan: PackPlan, side: int, mode: str = "bilinear", align_corners: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(table rows ``[P, n]``, float32 weights ``[P, n]``): each row's position embedding is the
    weighted sum of n rows of the ``side x side`` table (row-major): bilinear (n = 4) or bicubic
    (n = 16), with ``align_corners`` (Qwen3-VL: bilinear, True; MoonViT: bicubic, False)."""
    h_taps, h_w = _axis_taps(plan.rowcol_P2[:, 0], plan.hw_P2[:, 0], side, mode, align_corners)
    w_taps, w_w = _axis_taps(plan.rowcol_P2[:, 1], plan.hw_P2[:, 1], side, mode, align_corners)
    n = h_taps.shape[1] ** 2
    idx_PN = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, n)
    weight_PN = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, n)
    return idx_PN, weight_PN


def rotary_angles(plan: PackPlan, head_dim: int, theta: float, dtype: torch.dtype, interleaved: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) ``[P, K]`` of the axial 2-D rotary embedding, in ``dtype`` (float32 or wider):
    K/4 frequencies by row and the same K/4 by column, the half repeated for ``rotate_half``.
    The half is laid out [row freqs | column freqs] (Qwen3-VL), or ``interleaved`` as
    (column, row) pairs per frequency (MoonViT's ``recomposition_frequencies``)."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=dtype, device=plan.rowcol_P2.device) / half))
    freqs_P2F = plan.rowcol_P2[..., None].to(dtype) * inv_freq
    out = []
    for f in (freqs_P2F.cos(), freqs_P2F.sin()):
        if interleaved:
            hw_PF = f.transpose(1, 2).flip(-1).flatten(1)  # [P, F, (col, row)]
        else:
            hw_PF = torch.cat([f[:, 0], f[:, 1]], dim=-1)
        out.append(torch.cat([hw_PF, hw_PF], dim=-1))
    return out[0], out[1]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# ---------------------------------------------------------------------------- modules


class PatchEmbed3d(nn.Module):
    """Patch rows -> D: HF's Conv3d (kernel = stride = (tp, p, p)) as one GEMM with the
    weight's ``[D, C*tp*p*p]`` view (stored ``[D, C, tp, p, p]``, replicated over TP);
    ``kernel``: another stored kernel shape (MoonViT's Conv2d: ``(C, p, p)``)."""

    def __init__(self, arch: Qwen3VisionArch, *, kernel: tuple[int, ...] | None = None, device=None, dtype=None):
        super().__init__()
        D, C, tp, p = arch.hidden, arch.channels, arch.temporal_patch, arch.patch
        kernel = (C, tp, p, p) if kernel is None else tuple(kernel)
        self.weight = nn.Parameter(torch.empty(D, *kernel, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(D, device=device, dtype=dtype))
        self.recipe = gemm.default_recipe()

    def forward(self, pixels_PJ: torch.Tensor) -> torch.Tensor:
        return gemm.linear(pixels_PJ, self.weight.flatten(1), self.bias, self.recipe)


class Attention(nn.Module):
    """Fused q|k|v (column parallel by heads), 2-D rotary, attention inside each segment of the
    pack, row-parallel output projection."""

    def __init__(self, arch: Qwen3VisionArch, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__()
        ctx = _context(ctx)
        D = arch.hidden
        self.heads_local, self.head_dim = arch.heads // ctx.tp_size, arch.head_dim
        self.qkv = FusedColumnParallelLinear(D, {"q": D, "k": D, "v": D}, True, ctx, device=device, dtype=dtype)
        self.proj = RowParallelLinear(D, D, True, ctx, input_is_parallel=True, device=device, dtype=dtype)

    selective = False  # recompute the attention core (RoPE included) in backward (mimo.parallel.recompute)

    def forward(self, x_TD: torch.Tensor, plan: PackPlan, cos_PK: torch.Tensor, sin_PK: torch.Tensor) -> torch.Tensor:
        q_TI, k_TI, v_TI = self.qkv(x_TD)  # all T rows (gathered under SP), this rank's heads
        core = lambda q, k, v, c, s: self._core(q, k, v, c, s, plan)  # noqa: E731
        return self.proj(maybe(self.selective, core, q_TI, k_TI, v_TI, cos_PK, sin_PK))

    def _core(self, q_TI, k_TI, v_TI, cos_PK, sin_PK, plan: PackPlan) -> torch.Tensor:
        H, K, P, T = self.heads_local, self.head_dim, plan.real, q_TI.shape[0]
        q_PHK, k_PHK, v_PHK = (t_TI[:P].view(P, H, K) for t_TI in (q_TI, k_TI, v_TI))
        # rotary in float32 at least (transformers rotates bf16 q / k in float32 too)
        wide = torch.promote_types(q_PHK.dtype, torch.float32)
        cos_P1K, sin_P1K = cos_PK.to(wide)[:, None], sin_PK.to(wide)[:, None]
        q_PHK, k_PHK = ((t.to(wide) * cos_P1K + _rotate_half(t.to(wide)) * sin_P1K).to(t.dtype) for t in (q_PHK, k_PHK))
        outs = []
        for first, n, L in plan.runs:  # n consecutive segments of L rows: one batched call
            q_NHLK, k_NHLK, v_NHLK = (t[first:first + n * L].view(n, L, H, K).transpose(1, 2)
                                      for t in (q_PHK, k_PHK, v_PHK))
            o_NHLK = F.scaled_dot_product_attention(q_NHLK, k_NHLK, v_NHLK)
            outs.append(o_NHLK.transpose(1, 2).reshape(n * L, H * K))
        o_PI = torch.cat(outs) if outs else v_TI[:0]  # an empty pack keeps the graph (and its collectives)
        return F.pad(o_PI, (0, 0, 0, T - P)) if T > P else o_PI


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, arch: Qwen3VisionArch, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.norm1 = LayerNorm(arch.hidden, arch.norm_eps, ctx, **dd)
        self.attn = Attention(arch, ctx, **dd)
        self.norm2 = LayerNorm(arch.hidden, arch.norm_eps, ctx, **dd)
        self.mlp = Mlp(arch.hidden, arch.mlp, HF_ACTS[arch.act], ctx, **dd)

    def forward(self, x_TD, plan: PackPlan, cos_PK, sin_PK) -> torch.Tensor:
        x_TD = x_TD + self.attn(self.norm1(x_TD), plan, cos_PK, sin_PK)
        return x_TD + self.mlp(self.norm2(x_TD))


class PatchMerger(nn.Module):
    """merge^2 consecutive rows -> one row of ``out_hidden``: LayerNorm, fc1 (M -> M, column
    parallel), exact GELU, fc2 (M -> O, row parallel). ``postshuffle``: the norm runs over the
    fused M-wide row (the deepstack mergers), else over each D-wide row before fusing (the main)."""

    def __init__(self, arch: Qwen3VisionArch, postshuffle: bool, ctx: ParallelContext | None = None, *,
                 eps: float | None = None, device=None, dtype=None):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        M = self.width = arch.merge_width
        self.postshuffle = postshuffle
        self.norm = LayerNorm(M if postshuffle else arch.hidden, arch.norm_eps if eps is None else eps, ctx, **dd)
        self.fc1 = ColumnParallelLinear(M, M, True, ctx, **dd)
        self.fc2 = RowParallelLinear(M, arch.out_hidden, True, ctx, input_is_parallel=True, **dd)

    selective = False  # recompute the activation in backward

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            x_RM = self.norm(x_TD.reshape(-1, self.width))
        else:
            x_RM = self.norm(x_TD).reshape(-1, self.width)
        return self.fc2(maybe(self.selective, F.gelu, self.fc1(x_RM)))

    def extra_repr(self) -> str:
        return f"postshuffle={self.postshuffle}"


class NativeTower(nn.Module):
    """What the native-resolution towers share (Qwen3-VL's here, MoonViT's in ``mimo.encoders.moonvit``):
    ``forward(pixels_PJ, grids_N3) -> rows_RX`` over one pack (``plan_pack``), the blocks (``Block``)
    under TP / SP, the merger's fused merge blocks, deepstack levels where the arch has them.
    A subclass builds ``patch_embed``, ``pos_embed``, ``merger`` (and its own modules) after
    ``super().__init__`` and gives ``embed`` (patch rows -> the residual stream) and
    ``rotary`` (the rotary angles of each row); ``head`` (the last block's rows -> output rows)
    defaults to the merger with the deepstack levels after it.

    ``ctx``: the tower's parallel context (its TP group and whether SP is on); None: one process.
    """

    title = "native-resolution"  # names the tower in messages
    videos = True  # takes grids of several temporal patches (videos)

    def __init__(self, arch, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__()
        problems = arch.validate("arch")
        if problems:
            raise ConfigError(problems)
        self.ctx = ctx = _context(ctx)
        tp = ctx.tp_size
        sizes = {"heads": arch.heads, "mlp": arch.mlp, "merge width (spatial_merge^2 * hidden)": arch.merge_width}
        bad = [f"{name} ({size})" for name, size in sizes.items() if size % tp]
        if bad:
            raise LayoutError(f"tp={tp} does not divide the {self.title} tower's {', '.join(bad)}")
        self.arch = arch
        self.group, self.tp_size, self.sequence_parallel = ctx.tp, tp, ctx.sequence_parallel
        self.deepstack_layers = list(arch.deepstack_layers)
        dd = {"device": device, "dtype": dtype}
        self.blocks = nn.ModuleList(Block(arch, ctx, **dd) for _ in range(arch.depth))
        self.deepstack_mergers = nn.ModuleList(PatchMerger(arch, True, ctx, **dd) for _ in arch.deepstack_layers)

    def set_recompute(self, mode: str, layers: int | None = None) -> None:
        """Activation recompute for the first ``layers`` blocks (all when None), as
        ``VisionTransformer.set_recompute``."""
        set_block_recompute(self.blocks, mode, layers)

    # ---- weights ----
    def init_weights(self, seed: int) -> None:
        """TP-invariant: every parameter's local shard of the full tensor ``param_seed(seed, name)`` draws."""
        init_tp_invariant(self, seed, _qwen3_init_fn)

    def load_full_(self, state, what: str | None = None) -> None:
        load_full_(self, state, what or f"{self.title} tower weights")

    def load_weights_(self, weights) -> None:
        """Load this rank's slices from ``ImportedWeights`` (its Hugging Face module's ``import_hf_state``)."""
        if weights.arch != self.arch:
            raise MimoError(f"{weights.where}: imported for {weights.arch}, but the tower is {self.arch}")
        load_full_(self, weights.tower, weights.where)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective over the TP group: full tensors by mimo name."""
        return full_state(self)

    @staticmethod
    def hf_pixels(arch, pixels_PJ: torch.Tensor, grids_N3: torch.Tensor) -> torch.Tensor:
        """The Hugging Face model's ``pixel_values`` of these rows (Qwen3-VL's: the rows as they are)."""
        return pixels_PJ

    # ---- forward ----
    def plan(self, pixels_PJ: torch.Tensor, grids_N3: torch.Tensor) -> PackPlan:
        """The pack's plan, checking the pixels against the grids (``DataError``)."""
        a = self.arch
        m = a.spatial_merge
        plan = plan_pack(grids_N3, m, self.tp_size * m * m if self.sequence_parallel else 1, device=pixels_PJ.device)
        if not self.videos:
            frames = [(n, g) for n, g in enumerate(grids_N3.tolist()) if g[0] != 1]
            if frames:
                n, g = frames[0]
                raise DataError(f"image {n}: grid (t, h, w) = {tuple(g)}: the {self.title} tower takes still images only "
                                f"(t = 1); videos are not supported")
        if pixels_PJ.dim() != 2 or pixels_PJ.shape[1] != a.row_numel:
            raise DataError(f"the tower takes pixel rows [P, {a.row_numel}] (channels {a.channels} x temporal patch "
                            f"{a.temporal_patch} x {a.patch} x {a.patch}), got {tuple(pixels_PJ.shape)}")
        if pixels_PJ.shape[0] != plan.real:
            raise DataError(f"{pixels_PJ.shape[0]} pixel rows, but the grids {grids_N3.tolist()} hold {plan.real} "
                            f"patches (sum of t * h * w)")
        return plan

    def embed(self, pixels_PJ: torch.Tensor, plan: PackPlan) -> torch.Tensor:
        raise NotImplementedError

    def rotary(self, plan: PackPlan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def head(self, x_TD: torch.Tensor, levels: list[torch.Tensor]) -> torch.Tensor:
        """This rank's output rows of the last block's rows: the merger's, then each deepstack level's."""
        return torch.cat([self.merger(x_TD), *levels], dim=-1)

    def forward(self, pixels_PJ: torch.Tensor, grids_N3: torch.Tensor) -> torch.Tensor:
        plan = self.plan(pixels_PJ, grids_N3)
        P, T, m2 = plan.real, plan.rows, self.arch.spatial_merge**2
        x_TD = self.embed(pixels_PJ, plan)
        cos_PK, sin_PK = self.rotary(plan, torch.promote_types(x_TD.dtype, torch.float32))
        if self.sequence_parallel:
            # each rank keeps a contiguous block of whole merge blocks (T: a multiple of tp * merge^2,
            # at least one block per rank, so an empty pack still runs every collective)
            x_TD = scatter_along(F.pad(x_TD, (0, 0, 0, T - P)), 0, self.group)
        levels = []
        for i, block in enumerate(self.blocks):
            if getattr(block, "recompute_full", False):
                x_TD = checkpoint(block, x_TD, plan, cos_PK, sin_PK)
            else:
                x_TD = block(x_TD, plan, cos_PK, sin_PK)
            if i in self.deepstack_layers:
                levels.append(self.deepstack_mergers[self.deepstack_layers.index(i)](x_TD))
        rows_RX = self.head(x_TD, levels)
        if self.sequence_parallel:
            rows_RX = gather_along(rows_RX, 0, self.group)[: P // m2]
        return rows_RX

    def extra_repr(self) -> str:
        return (f"depth={self.arch.depth}, deepstack_layers={self.deepstack_layers}, out_width={self.arch.out_width}, "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")


class Qwen3VisionTower(NativeTower):
    """The Qwen3-VL vision tower: ``forward(pixels_PJ, grids_N3) -> rows_RX`` (module doc)."""

    title = "Qwen3-VL"

    def __init__(self, arch: Qwen3VisionArch, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__(arch, ctx, device=device, dtype=dtype)
        dd = {"device": device, "dtype": dtype}
        self.patch_embed = PatchEmbed3d(arch, **dd)
        self.pos_embed = nn.Parameter(torch.empty(arch.num_position_embeddings, arch.hidden, **dd))
        self.merger = PatchMerger(arch, False, self.ctx, **dd)

    def embed(self, pixels_PJ: torch.Tensor, plan: PackPlan) -> torch.Tensor:
        """[P, D]: patch embedding plus the interpolated learned positions."""
        x_PD = self.patch_embed(pixels_PJ.to(self.patch_embed.weight.dtype))
        idx_P4, weight_P4 = position_taps(plan, self.arch.grid_side)
        wide = torch.promote_types(x_PD.dtype, torch.float32)
        pos_PD = (F.embedding(idx_P4, self.pos_embed).to(wide) * weight_P4[:, :, None].to(wide)).sum(1)
        return x_PD + pos_PD.to(x_PD.dtype)

    def rotary(self, plan: PackPlan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_angles(plan, self.arch.head_dim, self.arch.rope_theta, dtype)


def _qwen3_init_fn(name: str, info: ParamInfo):
    """transformers' scheme for the tower: normal(0.02) weights and position table (its
    ``initializer_range``), zero biases, unit LayerNorms."""
    if isinstance(info.module, LayerNorm):
        value = 1.0 if name.endswith("weight") else 0.0
        return lambda t, g: t.fill_(value)
    if name.endswith("bias"):
        return lambda t, g: t.zero_()
    return lambda t, g: t.normal_(0.0, 0.02, generator=g)


# ``lora.targets`` of a ``kind: qwen3_vl`` tower (paths under the tower), as its Hugging Face
# modules are laid out: one fused qkv projection (one adapter over q | k | v)
LORA_TARGETS = {
    "qkv": LoraTarget(r"blocks\.\d+\.attn\.qkv", (("q", "k", "v"),)),
    "proj": LoraTarget(r"blocks\.\d+\.attn\.proj"),
    "fc1": LoraTarget(r"blocks\.\d+\.mlp\.fc1"),
    "fc2": LoraTarget(r"blocks\.\d+\.mlp\.fc2"),
}
