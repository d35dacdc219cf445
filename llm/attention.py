"""Causal self-attention over packed sequences (THD), tensor parallel over heads.

One layer = pre-norm, q/k/v projection (one column-parallel GEMM; each TP rank holds
``heads/tp`` query heads and ``kv_heads/tp`` key/value heads, so GQA groups never straddle
ranks), optional QK-norm (per head: Qwen3; over all heads: OLMoE), RoPE at the pack's per-sample positions, attention that never
crosses a ``cu_seqlens`` boundary, row-parallel output projection, residual add.

RoPE is 1-D (``SeqContext.positions``), or, with ``mrope_section`` (Qwen3-VL), multimodal: each
frequency rotates by the time, height or width position of ``SeqContext.positions_3d`` as
``mimo.llm.mrope`` interleaves them (a pack without ``positions_3d``: every axis is
``positions``, i.e. plain RoPE). Partial rotary (Qwen3-Next / Qwen3.5): ``rope.head_dim`` is the
number of leading channels of each head that rotate (M-RoPE's sections then sum to half of it),
the rest pass through unrotated. Under sequence parallelism both describe the full local
sequence the projections are gathered to; under context parallelism this rank's chunks.

Gated attention (``output_gate``, Qwen3-Next / Qwen3.5): the q part of the projection is
``heads * 2 * head_dim`` wide, each head's query followed by its gate (Hugging Face's ``q_proj``
row order, so TP splits every gate with its head); the attention output is multiplied by
``sigmoid(gate)`` before the output projection. ``norm_zero_centred``: the pre-norm and the
QK-norm are zero-centred (``mimo.llm.norm``).

Three kernels compute the same function:

* ``exact_attention``: per-sample ``scaled_dot_product_attention`` (causal) — any device and
  dtype, exact in fp32; the reference path.
* ``varlen_attention``: ``torch.nn.attention.varlen.varlen_attn`` (flash attention over
  ``cu_seqlens``), CUDA and bf16/fp16 only; causal is ``window_size=(-1, 0)`` (its default
  window is bidirectional). Feature-detected: torch versions whose signature lacks it fall
  back to the exact path.
* ``flex_attention_packed``: ``torch.nn.attention.flex_attention`` (compiled) over the whole pack
  with a block mask of ``causal & same segment`` (``document_block_mask``: the segment ids of
  ``cu_seqlens``, padding its own segment), GQA by ``enable_gqa``. The mask is built once per
  pack by ``LLMStage.context`` (``SeqContext.block_mask``) and shared by every layer; without one
  (context parallelism, a generation cache) ``impl="flex"`` takes ``auto``'s path. Torch's
  FlexAttention has no CPU backward: on the CPU it runs forwards only (eval).

``impl`` picks: ``auto`` (varlen where usable, else exact), ``varlen``, ``exact`` or ``flex``;
``set_attention_kernel`` gives a model's attention layers ``train.attention`` (multi-latent
attention, ``mimo.llm.mla``, keeps its own).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from mimo.core.errors import LayoutError
from mimo.llm.cache import pad_rows
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext, segment_index
from mimo.llm.mrope import mrope_axes, mrope_tables
from mimo.llm.norm import RMSNorm, ShardedRMSNorm
from mimo.llm.rope import RopeConfig, apply_rope, inv_freq, rope_tables
from mimo.parallel.collectives import all_gather_along, reduce_scatter_along
from mimo.parallel.context import ParallelContext
from mimo.parallel.layers import FusedColumnParallelLinear, RowParallelLinear
from mimo.parallel import norm_rope
from mimo.parallel.params import init_params_, param_table
from mimo.parallel.recompute import maybe


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
    mrope_section: tuple[int, ...] | None = None  # M-RoPE (time, height, width) frequency counts
    output_gate: bool = False  # sigmoid gate from the q projection on the attention output (Qwen3-Next)
    norm_zero_centred: bool = False  # zero-centred pre-norm and QK-norm (Qwen3-Next)

    @classmethod
    def from_arch(cls, arch: HybridArch) -> "AttentionConfig":
        rope = RopeConfig.from_arch(arch) if arch.rope else None
        if rope is not None and arch.rotary_fraction != 1.0:  # partial rotary: rope.head_dim = rotating channels
            rope = replace(rope, head_dim=arch.rotary_dim)
        return cls(
            hidden=arch.hidden, heads=arch.heads, kv_heads=arch.kv_heads, head_dim=arch.head_dim,
            rope=rope, qkv_bias=bool(arch.qkv_bias), o_bias=bool(arch.o_bias),
            qk_norm=arch.qk_norm, qk_norm_full=arch.qk_norm_full, norm_eps=arch.norm_eps,
            mrope_section=tuple(arch.mrope_section) if arch.rope and arch.mrope_section is not None else None,
            output_gate=arch.attn_output_gate, norm_zero_centred=arch.norm_zero_centred,
        )


class Attention(nn.Module):
    """``forward(h_TD, seq) -> h_TD``: ``h + o_proj(attn(norm(h)))`` (see module doc)."""

    def __init__(self, cfg: AttentionConfig, ctx: ParallelContext | None = None, impl: str = "auto"):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        tp = ctx.tp_size
        if cfg.heads % cfg.kv_heads or cfg.kv_heads % tp:
            raise LayoutError(f"tp={tp} must divide kv_heads={cfg.kv_heads}, which must divide heads={cfg.heads}")
        hd = cfg.head_dim
        if cfg.rope is not None and (cfg.rope.head_dim > hd or cfg.rope.head_dim % 2 or cfg.rope.head_dim < 2):
            raise LayoutError(f"rotary dim {cfg.rope.head_dim} must be even, >= 2 and at most head_dim={hd}")
        self.cfg, self.impl = cfg, impl
        self.heads_local, self.kv_heads_local = cfg.heads // tp, cfg.kv_heads // tp
        zc = cfg.norm_zero_centred
        # under SP each rank normalises its own tokens: the norm weight's gradient is partial
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, ctx, partial=ctx.sequence_parallel, zero_centred=zc)
        # q | k | v stored as one weight [(heads + 2 kv_heads) * hd, hidden], each part split over TP
        # (gated: q is [q_0 | g_0 | q_1 | g_1 ...], 2 * hd rows a head, split over TP by heads)
        q_width = cfg.heads * hd * (2 if cfg.output_gate else 1)
        self.qkv = FusedColumnParallelLinear(
            cfg.hidden, {"q": q_width, "k": cfg.kv_heads * hd, "v": cfg.kv_heads * hd},
            bias=cfg.qkv_bias, ctx=ctx,
        )
        if cfg.qk_norm and cfg.qk_norm_full:  # over the whole projection, its weight split over TP with it
            self.q_norm = ShardedRMSNorm(cfg.heads * hd, cfg.norm_eps, ctx, zero_centred=zc)
            self.k_norm = ShardedRMSNorm(cfg.kv_heads * hd, cfg.norm_eps, ctx, zero_centred=zc)
        elif cfg.qk_norm:  # one weight shared by all heads, which are split over TP: a partial gradient
            self.q_norm = RMSNorm(hd, cfg.norm_eps, ctx, partial=True, zero_centred=zc)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, ctx, partial=True, zero_centred=zc)
        self.o_proj = RowParallelLinear(cfg.heads * hd, cfg.hidden, bias=cfg.o_bias, ctx=ctx, input_is_parallel=True)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # not a buffer: .to(bf16) must not round it
        self._mrope_axes: dict[torch.device, torch.Tensor] = {}

    def init_weights(self, seed: int, std: float, out_std: float | None = None) -> None:
        """TP-invariant: each parameter from ``param_seed(seed, its name in this layer)``."""
        init_params_(param_table(self), seed, std, {"o_proj.weight": std if out_std is None else out_std})

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """fp32 RoPE frequencies, computed on CPU (as Hugging Face does) and cached per device."""
        if device not in self._inv_freq:
            self._inv_freq[device] = inv_freq(self.cfg.rope).to(device)
        return self._inv_freq[device]

    def mrope_tables(self, seq: SeqContext) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, head_dim]`` of M-RoPE at the pack's 3-D positions (1-D without them)."""
        device = seq.positions.device
        if seq.positions_3d is None:
            return rope_tables(seq.positions, self.inv_freq(device))
        if device not in self._mrope_axes:
            self._mrope_axes[device] = mrope_axes(self.cfg.rope.head_dim, self.cfg.mrope_section).to(device)
        return mrope_tables(seq.positions_3d.to(device), self.inv_freq(device), self._mrope_axes[device])

    selective = False  # recompute the attention core in backward (mimo.parallel.recompute)

    def forward(self, h_TD: torch.Tensor, seq: SeqContext) -> torch.Tensor:
        x_TD = self.norm(h_TD)
        q_TF, k_TF, v_TF = self.qkv(x_TD)  # the full local sequence (gathered under SP)
        o_TF = maybe(self.selective, lambda q, k, v: self._core(q, k, v, seq), q_TF, k_TF, v_TF)
        return h_TD + self.o_proj(o_TF)

    def _core(self, q_TF, k_TF, v_TF, seq: SeqContext) -> torch.Tensor:
        """From the projections to the attention output: QK-norm, RoPE, attention (and its output gate)."""
        t, hd = q_TF.shape[0], self.cfg.head_dim
        if self.cfg.output_gate:  # per head [query | gate], as Hugging Face's q_proj.view(..., -1, 2 * hd).chunk(2)
            qg_THD = q_TF.view(t, self.heads_local, 2 * hd)
            q_TF = qg_THD[..., :hd].reshape(t, self.heads_local * hd)
            gate_TF = qg_THD[..., hd:].reshape(t, self.heads_local * hd)
        if self.cfg.qk_norm and self.cfg.qk_norm_full:
            q_TF, k_TF = self.q_norm(q_TF), self.k_norm(k_TF)
        q_THD = q_TF.view(t, self.heads_local, hd)
        k_THD = k_TF.view(t, self.kv_heads_local, hd)
        v_THD = v_TF.view(t, self.kv_heads_local, hd)
        per_head_norm = self.cfg.qk_norm and not self.cfg.qk_norm_full
        # per-head QK-norm and full RoPE on the GPU: one op each way (mimo.parallel.norm_rope)
        fused = per_head_norm and self.cfg.rope is not None and self.cfg.rope.head_dim == hd and norm_rope.takes(q_THD)
        if per_head_norm and not fused:
            q_THD, k_THD = self.q_norm(q_THD), self.k_norm(k_THD)
        if self.cfg.rope is not None:
            if self.cfg.mrope_section is None:
                cos_TD, sin_TD = rope_tables(seq.positions, self.inv_freq(seq.positions.device))
            else:
                cos_TD, sin_TD = self.mrope_tables(seq)
            rd = self.cfg.rope.head_dim
            if fused:
                q_THD, k_THD = (norm_rope.norm_rope(x, n.weight, cos_TD, sin_TD, n.eps, n.zero_centred)
                                for x, n in ((q_THD, self.q_norm), (k_THD, self.k_norm)))
            elif rd == hd:
                q_THD, k_THD = apply_rope(q_THD, cos_TD, sin_TD), apply_rope(k_THD, cos_TD, sin_TD)
            else:  # partial rotary: the first rd channels rotate, the rest pass (Hugging Face's cat order)
                q_THD, k_THD = (torch.cat((apply_rope(x[..., :rd], cos_TD, sin_TD), x[..., rd:]), dim=-1)
                                for x in (q_THD, k_THD))
        if seq.cache is None:
            o_THD = packed_attention(q_THD, k_THD, v_THD, seq, scale=hd ** -0.5, impl=self.impl)
        else:
            o_THD = cached_attention(seq.cache.state(self), q_THD, k_THD, v_THD, seq, hd ** -0.5, self.impl)
        o_TF = o_THD.reshape(t, self.heads_local * hd)
        return o_TF * torch.sigmoid(gate_TF) if self.cfg.output_gate else o_TF


