"""Causal self-attention over packed sequences (THD), tensor parallel over heads.

One layer = pre-norm, q/k/v projection (one column-parallel GEMM; each TP rank holds
``heads/tp`` query heads and ``kv_heads/tp`` key/value heads, so GQA groups never straddle
ranks), optional QK-norm (per head: Qwen3; over all heads: OLMoE), RoPE at the pack's per-sample positions, attention that never
crosses a ``cu_seqlens`` boundary, row-parallel output projection, residual add.

Two kernels compute the same function:

* ``exact_attention``: per-sample ``scaled_dot_product_attention`` (causal) — any device and
  dtype, exact in fp32; the reference path.
* ``varlen_attention``: ``torch.nn.attention.varlen.varlen_attn`` (flash attention over
  ``cu_seqlens``), CUDA and bf16/fp16 only; causal is ``window_size=(-1, 0)`` (its default
  window is bidirectional). Feature-detected: torch versions whose signature lacks it fall
  back to the exact path.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.core.errors import LayoutError
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.norm import RMSNorm, ShardedRMSNorm
from mimo.llm.rope import RopeConfig, apply_rope, inv_freq, rope_tables
from mimo.parallel.context import ParallelContext
from mimo.parallel.layers import FusedColumnParallelLinear, RowParallelLinear
from mimo.parallel.params import init_params_, param_table


@dataclass(frozen=True)
class AttentionConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope: RopeConfig | None  # None: no positions (Nemotron-H's attention)
    qkv_bias: bool = False
    o_bias: bool = False  # added once, after the TP reduction (RowParallelLinear does so)
    qk_norm: bool = False
    qk_norm_full: bool = False  # over all heads' q / k at once (OLMoE), not per head
    norm_eps: float = 1e-5

    @classmethod
    def from_arch(cls, arch: HybridArch) -> "AttentionConfig":
        return cls(
            hidden=arch.hidden, heads=arch.heads, kv_heads=arch.kv_heads, head_dim=arch.head_dim,
            rope=RopeConfig.from_arch(arch) if arch.rope else None, qkv_bias=bool(arch.qkv_bias), o_bias=bool(arch.o_bias),
            qk_norm=arch.qk_norm, qk_norm_full=arch.qk_norm_full, norm_eps=arch.norm_eps,
        )


class Attention(nn.Module):
    """``forward(h_TD, seq) -> h_TD``: ``h + o_proj(attn(norm(h)))`` (see module doc)."""

    def __init__(self, cfg: AttentionConfig, ctx: ParallelContext | None = None, impl: str = "auto"):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        tp = ctx.tp_size
        if cfg.heads % cfg.kv_heads or cfg.kv_heads % tp:
            raise LayoutError(f"tp={tp} must divide kv_heads={cfg.kv_heads}, which must divide heads={cfg.heads}")
        self.cfg, self.impl = cfg, impl
        self.heads_local, self.kv_heads_local = cfg.heads // tp, cfg.kv_heads // tp
        # under SP each rank normalises its own tokens: the norm weight's gradient is partial
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, ctx, partial=ctx.sequence_parallel)
        hd = cfg.head_dim
        # q | k | v stored as one weight [(heads + 2 kv_heads) * hd, hidden], each part split over TP
        self.qkv = FusedColumnParallelLinear(
            cfg.hidden, {"q": cfg.heads * hd, "k": cfg.kv_heads * hd, "v": cfg.kv_heads * hd},
            bias=cfg.qkv_bias, ctx=ctx,
        )
        if cfg.qk_norm and cfg.qk_norm_full:  # over the whole projection, its weight split over TP with it
            self.q_norm = ShardedRMSNorm(cfg.heads * hd, cfg.norm_eps, ctx)
            self.k_norm = ShardedRMSNorm(cfg.kv_heads * hd, cfg.norm_eps, ctx)
        elif cfg.qk_norm:  # one weight shared by all heads, which are split over TP: a partial gradient
            self.q_norm = RMSNorm(hd, cfg.norm_eps, ctx, partial=True)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, ctx, partial=True)
        self.o_proj = RowParallelLinear(cfg.heads * hd, cfg.hidden, bias=cfg.o_bias, ctx=ctx, input_is_parallel=True)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # not a buffer: .to(bf16) must not round it

    def init_weights(self, seed: int, std: float, out_std: float | None = None) -> None:
        """TP-invariant: each parameter from ``param_seed(seed, its name in this layer)``."""
        init_params_(param_table(self), seed, std, {"o_proj.weight": std if out_std is None else out_std})

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """fp32 RoPE frequencies, computed on CPU (as Hugging Face does) and cached per device."""
        if device not in self._inv_freq:
            self._inv_freq[device] = inv_freq(self.cfg.rope).to(device)
        return self._inv_freq[device]

    def forward(self, h_TD: torch.Tensor, seq: SeqContext) -> torch.Tensor:
        x_TD = self.norm(h_TD)
        q_TF, k_TF, v_TF = self.qkv(x_TD)  # the full local sequence (gathered under SP)
        t, hd = q_TF.shape[0], self.cfg.head_dim
        if self.cfg.qk_norm and self.cfg.qk_norm_full:
            q_TF, k_TF = self.q_norm(q_TF), self.k_norm(k_TF)
        q_THD = q_TF.view(t, self.heads_local, hd)
        k_THD = k_TF.view(t, self.kv_heads_local, hd)
        v_THD = v_TF.view(t, self.kv_heads_local, hd)
        if self.cfg.qk_norm and not self.cfg.qk_norm_full:
            q_THD, k_THD = self.q_norm(q_THD), self.k_norm(k_THD)
        if self.cfg.rope is not None:
            cos_TD, sin_TD = rope_tables(seq.positions, self.inv_freq(seq.positions.device))
            q_THD, k_THD = apply_rope(q_THD, cos_TD, sin_TD), apply_rope(k_THD, cos_TD, sin_TD)
        o_THD = packed_attention(q_THD, k_THD, v_THD, seq, scale=hd ** -0.5, impl=self.impl)
        return h_TD + self.o_proj(o_THD.reshape(t, self.heads_local * hd))


def packed_attention(q_THD, k_THD, v_THD, ctx: SeqContext, scale: float, impl: str = "auto") -> torch.Tensor:
    """Causal attention within each ``ctx.cu_seqlens`` segment. ``impl``: auto | exact | varlen."""
    if impl == "exact":
        return exact_attention(q_THD, k_THD, v_THD, ctx, scale)
    if impl not in ("auto", "varlen"):
        raise ValueError(f"unknown attention impl {impl!r}")
    usable = q_THD.is_cuda and q_THD.dtype in (torch.bfloat16, torch.float16) and _varlen_attn() is not None
    if usable:
        return varlen_attention(q_THD, k_THD, v_THD, ctx, scale)
    if impl == "varlen":
        raise RuntimeError("varlen attention needs CUDA, bf16/fp16 and torch.nn.attention.varlen with window_size")
    return exact_attention(q_THD, k_THD, v_THD, ctx, scale)


def exact_attention(q_THD, k_THD, v_THD, ctx: SeqContext, scale: float) -> torch.Tensor:
    """Reference path: one causal SDPA per sample (memory O(longest sample^2), not O(T^2))."""
    gqa = q_THD.shape[1] != k_THD.shape[1]
    cu = ctx.cu_seqlens.tolist()
    out = []
    for s, e in zip(cu[:-1], cu[1:]):
        if e == s:
            continue
        o_HLD = F.scaled_dot_product_attention(
            q_THD[s:e].transpose(0, 1), k_THD[s:e].transpose(0, 1), v_THD[s:e].transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=gqa,
        )
        out.append(o_HLD.transpose(0, 1))
    if not out:
        return q_THD.new_zeros(q_THD.shape[0], q_THD.shape[1], v_THD.shape[2])
    return torch.cat(out) if len(out) > 1 else out[0]


def _find_varlen_attn():
    """(varlen_attn, its parameter names) when this torch has a causal-capable one, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = frozenset(inspect.signature(varlen_attn).parameters)
    if not {"window_size", "is_causal"} & params:
        return None
    return varlen_attn, params


# resolved once at import, not behind functools.cache: torch.compile traces through a cached
# function on every compile (and warns about it); a constant it simply reads
_VARLEN_ATTN = _find_varlen_attn()


def _varlen_attn():
    return _VARLEN_ATTN


def varlen_attention(q_THD, k_THD, v_THD, ctx: SeqContext, scale: float) -> torch.Tensor:
    """GPU fast path: flash attention over ``cu_seqlens``, causal, bf16/fp16 (see module doc)."""
    fn, params = _varlen_attn()
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal; the default (-1, -1) is bidirectional
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q_THD.shape[-1] ** -0.5) > 1e-12:
        q_THD = q_THD * (scale * q_THD.shape[-1] ** 0.5)  # kernel applies 1/sqrt(head_dim)
    groups = q_THD.shape[1] // k_THD.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k_THD, v_THD = k_THD.repeat_interleave(groups, 1), v_THD.repeat_interleave(groups, 1)
    cu = ctx.cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
    return fn(q_THD, k_THD, v_THD, cu, cu, ctx.max_seqlen, ctx.max_seqlen, **kwargs)


def build_attention(arch: HybridArch, spec, ctx: ParallelContext | None = None) -> Attention:
    return Attention(AttentionConfig.from_arch(arch), ctx)
