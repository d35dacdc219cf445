"""Gated DeltaNet layer (``G``) over packed sequences, tensor-parallel over heads.

As flash-linear-attention's ``GatedDeltaNet`` / Qwen3-Next's ``linear_attn``:

    h -> RMSNorm -> q, k, v, z, b, a projections
         q, k, v -> short causal depthwise convs (reset per sample) -> SiLU
         q, k L2-normalised per head (q also scaled by 1/sqrt(head_dim))
         beta = sigmoid(b),  g = -exp(A_log) * softplus(a + dt_bias)          (per value head)
         o = gated delta rule(q, k, v, g, beta)                               (state reset per sample)
         o = RMSNorm_per_head(o) * weight * SiLU(z) -> out_proj -> + h

This is Qwen3-Next's and Qwen3.5's ``linear_attn`` exactly (``Qwen3NextGatedDeltaNet`` /
``Qwen3_5GatedDeltaNet`` with their pre-norm, per sample, in fp32 and fp64, at TP and CP:
tests/test_llm_qwen3_next_gdn_moe.py): their split or per-key-head grouped projections are rows
of ``in_proj_weight`` in another order, mapped by ``mimo.llm.hf``'s rules (``gdn_layer_from_hf``).

There may be more value heads than query/key heads (a multiple, like GQA): value head j
reads q/k head ``j // (v_heads / heads)``. TP splits q/k heads and value heads alike, so a
rank's value heads read only its own q/k heads. The output norm's weight ([v_head_dim]) is
shared by all heads, hence replicated over TP with a partial gradient (all-reduced). The six
projections are one stored weight and the three convolutions another (one GEMM, one conv).

``gated_delta_chunked`` is the chunked (WY) form with segment masks for sample boundaries
inside a chunk: within-chunk work is batched matrix algebra over all chunks and heads (one
triangular solve), and only the [K, V] state is carried across chunks, by a loop over chunks
of one batched matmul each (the state update is affine in the state).

``impl`` (``mimo.llm.ssm.IMPLS``): "auto" runs flash-linear-attention's chunked kernel (with
``cu_seqlens``) and causal-conv1d's conv on CUDA in bf16/fp16 when installed and working, else
the torch path; "chunked" is the torch path; "naive" the per-token oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mimo.core.errors import LayoutError
from mimo.llm.cache import pad_rows
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.recurrence import gated_delta_naive
from mimo.llm.ssm import PreNormResidual, find_kernel, init_constant, init_conv, init_dt_bias, init_uniform_log, segments, segsum, short_conv
from mimo.parallel import gemm
from mimo.parallel.collectives import copy_to_group, gather_seq
from mimo.parallel.context import ParallelContext
from mimo.parallel.layers import RowParallelLinear, TPModule, fused_adapters
from mimo.parallel.placement import ParamPlacement, replicated, sharded

__all__ = ["GDNConfig", "gated_delta_chunked", "gated_delta_step", "gated_delta_over_chunks", "l2norm", "GatedDeltaNetMixer", "GatedDeltaNet", "build_gdn"]


@dataclass(frozen=True)
class GDNConfig:
    hidden: int
    heads: int  # query / key heads
    v_heads: int  # value heads, a multiple of heads
    head_dim: int
    v_head_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-5
    chunk: int = 64

    @classmethod
    def from_arch(cls, arch: HybridArch) -> "GDNConfig":
        return cls(arch.hidden, arch.gdn_heads, arch.gdn_v_heads, arch.gdn_head_dim, arch.gdn_v_head_dim,
                   arch.conv_kernel, arch.norm_eps, arch.gdn_chunk)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's and Qwen3-Next's l2norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_chunked(
    q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor,
    seg_T: torch.Tensor, chunk: int, ends_N: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a packed sequence, by chunks of ``chunk`` tokens; with
    ``ends_N`` (token indices) also the state after each of those tokens, ``[N, H, K, V]``.

    Per head, with S [K, V] reset to zero at each change of ``seg_T``:
    ``S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t``.
    q, k already normalised (and q scaled), heads already matched (q, k, v all have H heads).

    Within a chunk, with Gamma[i, j] the decay from j to i when both are in one sample, the
    deltas d = beta (v - S_prev^T k) solve ``(I + tril(beta k k^T * Gamma, -1)) d = beta v -
    beta exp(gc) k S_in`` (S_in: the state entering the chunk, seen only by tokens that
    continue the previous chunk's last sample); then ``o = (q k^T * Gamma) d + exp(gc) q S_in``
    and the chunk's last sample leaves ``S_out = [no boundary] exp(gc_last) S_in +
    sum_j Gamma[last, j] k_j d_j^T``, an affine map of S_in: the loop over chunks carries the
    state with one batched matmul per chunk, and everything else is batched over all chunks.
    """
    t, n_heads, dk = q_THK.shape
    dv = v_THV.shape[-1]
    if t == 0:
        o_THV = v_THV.new_zeros(v_THV.shape)
        return o_THV if ends_N is None else (o_THV, v_THV.new_zeros(0, n_heads, dk, dv))
    pad = -t % chunk
    if pad:  # padding: its own segment (-1), k = v = 0, no decay: it changes nothing
        q_THK, k_THK, v_THV = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q_THK, k_THK, v_THV))
        g_TH, beta_TH = F.pad(g_TH, (0, 0, 0, pad)), F.pad(beta_TH, (0, 0, 0, pad))
        seg_T = F.pad(seg_T, (0, pad), value=-1)
    nc, q = (t + pad) // chunk, chunk
    # [c, h, l, .] layout: batched matmuls over (chunk, head)
    q_chlk, k_chlk = (x.reshape(nc, q, n_heads, dk).transpose(1, 2) for x in (q_THK, k_THK))
    v_chlv = v_THV.reshape(nc, q, n_heads, dv).transpose(1, 2)
    g_chl, beta_chl = (x.reshape(nc, q, n_heads).transpose(1, 2) for x in (g_TH, beta_TH))
    seg_cl = seg_T.reshape(nc, q)

    causal = torch.ones(q, q, dtype=torch.bool, device=seg_T.device).tril()
    same_cij = (seg_cl[:, :, None] == seg_cl[:, None, :]) & causal
    gamma_chij = torch.exp(segsum(g_chl).masked_fill(~same_cij[:, None], float("-inf")))
    seg_last_c = seg_cl[:, -1]
    seg_in_c = torch.cat([seg_last_c.new_full((1,), -2), seg_last_c[:-1]])
    cont_cl = seg_cl == seg_in_c[:, None]  # continues the previous chunk's last sample
    decay_in_chl = torch.exp(g_chl.cumsum(-1)) * cont_cl[:, None]

    kb_chlk = k_chlk * beta_chl.unsqueeze(-1)
    a_chij = (kb_chlk @ k_chlk.transpose(-1, -2) * gamma_chij).tril(-1)
    eye = torch.eye(q, dtype=a_chij.dtype, device=a_chij.device)
    rhs = torch.cat([v_chlv * beta_chl.unsqueeze(-1), kb_chlk * decay_in_chl.unsqueeze(-1)], dim=-1)
    uw = torch.linalg.solve_triangular(eye + a_chij, rhs, upper=False, unitriangular=True)
    u_chlv, w_chlk = uw.split([dv, dk], dim=-1)  # deltas = u - w S_in

    # the state is linear in itself across chunks: S_out = M S_in + b, with
    #   M = carry I - sum_j k_end_j w_j^T,   b = sum_j k_end_j u_j^T   (k_end: decay to the chunk end)
    k_end_chkl = (k_chlk * gamma_chij[..., -1, :].unsqueeze(-1)).transpose(-1, -2)
    carry_ch = torch.exp(g_chl.sum(-1)) * (seg_last_c == seg_in_c)[:, None]
    eye_k = torch.eye(dk, dtype=k_chlk.dtype, device=k_chlk.device)
    M_chkk = carry_ch[..., None, None] * eye_k - k_end_chkl @ w_chlk
    b_chkv = k_end_chkl @ u_chlv
    s_hkv = v_THV.new_zeros(n_heads, dk, dv)
    states_in = []
    # a loop over chunks (T/chunk steps, one batched matmul each), not tokens; unbind once,
    # as indexing [c] would cost a full-size zeros + add per chunk in backward
    for M_hkk, b_hkv in zip(M_chkk.unbind(0), b_chkv.unbind(0)):
        states_in.append(s_hkv)
        s_hkv = torch.baddbmm(b_hkv, M_hkk, s_hkv)
    s_in_chkv = torch.stack(states_in)

    d_chlv = u_chlv - w_chlk @ s_in_chkv  # the deltas
    attn_chij = q_chlk @ k_chlk.transpose(-1, -2) * gamma_chij
    o_chlv = (q_chlk * decay_in_chl.unsqueeze(-1)) @ s_in_chkv + attn_chij @ d_chlv
    o_THV = o_chlv.transpose(1, 2).reshape(nc * q, n_heads, dv)[:t]
    if ends_N is None:
        return o_THV
    # the state after token i (chunk c, row l) of its sample: what entered the chunk, decayed to
    # i if i continues that sample, plus the chunk's own deltas up to i (Gamma's row l)
    c_N, l_N = ends_N // q, ends_N % q
    own_NHKV = torch.einsum("nhj,nhjk,nhjv->nhkv", gamma_chij[c_N, :, l_N], k_chlk[c_N], d_chlv[c_N])
    return o_THV, decay_in_chl[c_N, :, l_N][..., None, None] * s_in_chkv[c_N] + own_NHKV