IMPLS = ("auto", "varlen", "exact", "flex")  # train.attention's values (module doc)


def set_attention_kernel(model: nn.Module, kind: str) -> int:
    """``train.attention``: ``kind`` (``IMPLS``) as the ``impl`` of every ``Attention`` layer of
    ``model`` (multi-latent attention keeps its own); returns how many there are."""
    if kind not in IMPLS:
        raise ValueError(f"unknown attention impl {kind!r}")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.impl = kind
    return len(layers)


def packed_attention(q_THD, k_THD, v_THD, ctx: SeqContext, scale: float, impl: str = "auto") -> torch.Tensor:
    """Causal attention within each ``ctx.cu_seqlens`` segment. ``impl``: auto | exact | varlen | flex.
    Under context parallelism each segment is a chunk of a sample and attends to the sample's
    prefix up to its own end, gathered over the CP ranks (``mimo.llm.cp``). ``flex`` runs where
    ``ctx`` holds a block mask; a context without one (CP, a generation cache: ``LLMStage.context``
    builds none there) takes ``auto``'s path, as every other layer kind does with it."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}")
    if impl == "flex":
        if ctx.block_mask is not None:
            return flex_attention_packed(q_THD, k_THD, v_THD, ctx, scale)
        impl = "auto"
    usable = (impl != "exact" and q_THD.is_cuda and q_THD.dtype in (torch.bfloat16, torch.float16)
              and _varlen_attn() is not None)
    if impl == "varlen" and not usable:
        raise RuntimeError("varlen attention needs CUDA, bf16/fp16 and torch.nn.attention.varlen with window_size")
    if ctx.cp is None:
        return (varlen_attention if usable else exact_attention)(q_THD, k_THD, v_THD, ctx, scale)
    if not usable:  # K/V gathered again in backward, not kept: activation memory O(local tokens)
        return _CPAttention.apply(q_THD, k_THD, v_THD, ctx.cp, scale)
    rows, cu_k, max_k = ctx.cp.key_rows
    k_THD, v_THD = (ctx.cp.gather(x).index_select(0, rows) for x in (k_THD, v_THD))
    return varlen_attention(q_THD, k_THD, v_THD, ctx, scale, (cu_k, max_k))


def cached_attention(state: dict, q_THD, k_THD, v_THD, seq: SeqContext, scale: float, impl: str = "auto") -> torch.Tensor:
    """``packed_attention`` under a generation cache (``mimo.llm.cache``; ``state``: the layer's
    entry): the prefill attends as without one and keeps every sample's keys and values (local
    heads, RoPE applied); a decode step writes each row's new key / value at the row's length and
    attends its query over the row's keys (one batched SDPA, the unused room masked)."""
    cache = seq.cache
    if not cache.decoding:
        state["k"], state["v"] = cache.prefill_buffer(k_THD), cache.prefill_buffer(v_THD)
        return packed_attention(q_THD, k_THD, v_THD, seq, scale, impl)
    n = cache.rows
    state["k"], state["v"] = cache.append(state["k"], k_THD[:n]), cache.append(state["v"], v_THD[:n])
    span, mask_N11L = cache.key_mask()
    o_NH1D = F.scaled_dot_product_attention(
        q_THD[:n, :, None], state["k"][:, :, :span], state["v"][:, :, :span], attn_mask=mask_N11L, scale=scale,
        enable_gqa=q_THD.shape[1] != k_THD.shape[1],
    )
    return pad_rows(o_NH1D[:, :, 0], q_THD.shape[0])


