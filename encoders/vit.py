"""Tensor-parallel Vision Transformer (ViT / CLIP / SigLIP towers), timm-like.

TP splits attention heads (one fused q|k|v column-parallel GEMM, row-parallel output
projection) and the MLP's hidden units (column then row parallel), Megatron style. With the
context's ``sequence_parallel`` the residual stream between those regions holds this rank's
block of rows instead of a replicated copy (all-gather in, reduce-scatter out).

Images never attend to each other: the rows of a batch are viewed as ``[N, L, ...]`` for
attention, bidirectional within each image. The tower's output is ``[N * rows, D]``
(images concatenated), replicated over the TP group.

Every module takes the tower's ``ParallelContext``; every matrix product (the patch
embedding included) goes through ``mimo.parallel.gemm.linear``. Parameter names and full
shapes are mimo's own, layout-independent (``blocks.3.attn.qkv.weight`` is ``[3D, D]``:
q | k | v, each part split over TP on its own); ``encoders.timm_import`` /
``encoders.hf_import`` map them to and from the timm / Hugging Face layouts.

Shape suffixes: N images, L tokens per image (patches + [CLS]), P patches, T rows (N*L,
padded to a multiple of tp under sequence parallel), D hidden, H heads (this rank's), K head
dim, F MLP hidden, C channels, J pixels of a patch (C*p*p).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.core.errors import LayoutError, MimoError
from mimo.encoders.config import VitArch
from mimo.encoders.tp_state import full_state, init_tp_invariant, load_full_
from mimo.parallel import gemm
from mimo.parallel.collectives import gather_along, scatter_along
from mimo.parallel.context import ParallelContext
from mimo.parallel.layers import ColumnParallelLinear, FusedColumnParallelLinear, RowParallelLinear
from mimo.parallel.lora import LoraTarget
from mimo.parallel.params import ParamInfo
from mimo.parallel.placement import ParamPlacement, replicated
from mimo.parallel.recompute import checkpoint, maybe, set_block_recompute

__all__ = ["VisionTransformer", "resolve_feature_layer", "patch_bias"]


def resolve_feature_layer(layers: int, feature_layer: int | str) -> tuple[int, bool]:
    """(blocks to run, apply the final norm) for a feature layer.

    An int L is Hugging Face's ``hidden_states[L]``: 0 is the embeddings (after CLIP's
    pre-norm), k the output of block k, negative counts from the end (-1: the last block,
    -2: the one before, as LLaVA uses); ``post_norm`` is every block then the final norm.
    """
    if feature_layer == "post_norm":
        return layers, True
    if isinstance(feature_layer, bool) or not isinstance(feature_layer, int):
        raise MimoError(f"feature_layer must be an int or 'post_norm', got {feature_layer!r}")
    n = feature_layer if feature_layer >= 0 else layers + 1 + feature_layer
    if not 0 <= n <= layers:
        raise MimoError(f"feature_layer {feature_layer} is outside -{layers}..{layers} for a {layers}-layer tower")
    return n, False


def patch_bias(arch: VitArch) -> bool:
    """Whether the patch embedding has a bias: every supported family (timm ViT/CLIP/SigLIP,
    HF CLIP/SigLIP) drops it exactly when the embeddings are pre-normed (CLIP)."""
    return not arch.pre_norm


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": quick_gelu,  # OpenAI CLIP
}


def _context(ctx: ParallelContext | None) -> ParallelContext:
    return ParallelContext.for_tp() if ctx is None else ctx


class LayerNorm(nn.Module):
    """LayerNorm whose replicated parameters stay correct under sequence parallel.

    With SP each rank normalises only its rows, so its weight/bias gradients are partial sums
    over TP: the placements say so (``partial=("tp",)``), and they stay partial after backward
    (training sums them once per step, ``mimo.training.optim.GradSync``; elsewhere
    ``mimo.parallel.params.reduce_partial_grads``).
    """

    def __init__(self, dim: int, eps: float, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__()
        self.ctx = ctx = _context(ctx)
        self.dim, self.eps = dim, eps
        self.sequence_parallel = ctx.sequence_parallel
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def placements(self) -> dict[str, ParamPlacement]:
        partial = ("tp",) if self.sequence_parallel else ()
        return {"weight": replicated((self.dim,), partial), "bias": replicated((self.dim,), partial)}

    selective = False  # recompute in backward (mimo.parallel.recompute)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return maybe(self.selective, lambda x: F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps), x_TD)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> D. A strided conv with kernel = stride = patch is a GEMM over
    the unfolded patches: the weight is stored ``[D, C, p, p]`` as timm and HF store it, and
    multiplied as its ``[D, C*p*p]`` view (replicated over TP)."""

    def __init__(self, channels: int, dim: int, patch: int, bias: bool, *, device=None, dtype=None):
        super().__init__()
        self.patch, self.dim = patch, dim
        self.weight = nn.Parameter(torch.empty(dim, channels, patch, patch, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(dim, device=device, dtype=dtype)) if bias else None
        self.recipe = gemm.default_recipe()

    def forward(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        N, C, H, W = pixels_NCHW.shape
        p = self.patch
        gh, gw = H // p, W // p
        # [N, C, gh, p, gw, p] -> [N, gh, gw, C, p, p]: one row per patch (row-major, as the
        # conv's output flattens), its pixels in the weight's (C, p, p) order
        x_NPJ = pixels_NCHW.reshape(N, C, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(N, gh * gw, C * p * p)
        return gemm.linear(x_NPJ, self.weight.flatten(1), self.bias, self.recipe)  # [N, P, D]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__()
        ctx = _context(ctx)
        self.heads_local, self.head_dim = heads // ctx.tp_size, dim // heads
        # q | k | v stored fused, each split over TP by heads: one GEMM, no weight concatenation
        self.qkv = FusedColumnParallelLinear(dim, {"q": dim, "k": dim, "v": dim}, True, ctx, device=device, dtype=dtype)
        self.proj = RowParallelLinear(dim, dim, True, ctx, input_is_parallel=True, device=device, dtype=dtype)

    selective = False  # recompute the attention core in backward (mimo.parallel.recompute)

    def forward(self, x_TD: torch.Tensor, n_images: int, tokens: int) -> torch.Tensor:
        q_TX, k_TX, v_TX = self.qkv(x_TD)  # all T rows (gathered under SP), this rank's heads
        return self.proj(maybe(self.selective, lambda q, k, v: self._core(q, k, v, n_images, tokens), q_TX, k_TX, v_TX))

    def _core(self, q_TX, k_TX, v_TX, n_images: int, tokens: int) -> torch.Tensor:
        H, K = self.heads_local, self.head_dim
        T, real = q_TX.shape[0], n_images * tokens
        # one attention per image: [N, L] rows; padding rows (SP) take no part
        q_NHLK, k_NHLK, v_NHLK = (t_TX[:real].view(n_images, tokens, H, K).transpose(1, 2) for t_TX in (q_TX, k_TX, v_TX))
        o_NHLK = F.scaled_dot_product_attention(q_NHLK, k_NHLK, v_NHLK)
        o_TX = o_NHLK.transpose(1, 2).reshape(real, H * K)
        if T > real:
            o_TX = F.pad(o_TX, (0, 0, 0, T - real))
        return o_TX


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__()
        self.act = _ACTS[act]
        self.fc1 = ColumnParallelLinear(dim, hidden, True, ctx, device=device, dtype=dtype)
        self.fc2 = RowParallelLinear(hidden, dim, True, ctx, input_is_parallel=True, device=device, dtype=dtype)

    selective = False  # recompute the activation in backward (mimo.parallel.recompute)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.fc2(maybe(self.selective, self.act, self.fc1(x_TD)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, arch: VitArch, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__()
        ctx = _context(ctx)
        dd = {"device": device, "dtype": dtype}
        self.norm1 = LayerNorm(arch.hidden, arch.norm_eps, ctx, **dd)
        self.attn = Attention(arch.hidden, arch.heads, ctx, **dd)
        self.norm2 = LayerNorm(arch.hidden, arch.norm_eps, ctx, **dd)
        self.mlp = Mlp(arch.hidden, arch.mlp, arch.act, ctx, **dd)

    def forward(self, x_TD: torch.Tensor, n_images: int, tokens: int) -> torch.Tensor:
        x_TD = x_TD + self.attn(self.norm1(x_TD), n_images, tokens)
        return x_TD + self.mlp(self.norm2(x_TD))


class VisionTransformer(nn.Module):
    """The vision tower: pixels ``[N, C, S, S]`` -> feature rows ``[N * rows_per_image, D]``.

    Only the blocks ``feature_layer`` needs are built (and the final norm only for
    ``post_norm``); weights of the rest stay with the imported checkpoint
    (``ImportedWeights``), so export still writes them. ``ctx``: the tower's parallel
    context (its TP group and whether SP is on); None: one process.
    """

    def __init__(
        self,
        arch: VitArch,
        feature_layer: int | str = -2,
        *,
        drop_class_token: bool = True,
        ctx: ParallelContext | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.ctx = ctx = _context(ctx)
        tp = ctx.tp_size
        for name in ("heads", "mlp"):
            if getattr(arch, name) % tp:
                raise LayoutError(f"tp={tp} does not divide the tower's {name} ({getattr(arch, name)})")
        if arch.image_size % arch.patch:
            raise LayoutError(f"image_size {arch.image_size} is not divisible by patch {arch.patch}")
        self.arch, self.feature_layer = arch, feature_layer
        self.group, self.tp_size, self.sequence_parallel = ctx.tp, tp, ctx.sequence_parallel
        self.num_blocks, self.post_norm = resolve_feature_layer(arch.layers, feature_layer)
        self.num_prefix = 1 if arch.class_token else 0
        self.grid = arch.image_size // arch.patch
        self.tokens_per_image = self.grid**2 + self.num_prefix
        self.drop_class_token = drop_class_token and arch.class_token
        self.rows_per_image = self.tokens_per_image - (1 if self.drop_class_token else 0)

        dd = {"device": device, "dtype": dtype}
        D = arch.hidden
        self.patch_embed = PatchEmbed(arch.channels, D, arch.patch, patch_bias(arch), **dd)
        self.cls_token = nn.Parameter(torch.empty(D, **dd)) if arch.class_token else None
        self.pos_embed = nn.Parameter(torch.empty(self.tokens_per_image, D, **dd))
        self.norm_pre = LayerNorm(D, arch.norm_eps, ctx, **dd) if arch.pre_norm else None
        self.blocks = nn.ModuleList(Block(arch, ctx, **dd) for _ in range(self.num_blocks))
        self.norm = LayerNorm(D, arch.norm_eps, ctx, **dd) if self.post_norm else None
        self.graphs = False  # the blocks replay as CUDA graphs (train.cuda_graphs)

    def set_recompute(self, mode: str, layers: int | None = None) -> None:
        """Activation recompute for the first ``layers`` blocks (all when None), as
        ``mimo.llm.model.LLMStage.set_recompute``."""
        set_block_recompute(self.blocks, mode, layers)

    # ---- weights ----
    def init_weights(self, seed: int) -> None:
        """TP-invariant: every parameter's local shard of the full tensor ``param_seed(seed, name)`` draws."""
        init_tp_invariant(self, seed, _vit_init_fn)

    def load_full_(self, state, what: str = "tower weights") -> None:
        load_full_(self, state, what)

    def load_weights_(self, weights) -> None:
        """Load this rank's slices from ``ImportedWeights`` (timm / Hugging Face import; a
        checkpoint still in its file is read only where this rank's slices lie)."""
        if weights.arch != self.arch:
            raise MimoError(f"{weights.where}: imported for {weights.arch}, but the tower is {self.arch}")
        load_full_(self, weights.tower, weights.where)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective over the TP group: full tensors by mimo name."""
        return full_state(self)

    # ---- forward ----
    def embed(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        """[N, L, D]: patches, [CLS] first, plus position embeddings (cat, then add: timm/HF order)."""
        x_NPD = self.patch_embed(pixels_NCHW)
        if self.cls_token is not None:
            cls_N1D = self.cls_token.view(1, 1, -1).expand(x_NPD.shape[0], 1, -1)
            x_NPD = torch.cat([cls_N1D, x_NPD], dim=1)
        return x_NPD + self.pos_embed

    def forward(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        S, C = self.arch.image_size, self.arch.channels
        if pixels_NCHW.dim() != 4 or tuple(pixels_NCHW.shape[1:]) != (C, S, S):
            raise MimoError(f"the tower takes pixels [N, {C}, {S}, {S}], got {tuple(pixels_NCHW.shape)}")
        N, L, D = pixels_NCHW.shape[0], self.tokens_per_image, self.arch.hidden
        pixels_NCHW = pixels_NCHW.to(self.patch_embed.weight.dtype)
        x_TD = self.embed(pixels_NCHW).reshape(N * L, D)
        real = N * L
        if self.sequence_parallel:
            # each rank keeps a contiguous block of rows; pad to a multiple of tp (at least
            # one row per rank, so an empty batch still runs every collective)
            T = -(-max(real, 1) // self.tp_size) * self.tp_size
            x_TD = scatter_along(F.pad(x_TD, (0, 0, 0, T - real)), 0, self.group)
        if self.norm_pre is not None:
            x_TD = self.norm_pre(x_TD)
        for block in self.blocks:
            x_TD = checkpoint(block, x_TD, N, L) if getattr(block, "recompute_full", False) else block(x_TD, N, L)
        if self.graphs:  # out of the CUDA graphs' memory, which their next replay overwrites (an eval cache keeps it)
            x_TD = x_TD.clone()
        if self.norm is not None:
            x_TD = self.norm(x_TD)
        if self.sequence_parallel:
            x_TD = gather_along(x_TD, 0, self.group)[:real]
        x_NLD = x_TD.view(N, L, D)
        if self.drop_class_token:
            x_NLD = x_NLD[:, 1:]
        return x_NLD.reshape(N * self.rows_per_image, D)

    def extra_repr(self) -> str:
        return (f"feature_layer={self.feature_layer!r}, blocks={self.num_blocks}/{self.arch.layers}, "
                f"rows_per_image={self.rows_per_image}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")


def _vit_init_fn(name: str, info: ParamInfo):
    """timm's ViT scheme: trunc-normal(0.02) weights and position embeddings, zero biases,
    unit LayerNorms, a near-zero [CLS] (normal 1e-6)."""
    if isinstance(info.module, LayerNorm):
        value = 1.0 if name.endswith("weight") else 0.0
        return lambda t, g: t.fill_(value)
    if name.endswith("bias"):
        return lambda t, g: t.zero_()
    if name == "cls_token":
        return lambda t, g: t.normal_(0.0, 1e-6, generator=g)
    return lambda t, g: nn.init.trunc_normal_(t, std=0.02, a=-0.04, b=0.04, generator=g)


# ``lora.targets`` of a ``kind: vit`` tower (paths under the tower), as CLIP / SigLIP's Hugging Face
# modules are laid out: q, k and v are three projections there (an adapter each)
LORA_TARGETS = {
    "q": LoraTarget(r"blocks\.\d+\.attn\.qkv", (("q",),)),
    "k": LoraTarget(r"blocks\.\d+\.attn\.qkv", (("k",),)),
    "v": LoraTarget(r"blocks\.\d+\.attn\.qkv", (("v",),)),
    "proj": LoraTarget(r"blocks\.\d+\.attn\.proj"),
    "fc1": LoraTarget(r"blocks\.\d+\.mlp\.fc1"),
    "fc2": LoraTarget(r"blocks\.\d+\.mlp\.fc2"),
}