def gated_delta_step(S_NHKV: torch.Tensor, q_NHK: torch.Tensor, k_NHK: torch.Tensor, v_NHV: torch.Tensor,
                     g_NH: torch.Tensor, beta_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule per row (``gated_delta_naive``'s recurrence): (o
    ``[N, H, V]``, the state after it)."""
    S_NHKV = S_NHKV * torch.exp(g_NH)[..., None, None]
    delta_NHV = beta_NH[..., None] * (v_NHV - torch.einsum("nhkv,nhk->nhv", S_NHKV, k_NHK))
    S_NHKV = S_NHKV + k_NHK[..., None] * delta_NHV[:, :, None, :]
    return torch.einsum("nhkv,nhk->nhv", S_NHKV, q_NHK), S_NHKV


def gated_delta_over_chunks(rule, q_THK, k_THK, v_THV, g_TH, beta_TH, cp) -> torch.Tensor:
    """The gated delta rule over one CP rank's chunks (``mimo.llm.cp``), equal to the unsplit
    rule of each sample. ``rule(q, k, v, g, beta, seg_T, cu_seqlens)`` runs each segment from a
    zero state (any implementation).

    The state is affine in the state entering a chunk, ``S_out = M S_in + b``, and so is each
    output, ``o_t = o0_t + S_in^T r_t`` with ``r_t = (A_t ... A_1)^T q_t``. One run of the rule
    gives all of it: the values widened to ``[v | 0]`` and, before each chunk, ``K`` virtual rows
    (k = e_i, beta = 1, g = 0, value ``[0 | e_i]``) that set the state to ``[0 | I]``; the outputs
    are then ``[o0 | r]``, and ``K`` virtual rows after the chunk (q = e_i, beta = 0, g = 0) read
    out the rows of ``[b | M]``. ``CPChunks.states_in`` gives ``S_in`` (the exclusive scan of
    ``S <- M S + b``); its share is one grouped GEMM per head over the chunks."""
    t, n_heads, dk = q_THK.shape
    dv = v_THV.shape[-1]
    ext = cp.extend(dk, dk)
    eye_KHK = torch.eye(dk, dtype=q_THK.dtype, device=q_THK.device)[:, None, :].expand(dk, n_heads, dk)
    v_aug = torch.cat([v_THV, v_THV.new_zeros(t, n_heads, dk)], -1)
    inject = torch.cat([v_THV.new_zeros(dk, n_heads, dv), eye_KHK.to(v_THV.dtype)], -1)
    seg_X, _ = segments(ext.cu_seqlens, ext.length)
    o_X = rule(ext.place(q_THK, after=eye_KHK), ext.place(k_THK, before=eye_KHK), ext.place(v_aug, before=inject),
               ext.place(g_TH), ext.place(beta_TH, before=beta_TH.new_ones(dk, n_heads)), seg_X, ext.cu_seqlens)
    o0_THV, r_THK = o_X.index_select(0, ext.real).split([dv, dk], -1)
    end_LHKX = o_X.index_select(0, ext.after).view(cp.chunks, dk, n_heads, dv + dk).transpose(1, 2)
    b_LHKV, M_LHKK = end_LHKX.split([dv, dk], -1)
    S_in_LHKV = cp.states_in(lambda M, b, S: M @ S + b, M_LHKK, b_LHKV)
    r_THK = r_THK.to(S_in_LHKV.dtype)
    corr = [gemm.grouped_linear(r_THK[:, h].contiguous(), S_in_LHKV[:, h].transpose(-1, -2).contiguous(), cp.ends_L)
            for h in range(n_heads)]
    return o0_THV + torch.stack(corr, 1).to(o0_THV.dtype)


class GatedDeltaNetMixer(TPModule):
    """The Gated DeltaNet mixer on normed input, projections ... out_proj (no pre-norm, no residual).

    Parameters (full shapes; dq = heads * head_dim, dv = v_heads * v_head_dim):
    ``in_proj_weight`` [2dq + 2dv + 2v_heads, D], the q | k | v | z | b | a projections fused
    (each part split over TP by heads); ``conv_weight`` [2dq + dv, K], the q | k | v convs
    fused likewise (no bias, as fla / Qwen3-Next); ``dt_bias``, ``A_log`` [v_heads];
    ``norm_weight`` [v_head_dim] (replicated, a partial gradient); ``out_proj.weight`` [D, dv].
    """

    def __init__(self, cfg: GDNConfig, ctx: ParallelContext | None = None, impl: str = "auto"):
        super().__init__(ctx)
        tp = self.tp_size
        if cfg.heads % tp or cfg.v_heads % tp or cfg.v_heads % cfg.heads:
            raise LayoutError(f"Gated DeltaNet: tp={tp} must divide heads={cfg.heads} and v_heads={cfg.v_heads}, "
                              f"and heads must divide v_heads")
        self.cfg, self.impl = cfg, impl
        self.heads_local, self.v_heads_local = cfg.heads // tp, cfg.v_heads // tp
        dq, dv, k = cfg.heads * cfg.head_dim, cfg.v_heads * cfg.v_head_dim, cfg.conv_kernel
        in_parts = (dq, dq, dv, dv, cfg.v_heads, cfg.v_heads)
        self._placements = {
            "in_proj_weight": self.ctx.gtp_shard(sharded((sum(in_parts), cfg.hidden), 0, parts=in_parts)),
            "conv_weight": sharded((2 * dq + dv, k), 0, parts=(dq, dq, dv)),
            "dt_bias": sharded((cfg.v_heads,), 0),
            "A_log": sharded((cfg.v_heads,), 0),
            # one weight for every head, and the heads are split over TP: a partial gradient
            "norm_weight": replicated((cfg.v_head_dim,), partial=("tp",) if tp > 1 else ()),
        }
        for name, placement in self._placements.items():
            self.register_parameter(name, self._new_param(placement, None, None))
        self.out_proj = RowParallelLinear(dv, cfg.hidden, bias=False, ctx=self.ctx, input_is_parallel=True)
        self.in_parts = dict(zip("qkvzba", in_parts))

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def lora_rows(self) -> dict[str, dict[str, int]]:
        """The input projection's fused weight and its parts, for adapters (``mimo.parallel.lora``)."""
        return {"in_proj_weight": self.in_parts}

    def param_init(self, name: str):
        """Init rules for ``mimo.parallel.params`` (as fla); None: N(0, std) projections."""
        if name.startswith("conv_"):
            return init_conv(self.cfg.conv_kernel)
        return {"dt_bias": init_dt_bias(), "A_log": init_uniform_log(0.0, 16.0),
                "norm_weight": init_constant(1.0)}.get(name)

    def forward(self, x_TD: torch.Tensor, seq: SeqContext) -> torch.Tensor:
        cfg = self.cfg
        x_TD = gather_seq(x_TD, self.group) if self.sequence_parallel else copy_to_group(x_TD, self.group)
        t, hl, vhl = x_TD.shape[0], self.heads_local, self.v_heads_local
        dql, dvl = hl * cfg.head_dim, vhl * cfg.v_head_dim
        # this rank's q | k | v | z | b | a rows are adjacent in the fused weight, as are its q | k | v conv rows
        y_TC = gemm.linear(x_TD, self.in_proj_weight, None, self.recipe)
        if self.lora:  # (adapters per group of the q | k | v | z | b | a parts)
            y_TC = torch.cat(fused_adapters(self, x_TD, y_TC.split([dql, dql, dvl, dvl, vhl, vhl], dim=-1)), -1)
        qkv_TC, z_TC, b_TH, a_TH = y_TC.split([2 * dql + dvl, dvl, vhl, vhl], dim=-1)

        cache = seq.cache
        state = None if cache is None else cache.state(self)  # its generation cache entry (mimo.llm.cache)
        qkv_TC = short_conv(self.impl, qkv_TC, self.conv_weight, None, seq, state, "conv")
        q_TC, k_TC, v_TC = qkv_TC.split([dql, dql, dvl], dim=-1)

        cdt = torch.promote_types(x_TD.dtype, torch.float32)  # the recurrence and norms run in fp32 at least
        q_THK = l2norm(q_TC.reshape(t, hl, cfg.head_dim).to(cdt)) * cfg.head_dim ** -0.5
        k_THK = l2norm(k_TC.reshape(t, hl, cfg.head_dim).to(cdt))
        v_THV = v_TC.reshape(t, vhl, cfg.v_head_dim).to(cdt)
        beta_TH = torch.sigmoid(b_TH.to(cdt))
        g_TH = -torch.exp(self.A_log.to(cdt)) * F.softplus(a_TH.to(cdt) + self.dt_bias.to(cdt))
        if vhl != hl:  # value head j reads q/k head j // (v_heads / heads)
            q_THK, k_THK = (x.repeat_interleave(vhl // hl, dim=1) for x in (q_THK, k_THK))
        rule = lambda *a, **kw: self._rule(*a, x_TD, **kw)  # noqa: E731
        if cache is not None and cache.decoding:  # one token per row, from the state the row left
            n = cache.rows
            o_NHV, state["state"] = gated_delta_step(state["state"], q_THK[:n], k_THK[:n], v_THV[:n], g_TH[:n], beta_TH[:n])
            o_THV = pad_rows(o_NHV, t)
        elif seq.cp is None:
            seg_T = segments(seq.cu_seqlens, t)[0]
            if cache is None:
                o_THV = rule(q_THK, k_THK, v_THV, g_TH, beta_TH, seg_T, seq.cu_seqlens).to(cdt)
            else:  # the prefill: each sample's state after its last token too
                o_THV, S_NHKV = rule(q_THK, k_THK, v_THV, g_TH, beta_TH, seg_T, seq.cu_seqlens, ends_N=cache.ends_N)
                o_THV, state["state"] = o_THV.to(cdt), S_NHKV.to(cdt)
        else:
            o_THV = gated_delta_over_chunks(rule, q_THK, k_THK, v_THV, g_TH, beta_TH, seq.cp).to(cdt)

        # per-head RMSNorm, weight, then gate (fla / Qwen3-Next order: norm before gate)
        o_THV = o_THV * torch.rsqrt(o_THV.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
        o_THV = o_THV * self.norm_weight.to(cdt)  # shared by heads split over TP: a partial grad (its placement)
        o_THV = o_THV * F.silu(z_TC.to(cdt)).reshape(t, vhl, cfg.v_head_dim)
        return self.out_proj(o_THV.reshape(t, dvl).to(x_TD.dtype))

    def _rule(self, q_THK, k_THK, v_THV, g_TH, beta_TH, seg_T, cu_seqlens, x_TD, ends_N=None):
        """The outputs; with ``ends_N`` (token indices) also the state after each of them (a
        prefill's sample ends: one per leading segment of ``cu_seqlens``)."""
        if self.impl == "naive":
            o = gated_delta_naive(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens)
            if ends_N is None:
                return o
            return o, gated_delta_chunked(q_THK, k_THK, v_THV, g_TH, beta_TH, seg_T, self.cfg.chunk, ends_N)[1]
        fn = find_kernel("gated_delta", self.impl, x_TD)
        if fn is None and self.impl == "kernel":
            raise RuntimeError("Gated DeltaNet impl='kernel' needs the flash-linear-attention (fla) package (and CUDA)")
        if fn is not None:  # inputs in the layer's dtype, gates in fp32; q is already scaled
            dt = x_TD.dtype
            o, S_final = fn(q_THK.to(dt).unsqueeze(0), k_THK.to(dt).unsqueeze(0), v_THV.to(dt).unsqueeze(0),
                            g_TH.unsqueeze(0), beta_TH.to(dt).unsqueeze(0), scale=1.0, output_final_state=ends_N is not None,
                            cu_seqlens=cu_seqlens.to(device=q_THK.device, dtype=torch.long))
            # fla's final states: one [H, K, V] per segment, the samples' first
            return o.squeeze(0) if ends_N is None else (o.squeeze(0), S_final[: ends_N.numel()])
        return gated_delta_chunked(q_THK, k_THK, v_THV, g_TH, beta_TH, seg_T, self.cfg.chunk, ends_N)

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"heads={c.heads} (local {self.heads_local}), v_heads={c.v_heads} (local {self.v_heads_local}), "
                f"head_dim={c.head_dim}, v_head_dim={c.v_head_dim}, chunk={c.chunk}, "
                f"sequence_parallel={self.sequence_parallel}, impl={self.impl}")


class GatedDeltaNet(PreNormResidual):
    """``forward(h_TD, seq) -> h_TD``: ``h + mixer(norm(h))`` (``[T/tp, D]`` blocks under SP)."""

    def __init__(self, cfg: GDNConfig, ctx: ParallelContext | None = None, impl: str = "auto"):
        ctx = ParallelContext.for_tp() if ctx is None else ctx
        super().__init__(cfg.hidden, cfg.norm_eps, GatedDeltaNetMixer(cfg, ctx, impl), ctx)


def build_gdn(arch: HybridArch, spec, ctx: ParallelContext | None = None) -> GatedDeltaNet:
    """Builder of the ``"gdn"`` layer kind (``mimo.llm.blocks.PROVIDERS`` names it)."""
    return GatedDeltaNet(GDNConfig.from_arch(arch), ctx)