# never traced: its loop runs over the pack's lengths read on the host, which a compiled layer
# would guard on (one recompile per new set of lengths); called from a compiled layer, it runs
# eagerly between the layer's graphs (torch.compiler.disable, dynamo imported on the first call)
@torch._disable_dynamo
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


# ---------------------------------------------------------------- FlexAttention
@functools.cache  # (called outside compiled code only: dynamo would trace the cache)
def _compiled_flex():
    """``flex_attention`` through ``torch.compile``, once: eager ``flex_attention`` is an unfused
    reference that materialises every score. Dynamic (as ``_compiled_block_mask``)."""
    return torch.compile(flex_attention, dynamic=True)


@functools.cache
def _compiled_block_mask():
    """``create_block_mask`` through ``torch.compile``, once: fused, it never materialises the
    ``[T, T]`` mask its eager form builds. Every pack's length differs: ``dynamic=True`` traces
    the length symbolic from the first pack on, one graph for all (the default compiles each of
    the first two lengths; padding packs to a few fixed lengths would cost every layer the pad).
    A pack of at most 128 tokens (one mask block) compiles once more: dynamo specialises size 1."""
    return torch.compile(create_block_mask, dynamic=True)


def document_block_mask(seq: SeqContext) -> BlockMask:
    """The pack's ``BlockMask`` for ``flex_attention_packed``: query i sees key j iff j <= i and
    both lie in one ``cu_seqlens`` segment (padding is its own). Built on the device of
    ``seq.positions`` (the layers' device), from the segment ids alone: no host sync. On the
    GPU by the compiled builder; on the CPU (tests, small runs) by the eager one, whose ``[T, T]``
    mask costs a CPU-sized pack less than inductor's C++ build of the compiled one (~15 s)."""
    t = seq.positions.numel()
    seg_T = segment_index(seq.cu_seqlens.to(seq.positions.device), t)

    def causal_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (seg_T[q_idx] == seg_T[kv_idx])

    build = _compiled_block_mask() if seg_T.is_cuda else create_block_mask
    with torch.no_grad():  # one graph for training and eval forwards (dynamo guards on grad mode)
        return build(causal_document, None, None, t, t, device=seg_T.device)


