"""Tensor-parallel Vision Transformer (ViT / CLIP / SigLIP towers), timm-like.

TP splits attention heads (one fused QKV column-parallel matmul, row-parallel output
projection) and the MLP's hidden units (column then row parallel), Megatron style. With
``sequence_parallel`` the residual stream between those regions holds this rank's block of
rows instead of a replicated copy (all-gather in, reduce-scatter out).

Images never attend to each other: the rows of a batch are viewed as ``[N, L, ...]`` for
attention, bidirectional within each image. The tower's output is ``[N * rows, D]``
(images concatenated), replicated over the TP group.

Parameter names and full shapes are mimo's own, layout-independent (``blocks.3.attn.qkv.weight``
is ``[3, D, D]``: q, k, v rows by head); ``encoders.timm_import`` / ``encoders.hf_import`` map
them to and from the timm / Hugging Face layouts.

Shape suffixes: N images, L tokens per image (patches + [CLS]), T rows (N*L, padded to a
multiple of tp under sequence parallel), D hidden, H heads (this rank's), K head dim,
F MLP hidden, C channels.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.encoders.config import VitArch
from mimo.encoders.tp_state import TPParam, full_state, init_tp_invariant, load_full_, shard_specs
from mimo.core.errors import LayoutError, MimoError
from mimo.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    TPModule,
    copy_to_group,
    gather_along,
    gather_seq,
    group_size,
    scatter_along,
)

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


class LayerNorm(nn.Module):
    """LayerNorm whose replicated parameters stay correct under sequence parallel.

    With SP each rank normalises only its rows, so its weight/bias gradients are partial;
    ``copy_to_group`` all-reduces them in backward (complete on every rank, DESIGN §2).
    """

    def __init__(self, dim: int, eps: float, group=None, sequence_parallel: bool = False, *, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.group = group
        self.sequence_parallel = sequence_parallel and group_size(group) > 1
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w, b = copy_to_group(w, self.group), copy_to_group(b, self.group)
        return F.layer_norm(x_TD, (self.dim,), w, b, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> D, a strided conv (weight ``[D, C, p, p]`` as timm and HF store it)."""

    def __init__(self, channels: int, dim: int, patch: int, bias: bool, *, device=None, dtype=None):
        super().__init__()
        self.patch = patch
        self.weight = nn.Parameter(torch.empty(dim, channels, patch, patch, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(dim, device=device, dtype=dtype)) if bias else None

    def forward(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        x_NDhw = F.conv2d(pixels_NCHW, self.weight, self.bias, stride=self.patch)
        return x_NDhw.flatten(2).transpose(1, 2)  # [N, P, D], patches in row-major order


class QKVParallelLinear(TPModule):
    """Fused q/k/v projection, column-parallel over heads.

    Full weight ``[3, D, D]`` (q, k, v; rows by head), sharded along dim 1, so rank r holds
    heads ``[r*H/tp, (r+1)*H/tp)`` of all three and one matmul computes them. (A plain
    column split of timm's ``[3D, D]`` would hand rank 0 all of q instead.)
    """

    def __init__(self, dim: int, bias: bool = True, group=None, sequence_parallel: bool = False, *, device=None, dtype=None):
        super().__init__(group)
        self.dim, self.sequence_parallel = dim, sequence_parallel
        self._specs = {"weight": ShardSpec((3, dim, dim), dim=1)}
        if bias:
            self._specs["bias"] = ShardSpec((3, dim), dim=1)
        self.weight = self._new_param(self._specs["weight"], device, dtype)
        self.bias = self._new_param(self._specs["bias"], device, dtype) if bias else None

    def shard_specs(self) -> dict[str, ShardSpec]:
        return self._specs

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        x_TD = gather_seq(x_TD, self.group) if self.sequence_parallel else copy_to_group(x_TD, self.group)
        w = self.weight.flatten(0, 1)  # [3 * D/tp, D]
        b = None if self.bias is None else self.bias.flatten()
        return F.linear(x_TD, w, b)  # [T, 3 * D/tp]: q | k | v of this rank's heads

    def extra_repr(self) -> str:
        return f"dim={self.dim}, tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, group=None, sequence_parallel: bool = False, *, device=None, dtype=None):
        super().__init__()
        tp = group_size(group)
        self.heads_local, self.head_dim = heads // tp, dim // heads
        self.qkv = QKVParallelLinear(dim, True, group, sequence_parallel, device=device, dtype=dtype)
        self.proj = RowParallelLinear(dim, dim, True, group, input_is_parallel=True, sequence_parallel=sequence_parallel,
                                      device=device, dtype=dtype)

    def forward(self, x_TD: torch.Tensor, n_images: int, tokens: int) -> torch.Tensor:
        H, K = self.heads_local, self.head_dim
        qkv_TX = self.qkv(x_TD)  # all T rows (gathered under SP)
        T, real = qkv_TX.shape[0], n_images * tokens
        # one attention per image: [N, L] rows; padding rows (SP) take no part
        qkv_NL3HK = qkv_TX[:real].view(n_images, tokens, 3, H, K)
        q_NHLK, k_NHLK, v_NHLK = qkv_NL3HK.permute(2, 0, 3, 1, 4).unbind(0)
        o_NHLK = F.scaled_dot_product_attention(q_NHLK, k_NHLK, v_NHLK)
        o_TX = o_NHLK.transpose(1, 2).reshape(real, H * K)
        if T > real:
            o_TX = F.pad(o_TX, (0, 0, 0, T - real))
        return self.proj(o_TX)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, group=None, sequence_parallel: bool = False, *, device=None, dtype=None):
        super().__init__()
        self.act = _ACTS[act]
        self.fc1 = ColumnParallelLinear(dim, hidden, True, group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.fc2 = RowParallelLinear(hidden, dim, True, group, input_is_parallel=True, sequence_parallel=sequence_parallel,
                                     device=device, dtype=dtype)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x_TD)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, arch: VitArch, group=None, sequence_parallel: bool = False, *, device=None, dtype=None):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.norm1 = LayerNorm(arch.hidden, arch.norm_eps, group, sequence_parallel, **dd)
        self.attn = Attention(arch.hidden, arch.heads, group, sequence_parallel, **dd)
        self.norm2 = LayerNorm(arch.hidden, arch.norm_eps, group, sequence_parallel, **dd)
        self.mlp = Mlp(arch.hidden, arch.mlp, arch.act, group, sequence_parallel, **dd)

    def forward(self, x_TD: torch.Tensor, n_images: int, tokens: int) -> torch.Tensor:
        x_TD = x_TD + self.attn(self.norm1(x_TD), n_images, tokens)
        return x_TD + self.mlp(self.norm2(x_TD))


