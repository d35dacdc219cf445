"""Multi-head latent attention (MLA, DeepSeek-V2 / V3) over packed sequences (THD), tensor
parallel over heads: the ``+`` layer of the pattern (Megatron's symbol).

One layer (Hugging Face's ``DeepseekV3Attention`` between our pre-norm and residual add)::

    x = RMSNorm(h)
    q      = q_b_proj(RMSNorm_q(q_a_proj(x)))               (q_lora_rank set; else q_proj(x))
    c, k_r = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
    k_n, v = split per head(kv_b_proj(RMSNorm_kv(c)), [qk_nope_head_dim, v_head_dim])
    q_n, q_r = split per head(q, [qk_nope_head_dim, qk_rope_head_dim])
    q = [q_n | rope(q_r)],  k = [k_n | rope(k_r)]            (k_r: one rotary key shared by all heads)
    o = causal softmax(q k^T * scale) v within each sample  ->  o_proj  ->  + h

* **RoPE** rotates only the rope channels, in DeepSeek's interleaved-pairs layout (Hugging Face's
  ``rope_interleave``, ``apply_rotary_pos_emb_interleave``): channels (2i, 2i+1) are one pair,
  rotated by frequency i; the rotated channels come out de-interleaved (the pairs' first
  elements, then their second ones) as Hugging Face writes them, the same permutation for q
  and k, so the scores are those of the interleaved rotation. Frequencies over
  ``qk_rope_head_dim`` channels from ``rope_theta`` and ``rope_scaling`` (linear / llama3:
  ``mimo.llm.rope.inv_freq``; yarn: ``yarn_inv_freq`` here, Hugging Face's
  ``_compute_yarn_parameters``, whose ``attention_factor`` scales cos and sin).
* **Softmax scale** ``(qk_nope + qk_rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2``
  under yarn scaling with ``mscale_all_dim`` (Hugging Face's ``yarn_apply_mscale``; ``mscale(s, m)
  = 0.1 m ln s + 1`` for s > 1, else 1).
* The latent norms' epsilon is 1e-6 whatever ``norm_eps`` is (Hugging Face builds
  ``DeepseekV3RMSNorm(rank)`` with its default, as DeepSeek's reference code does).
* **Biases**: ``arch.qkv_bias`` puts one on the two down projections and ``arch.o_bias`` on the
  output projection (Hugging Face's ``attention_bias`` sets all three; the up projections have none).

**Tensor parallelism** splits the heads: ``q_b_proj`` / ``q_proj`` and ``kv_b_proj`` are
column-parallel (whole heads per rank, their rows per head ``[nope | rope]`` and ``[k_nope | v]``),
``o_proj`` row-parallel; no rank computes another rank's heads. The down projections
(``q_a_proj``, ``kv_a_proj_with_mqa``) and the latent norms are replicated and run on the rows
this rank holds, as Megatron's MLA does: without sequence parallelism the whole (replicated)
pack, each rank computing the same latents; with it, this rank's ``[T/tp, D]`` token block, and
the latents (much narrower than the hidden state) are what is gathered: the up projections
gather theirs (``ColumnParallelLinear``: all-gather forward, reduce-scatter backward) and the
shared rotary key is gathered likewise (``gather_seq``; without SP ``copy_to_group``, whose
backward sums the heads' partial gradients over TP). So the gradient reaching a latent is
complete for the rows this rank holds, and the down projections' (and latent norms') weight
gradients are partial sums over TP exactly when sequence parallelism splits the rows: their
placements say ``partial=("tp",)`` then (as the pre-norm's), and training sums them once a step.
Every product goes through the TP layers or ``ReplicatedLinear`` (``mimo.parallel.gemm.linear``
with the module's recipe), so FP8 and selective recompute (the attention core, from the
projections' outputs to the attention output) come as for ``*`` attention.

**Context parallelism**: the projections and RoPE act per token (each CP rank's chunks at their
global positions); the attention is ``packed_attention``'s over CP (keys and values gathered, v's
head size its own).

**Generation cache**: per-head keys (RoPE applied) and values, as ``*`` attention keeps them (the
absorbed, latent-space cache of DeepSeek's inference is not built). Not built: LoRA adapters on
MLA's projections, DSA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.core.errors import ConfigError, LayoutError
from mimo.llm.attention import cached_attention, packed_attention
from mimo.llm.config import HybridArch, RopeScaling
from mimo.llm.context import SeqContext
from mimo.llm.norm import RMSNorm
from mimo.llm.rope import RopeConfig, inv_freq
from mimo.parallel.collectives import copy_to_group, gather_seq
from mimo.parallel.context import ParallelContext
from mimo.parallel.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from mimo.parallel.params import init_params_, param_table
from mimo.parallel.recompute import maybe

__all__ = ["MLAConfig", "MLA", "ReplicatedLinear", "yarn_get_mscale", "yarn_inv_freq", "mla_softmax_scale",
           "rope_interleaved", "build_mla"]

LATENT_NORM_EPS = 1e-6  # Hugging Face's DeepseekV3RMSNorm default, which its latent norms keep


@dataclass(frozen=True)
class MLAConfig:
    hidden: int
    heads: int
    q_lora_rank: int | None  # None: one full q projection (q_proj)
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5  # the pre-norm's
    latent_norm_eps: float = LATENT_NORM_EPS  # q_a_layernorm's and kv_a_layernorm's
    down_bias: bool = False  # biases of q_a_proj and kv_a_proj_with_mqa
    o_bias: bool = False  # added once, after the TP reduction (RowParallelLinear does so)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_arch(cls, arch: HybridArch) -> "MLAConfig":
        missing = [n for n in HybridArch.MLA_REQUIRED if getattr(arch, n) is None]
        if missing:
            raise ConfigError(f"arch.{missing[0]}: MLA layers ('+') need {', '.join(f'arch.{n}' for n in missing)}")
        if not arch.rope or arch.mrope_section is not None:
            raise ConfigError("arch.rope: MLA layers ('+') need plain 1-D RoPE (rope: true, no mrope_section)")
        return cls(
            hidden=arch.hidden, heads=arch.heads, q_lora_rank=arch.mla_q_lora_rank, kv_lora_rank=arch.mla_kv_lora_rank,
            qk_rope_head_dim=arch.mla_qk_rope_head_dim, qk_nope_head_dim=arch.mla_qk_nope_head_dim,
            v_head_dim=arch.mla_v_head_dim, rope_theta=arch.rope_theta, rope_scaling=arch.rope_scaling,
            norm_eps=arch.norm_eps, down_bias=bool(arch.qkv_bias), o_bias=bool(arch.o_bias),
        )


# ---------------------------------------------------------------- RoPE: YaRN and the interleaved layout
def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's ``mscale`` (its paper's Eq. 21): ``0.1 * mscale * ln(scale) + 1``, 1 for scale <= 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """``[dim / 2]`` fp32 YaRN inverse frequencies and the cos / sin scale (``attention_factor``),
    the operations of Hugging Face's ``_compute_yarn_parameters`` in its order."""
    factor = s.factor
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, s.mscale) / yarn_get_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1
    orig = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dim that turns ``rotations`` times over the original context
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (Hugging Face's guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention_factor


def mla_softmax_scale(cfg: MLAConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN scaling
    with ``mscale_all_dim`` (Hugging Face's ``yarn_apply_mscale``)."""
    scale = cfg.qk_head_dim ** (-0.5)
    s = cfg.rope_scaling
    if s is not None and s.type == "yarn" and s.mscale_all_dim:
        m = yarn_get_mscale(s.factor, s.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_interleaved(x_THR: torch.Tensor, cos_TP: torch.Tensor, sin_TP: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE: channels (2i, 2i+1) rotate by frequency i (``cos_TP``,
    ``sin_TP``: ``[T, R/2]``); out: the rotated first elements of the pairs, then the second ones
    (Hugging Face's ``apply_rotary_pos_emb_interleave``), in x's dtype."""
    cos, sin = cos_TP.to(x_THR.dtype)[:, None, :], sin_TP.to(x_THR.dtype)[:, None, :]
    x1, x2 = x_THR[..., 0::2], x_THR[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ---------------------------------------------------------------- the layer
class MLA(nn.Module):
    """``forward(h_TD, seq) -> h_TD``: ``h + o_proj(mla(norm(h)))`` (see module doc); ``[T/tp, D]``
    blocks under sequence parallelism."""

    selective = False  # recompute the attention core in backward (mimo.parallel.recompute)

    def __init__(self, cfg: MLAConfig, ctx: ParallelContext | None = None, impl: str = "auto"):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        tp = ctx.tp_size
        if cfg.heads % tp:
            raise LayoutError(f"MLA: tp={tp} must divide heads={cfg.heads}")
        if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim < 2:
            raise LayoutError(f"MLA: qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and >= 2")
        self.cfg, self.impl = cfg, impl
        self.heads_local = cfg.heads // tp
        sp = ctx.sequence_parallel
        # under SP each rank normalises its own tokens: the norm weight's gradient is partial
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, ctx, partial=sp)
        qk = cfg.qk_head_dim
        if cfg.q_lora_rank is not None:
            self.q_a_proj = ReplicatedLinear(cfg.hidden, cfg.q_lora_rank, cfg.down_bias, ctx)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps, ctx, partial=sp)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, cfg.heads * qk, bias=False, ctx=ctx)
            self.q_proj = None
        else:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = ColumnParallelLinear(cfg.hidden, cfg.heads * qk, bias=False, ctx=ctx)
        self.kv_a_proj_with_mqa = ReplicatedLinear(cfg.hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.down_bias, ctx)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps, ctx, partial=sp)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, cfg.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                              bias=False, ctx=ctx)
        self.o_proj = RowParallelLinear(cfg.heads * cfg.v_head_dim, cfg.hidden, bias=cfg.o_bias, ctx=ctx,
                                        input_is_parallel=True)
        self.softmax_scale = mla_softmax_scale(cfg)
        self._rope: dict[torch.device, tuple[torch.Tensor, float]] = {}  # not a buffer: .to(bf16) must not round it

    def init_weights(self, seed: int, std: float, out_std: float | None = None) -> None:
        """TP-invariant: each parameter from ``param_seed(seed, its name in this layer)``."""
        init_params_(param_table(self), seed, std, {"o_proj.weight": std if out_std is None else out_std})

    def rope_freq(self, device: torch.device) -> tuple[torch.Tensor, float]:
        """fp32 inverse frequencies of the rope channels (computed on CPU, as Hugging Face does;
        cached per device) and the cos / sin scale (YaRN's attention factor, else 1)."""
        if device not in self._rope:
            cfg, s = self.cfg, self.cfg.rope_scaling
            if s is not None and s.type == "yarn":
                freq, factor = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, s)
            else:
                freq, factor = inv_freq(RopeConfig(cfg.qk_rope_head_dim, cfg.rope_theta, s)), 1.0
            self._rope[device] = (freq.to(device), factor)
        return self._rope[device]

    def rope_tables(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, qk_rope_head_dim / 2]`` (fp32, times the attention factor)."""
        freq, factor = self.rope_freq(positions_T.device)
        freqs_TP = positions_T.float()[:, None] * freq[None, :]
        return freqs_TP.cos() * factor, freqs_TP.sin() * factor

    def forward(self, h_TD: torch.Tensor, seq: SeqContext) -> torch.Tensor:
        _, _, q_TF, kv_TF, kr_TR = self.projections(h_TD)
        o_TF = maybe(self.selective, lambda q, kv, kr: self._core(q, kv, kr, seq), q_TF, kv_TF, kr_TR)
        return h_TD + self.o_proj(o_TF)

    def projections(self, h_TD: torch.Tensor):
        """(normed input on this rank's rows, the query latent on them (None without q_lora_rank),
        this rank's heads' queries ``[T, heads_local * qk]`` and keys | values ``[T, heads_local *
        (nope + v)]``, the shared rotary key ``[T, qk_rope]``) on the full local sequence."""
        x_TD = self.norm(h_TD)  # this rank's rows: the whole pack, or its token block under SP
        if self.q_proj is None:  # down projection on this rank's rows; q_b_proj gathers the latent
            ql_TQ = self.q_a_layernorm(self.q_a_proj(x_TD))
            q_TF = self.q_b_proj(ql_TQ)
        else:
            ql_TQ, q_TF = None, self.q_proj(x_TD)
        c_TC, kr_TR = self.kv_a_proj_with_mqa(x_TD).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        kv_TF = self.kv_b_proj(self.kv_a_layernorm(c_TC))  # gathered to the full local sequence under SP
        # the shared rotary key: gathered under SP; its gradient from this rank's heads is partial, summed over
        # TP by the gather's reduce-scatter (copy_to_group's all-reduce without SP)
        group = self.o_proj.group
        kr_TR = gather_seq(kr_TR.contiguous(), group) if self.ctx.sequence_parallel else copy_to_group(kr_TR, group)
        return x_TD, ql_TQ, q_TF, kv_TF, kr_TR

    def heads(self, q_TF: torch.Tensor, kv_TF: torch.Tensor, kr_TR: torch.Tensor, seq: SeqContext, tables=None):
        """Per-head queries and keys ``[T, heads_local, qk]`` (RoPE on the rope channels) and
        values ``[T, heads_local, v]`` from the up projections' outputs and the shared rotary key;
        ``tables``: ``rope_tables(seq.positions)`` where the caller has them."""
        cfg, t, hl = self.cfg, q_TF.shape[0], self.heads_local
        nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qn_THN, qr_THR = q_TF.view(t, hl, nope + rope).split([nope, rope], dim=-1)
        kn_THN, v_THV = kv_TF.view(t, hl, nope + vd).split([nope, vd], dim=-1)
        cos_TP, sin_TP = self.rope_tables(seq.positions) if tables is None else tables
        qr_THR = rope_interleaved(qr_THR, cos_TP, sin_TP)
        kr_T1R = rope_interleaved(kr_TR[:, None, :], cos_TP, sin_TP)
        q_THE = torch.cat([qn_THN, qr_THR], dim=-1)
        k_THE = torch.cat([kn_THN, kr_T1R.expand(t, hl, rope)], dim=-1)
        return q_THE, k_THE, v_THV

    def _core(self, q_TF: torch.Tensor, kv_TF: torch.Tensor, kr_TR: torch.Tensor, seq: SeqContext) -> torch.Tensor:
        """From the up projections' outputs (this rank's heads) and the shared rotary key to the
        attention output ``[T, heads_local * v_head_dim]``."""
        q_THE, k_THE, v_THV = self.heads(q_TF, kv_TF, kr_TR, seq)
        return self._attend(q_THE, k_THE, v_THV, seq).reshape(q_TF.shape[0], -1)

    def _attend(self, q_THE, k_THE, v_THV, seq: SeqContext) -> torch.Tensor:
        """``packed_attention`` (causal within each sample), or under a generation cache
        ``cached_attention`` (the prefill keeps every sample's per-head keys, RoPE applied, and
        values; a decode step attends over them). Flash attention's varlen kernel (CUDA, bf16 /
        fp16) takes one head size for q, k and v: there the narrower side is padded with zero
        channels (which change no score and no output) and the output cut back."""
        e, vd = q_THE.shape[-1], v_THV.shape[-1]
        fast = self.impl != "exact" and q_THE.is_cuda and q_THE.dtype in (torch.bfloat16, torch.float16)
        if fast and vd < e:
            v_THV = F.pad(v_THV, (0, e - vd))
        elif fast and vd > e:
            q_THE, k_THE = F.pad(q_THE, (0, vd - e)), F.pad(k_THE, (0, vd - e))
        if seq.cache is None:
            o = packed_attention(q_THE, k_THE, v_THV, seq, scale=self.softmax_scale, impl=self.impl)
        else:
            o = cached_attention(seq.cache.state(self), q_THE, k_THE, v_THV, seq, self.softmax_scale, self.impl)
        return o[..., :vd]

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"heads={c.heads} (local {self.heads_local}), q_lora_rank={c.q_lora_rank}, kv_lora_rank={c.kv_lora_rank}, "
                f"qk_nope={c.qk_nope_head_dim}, qk_rope={c.qk_rope_head_dim}, v={c.v_head_dim}, "
                f"softmax_scale={self.softmax_scale:.6g}, sequence_parallel={self.ctx.sequence_parallel}")


def build_mla(arch: HybridArch, spec, ctx: ParallelContext | None = None) -> MLA:
    """Builder of the ``"mla"`` layer kind (``mimo.llm.blocks.PROVIDERS`` names it)."""
    return MLA(MLAConfig.from_arch(arch), ctx)