def flex_attention_packed(q_THD, k_THD, v_THD, ctx: SeqContext, scale: float) -> torch.Tensor:
    """``exact_attention``'s function by FlexAttention over ``ctx.block_mask``
    (``document_block_mask``): one kernel over the whole pack, blocks no query sees skipped.
    ``[T, H, D]`` in and out; flex's layout is ``[1, H, T, D]`` (v's head size may differ)."""
    # in a compiled layer dynamo traces flex_attention into the layer's graph; outside one, the
    # compiled wrapper (the layers run eagerly without train.compile)
    flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    q_1HTD, k_1HTD, v_1HTD = (x.transpose(0, 1).unsqueeze(0) for x in (q_THD, k_THD, v_THD))
    o_1HTD = flex(q_1HTD, k_1HTD, v_1HTD, block_mask=ctx.block_mask, scale=scale,
                  enable_gqa=q_THD.shape[1] != k_THD.shape[1])
    return o_1HTD[0].transpose(0, 1)


# ---------------------------------------------------------------- context parallelism, exact
TILE = 512  # queries / keys per tile of the exact CP path (memory O(tile^2 * heads) at a time)


def _tiles(lq: int, lk: int, tile: int):
    """(query tile, key tile, needs a mask) pairs of a bottom-right causal run: query i sees
    keys 0 .. i + lk - lq."""
    off = lk - lq
    for qs in range(0, lq, tile):
        qe = min(qs + tile, lq)
        for ks in range(0, min(lk, qe + off), tile):
            ke = min(ks + tile, lk, qe + off)
            yield slice(qs, qe), slice(ks, ke), ke - 1 > qs + off