class VisionTransformer(nn.Module):
    """The vision tower: pixels ``[N, C, S, S]`` -> feature rows ``[N * rows_per_image, D]``.

    Only the blocks ``feature_layer`` needs are built (and the final norm only for
    ``post_norm``); weights of the rest stay with the imported checkpoint
    (``ImportedWeights``), so export still writes them.
    """

    def __init__(
        self,
        arch: VitArch,
        feature_layer: int | str = -2,
        *,
        drop_class_token: bool = True,
        group=None,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = group_size(group)
        for name in ("heads", "mlp"):
            if getattr(arch, name) % tp:
                raise LayoutError(f"tp={tp} does not divide the tower's {name} ({getattr(arch, name)})")
        if arch.image_size % arch.patch:
            raise LayoutError(f"image_size {arch.image_size} is not divisible by patch {arch.patch}")
        self.arch, self.feature_layer = arch, feature_layer
        self.group, self.tp_size = group, tp
        self.sequence_parallel = sequence_parallel and tp > 1
        self.num_blocks, self.post_norm = resolve_feature_layer(arch.layers, feature_layer)
        self.num_prefix = 1 if arch.class_token else 0
        self.grid = arch.image_size // arch.patch
        self.tokens_per_image = self.grid**2 + self.num_prefix
        self.drop_class_token = drop_class_token and arch.class_token
        self.rows_per_image = self.tokens_per_image - (1 if self.drop_class_token else 0)

        dd = {"device": device, "dtype": dtype}
        sp = self.sequence_parallel
        D = arch.hidden
        self.patch_embed = PatchEmbed(arch.channels, D, arch.patch, patch_bias(arch), **dd)
        self.cls_token = nn.Parameter(torch.empty(D, **dd)) if arch.class_token else None
        self.pos_embed = nn.Parameter(torch.empty(self.tokens_per_image, D, **dd))
        self.norm_pre = LayerNorm(D, arch.norm_eps, group, sp, **dd) if arch.pre_norm else None
        self.blocks = nn.ModuleList(Block(arch, group, sp, **dd) for _ in range(self.num_blocks))
        self.norm = LayerNorm(D, arch.norm_eps, group, sp, **dd) if self.post_norm else None

    # ---- weights ----
    def shard_specs(self) -> dict[str, ShardSpec]:
        return shard_specs(self)

    def init_weights(self, seed: int) -> None:
        """TP-invariant: every parameter drawn at full shape from ``param_seed(seed, name)``."""
        init_tp_invariant(self, seed, _vit_init_fn)

    def load_full_(self, state, what: str = "tower weights") -> None:
        load_full_(self, state, what)

    def load_weights_(self, weights) -> None:
        """Load this rank's slices from ``ImportedWeights`` (timm / Hugging Face import)."""
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
            x_TD = block(x_TD, N, L)
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


def _vit_init_fn(p: TPParam):
    """timm's ViT scheme: trunc-normal(0.02) weights and position embeddings, zero biases,
    unit LayerNorms, a near-zero [CLS] (normal 1e-6)."""
    if isinstance(p.owner, LayerNorm):
        value = 1.0 if p.name.endswith("weight") else 0.0
        return lambda t, g: t.fill_(value)
    if p.name.endswith("bias"):
        return lambda t, g: t.zero_()
    if p.name == "cls_token":
        return lambda t, g: t.normal_(0.0, 1e-6, generator=g)
    return lambda t, g: nn.init.trunc_normal_(t, std=0.02, a=-0.04, b=0.04, generator=g)