def _scores(q_GQD, k_KD, qs: slice, ks: slice, off: int, masked: bool, scale: float):
    """Scores of a tile, ``[kv heads, group, q, k]``, -inf where the key is in the future."""
    s = torch.einsum("hgqd,hkd->hgqk", q_GQD[:, :, qs], k_KD[:, ks]) * scale
    if masked:
        qi = torch.arange(qs.start, qs.stop, device=s.device)[:, None] + off
        ki = torch.arange(ks.start, ks.stop, device=s.device)[None, :]
        s = s.masked_fill(ki > qi, float("-inf"))
    return s


def _run_forward(q_GQD, k_KD, v_KD, scale: float):
    """Bottom-right causal attention of one run by tiles with an online softmax:
    (out ``[h, g, q, d]``, logsumexp ``[h, g, q]``)."""
    lq, lk = q_GQD.shape[2], k_KD.shape[1]
    out = q_GQD.new_zeros(*q_GQD.shape[:3], v_KD.shape[-1])
    lse = q_GQD.new_full(q_GQD.shape[:3], float("-inf"))
    for qs, ks, masked in _tiles(lq, lk, TILE):
        s = _scores(q_GQD, k_KD, qs, ks, lk - lq, masked, scale)
        m_old = lse[:, :, qs]
        m = torch.maximum(m_old, s.amax(-1))
        p = torch.exp(s - m[..., None])
        keep = torch.exp(m_old - m)  # the old sum's share, exp(lse_old - m)
        total = keep + p.sum(-1)
        out[:, :, qs] = (out[:, :, qs] * keep[..., None] + p @ v_KD[:, ks][:, None]) / total[..., None]
        lse[:, :, qs] = m + torch.log(total)
    return out, lse


def _run_backward(q_GQD, k_KD, v_KD, out, lse, dout, scale: float):
    lq, lk = q_GQD.shape[2], k_KD.shape[1]
    delta = (dout * out).sum(-1)
    dq, dk, dv = torch.zeros_like(q_GQD), torch.zeros_like(k_KD), torch.zeros_like(v_KD)
    for qs, ks, masked in _tiles(lq, lk, TILE):
        p = torch.exp(_scores(q_GQD, k_KD, qs, ks, lk - lq, masked, scale) - lse[:, :, qs, None])
        dv[:, ks] += torch.einsum("hgqk,hgqd->hkd", p, dout[:, :, qs])
        ds = p * (torch.einsum("hgqd,hkd->hgqk", dout[:, :, qs], v_KD[:, ks]) - delta[:, :, qs, None]) * scale
        dq[:, :, qs] += torch.einsum("hgqk,hkd->hgqd", ds, k_KD[:, ks])
        dk[:, ks] += torch.einsum("hgqk,hgqd->hkd", ds, q_GQD[:, :, qs])
    return dq, dk, dv


class _CPAttention(torch.autograd.Function):
    """Exact causal attention of one CP rank's chunks against their samples' prefixes: K and V
    all-gathered over CP, each chunk's queries attending to ``CPChunks.key_rows`` by tiles
    (bottom-right causal, online softmax). Only the local q, k, v, output and logsumexp are
    kept; backward gathers K and V again and reduce-scatters their gradients to their owners."""

    @staticmethod
    def forward(ctx, q_THD, k_THD, v_THD, cp, scale: float):
        kv = k_THD.shape[1]
        k_all, v_all = (all_gather_along(x, 0, cp.group) for x in (k_THD, v_THD))
        rows, cu_k, _ = cp.key_rows
        cu_q, cu_kl, rows = cp.ends_host(), cu_k.tolist(), rows
        out, lse = q_THD.new_empty(*q_THD.shape[:2], v_THD.shape[-1]), q_THD.new_empty(q_THD.shape[:2])  # (v's head size)
        for i, (qs, qe) in enumerate(zip(cu_q[:-1], cu_q[1:])):
            sel = rows[cu_kl[i]:cu_kl[i + 1]]
            q = q_THD[qs:qe].view(qe - qs, kv, -1, q_THD.shape[-1]).permute(1, 2, 0, 3)  # [h, g, q, d]
            o, l = _run_forward(q, k_all[sel].transpose(0, 1), v_all[sel].transpose(0, 1), scale)
            out[qs:qe] = o.permute(2, 0, 1, 3).reshape(qe - qs, *out.shape[1:])
            lse[qs:qe] = l.permute(2, 0, 1).reshape(qe - qs, -1)
        ctx.save_for_backward(q_THD, k_THD, v_THD, out, lse)
        ctx.cp, ctx.scale = cp, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q_THD, k_THD, v_THD, out, lse = ctx.saved_tensors
        cp, scale, kv, d = ctx.cp, ctx.scale, k_THD.shape[1], q_THD.shape[-1]
        k_all, v_all = (all_gather_along(x, 0, cp.group) for x in (k_THD, v_THD))
        dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
        dq = torch.empty_like(q_THD)
        rows, cu_k, _ = cp.key_rows
        cu_q, cu_kl = cp.ends_host(), cu_k.tolist()
        as_run = lambda t, n: t.view(n, kv, -1, t.shape[-1]).permute(1, 2, 0, 3)  # noqa: E731
        for i, (qs, qe) in enumerate(zip(cu_q[:-1], cu_q[1:])):
            sel, n = rows[cu_kl[i]:cu_kl[i + 1]], qe - qs
            g = lse[qs:qe].view(n, kv, -1).permute(1, 2, 0)
            dq_run, dk, dv = _run_backward(as_run(q_THD[qs:qe], n), k_all[sel].transpose(0, 1), v_all[sel].transpose(0, 1),
                                           as_run(out[qs:qe], n), g, as_run(dout[qs:qe].contiguous(), n), scale)
            dq[qs:qe] = dq_run.permute(2, 0, 1, 3).reshape(n, -1, d)
            dk_all.index_add_(0, sel, dk.transpose(0, 1))
            dv_all.index_add_(0, sel, dv.transpose(0, 1))
        return dq, reduce_scatter_along(dk_all, 0, cp.group), reduce_scatter_along(dv_all, 0, cp.group), None, None


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


def varlen_attention(q_THD, k_THD, v_THD, ctx: SeqContext, scale: float, keys=None) -> torch.Tensor:
    """GPU fast path: flash attention over ``cu_seqlens``, causal, bf16/fp16 (see module doc).
    ``keys``: (int32 cu_seqlens of the keys, the longest run) when keys are segmented otherwise
    than queries (context parallelism: each chunk's queries against its sample's prefix; flash
    attention aligns causality at the bottom right, the last query seeing the whole run)."""
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
    cu_k, max_k = (cu, ctx.max_seqlen) if keys is None else (keys[0].to(q_THD.device), keys[1])
    return fn(q_THD, k_THD, v_THD, cu, cu_k, ctx.max_seqlen, max_k, **kwargs)


def build_attention(arch: HybridArch, spec, ctx: ParallelContext | None = None) -> Attention:
    return Attention(AttentionConfig.from_arch(arch), ctx)
