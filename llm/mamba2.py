"""Mamba-2 layer (``M``) over packed sequences, tensor-parallel over heads.

    h -> RMSNorm -> in_proj -> [z | x | dt],  in_bc -> [B | C]     (Mamba-2's in_proj, in two weights)
         x, B C -> causal depthwise conv (reset per sample) -> SiLU
         y = SSD(x, softplus(dt + dt_bias), A = -exp(A_log), B, C) + D x      (state reset per sample)
         y = RMSNorm_grouped(y * SiLU(z)) -> out_proj -> + h

Tensor parallelism splits the heads (z, x, dt, A_log, D, dt_bias, norm and out_proj columns).
B and C belong to ``groups`` groups of heads: when tp divides the groups they are split with
their heads; otherwise every rank computes all groups (replicated weights whose gradient is a
partial sum over TP, all-reduced) and each head reads its own group's B and C. That choice
depends on tp while a parameter's name and full shape must not, so B | C always has weights
of its own (``in_bc_weight``, ``conv_bc_*``): two GEMMs and two convolutions over the same
input, no weight concatenated. The gated norm normalises over groups of d_inner/groups
channels as Mamba-2 does; when a group spans TP ranks its mean square is summed over the
group's ranks, so every TP size computes the one-process function.

The chunked SSD (``ssd_chunked``) handles sample boundaries inside a chunk with segment masks
(as mamba_ssm's ``seq_idx``): within a chunk a token only sees tokens of its own sample, and
the state carried between chunks stops at a boundary. No loop over tokens or chunks.

``impl`` (``mimo.llm.ssm.IMPLS``): "auto" runs mamba_ssm's SSD kernel and causal-conv1d's conv
(both with ``seq_idx``) on CUDA in bf16/fp16 when installed and working, else the torch path;
"chunked" is the torch path; "naive" the per-token oracle of ``mimo.llm.recurrence``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mimo.core.errors import ConfigError, LayoutError
from mimo.llm.cache import pad_rows
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.recurrence import ssd_naive
from mimo.llm.ssm import PreNormResidual, find_kernel, init_constant, init_conv, init_dt_bias, init_uniform_log, segments, segsum, short_conv
from mimo.parallel import gemm
from mimo.parallel.collectives import copy_to_group, gather_seq, reduce_from_group
from mimo.parallel.context import ParallelContext
from mimo.parallel.layers import RowParallelLinear, TPModule, fused_adapters
from mimo.parallel.placement import ParamPlacement, replicated, sharded

__all__ = ["Mamba2Config", "ssd_chunked", "ssd_over_chunks", "ssd_states", "ssd_step", "Mamba2Mixer", "Mamba2", "build_mamba2"]


@dataclass(frozen=True)
class Mamba2Config:
    hidden: int
    heads: int
    head_dim: int
    state: int
    groups: int = 1
    conv_kernel: int = 4
    norm_eps: float = 1e-5
    chunk: int = 128
    dt_min: float = 0.0  # floor of softplus(dt + dt_bias), as mamba_ssm's dt_limit[0]

    @classmethod
    def from_arch(cls, arch: HybridArch) -> "Mamba2Config":
        return cls(arch.hidden, arch.mamba_heads, arch.mamba_head_dim, arch.mamba_state, arch.mamba_groups,
                   arch.conv_kernel, arch.norm_eps, arch.mamba_chunk, arch.mamba_dt_min)


def ssd_chunked(
    x_THP: torch.Tensor, dt_TH: torch.Tensor, A_H: torch.Tensor, B_TGN: torch.Tensor, C_TGN: torch.Tensor,
    seg_T: torch.Tensor, chunk: int,
) -> torch.Tensor:
    """Mamba-2's SSM (without the D skip) over a packed sequence, by chunks of ``chunk`` tokens.

    ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t``, with h reset to zero at
    each change of ``seg_T``. Head h reads group ``h // (H/G)``. Shapes: x [T,H,P], dt [T,H]
    (after softplus), A [H], B and C [T,G,N], seg [T] (nondecreasing segment ids).
    """
    t, n_heads, p = x_THP.shape
    n_groups, n = B_TGN.shape[1:]
    e = n_heads // n_groups  # heads per group
    if t == 0:
        return x_THP.new_zeros(x_THP.shape)
    pad = -t % chunk
    if pad:  # padding is a segment of its own (id -1) with dt = 0, x = 0: it changes nothing
        x_THP, B_TGN, C_TGN = (F.pad(v, (0, 0, 0, 0, 0, pad)) for v in (x_THP, B_TGN, C_TGN))
        dt_TH = F.pad(dt_TH, (0, 0, 0, pad))
        seg_T = F.pad(seg_T, (0, pad), value=-1)
    nc, q = (t + pad) // chunk, chunk
    x_clgep = x_THP.reshape(nc, q, n_groups, e, p)
    dt_clge = dt_TH.reshape(nc, q, n_groups, e)
    B_clgn, C_clgn = B_TGN.reshape(nc, q, n_groups, n), C_TGN.reshape(nc, q, n_groups, n)
    seg_cl = seg_T.reshape(nc, q)
    xdt_clgep = x_clgep * dt_clge.unsqueeze(-1)
    a_cgel = (dt_clge * A_H.reshape(n_groups, e)).permute(0, 2, 3, 1)  # log-decay of each step

    # 1. within a chunk: L[i, j] = decay from j to i when i, j are in the same sample (j <= i)
    causal = torch.ones(q, q, dtype=torch.bool, device=seg_T.device).tril()
    same_cij = (seg_cl[:, :, None] == seg_cl[:, None, :]) & causal
    L_cgeij = torch.exp(segsum(a_cgel).masked_fill(~same_cij[:, None, None], float("-inf")))
    CB_cgij = torch.einsum("cign,cjgn->cgij", C_clgn, B_clgn)
    y_clgep = torch.einsum("cgeij,cjgep->cigep", L_cgeij * CB_cgij.unsqueeze(2), xdt_clgep)

    # 2. state each chunk leaves from its own tokens; only its last sample carries on.
    #    L's last row is exactly "decay to the chunk end, if in the last sample".
    to_end_cjge = L_cgeij[..., -1, :].permute(0, 3, 1, 2)
    S_cgepn = torch.einsum("cjgn,cjgep->cgepn", B_clgn, xdt_clgep * to_end_cjge.unsqueeze(-1))

    # 3. state at each chunk end: sum over earlier chunks whose last sample is still running
    seg_last_c = seg_cl[:, -1]
    a_gec = a_cgel.sum(-1).permute(1, 2, 0)
    same_zc = (seg_last_c[:, None] == seg_last_c[None, :]) & torch.ones(nc, nc, dtype=torch.bool, device=seg_T.device).tril()
    carry_gezc = torch.exp(segsum(a_gec).masked_fill(~same_zc, float("-inf")))
    S_end_zgepn = torch.einsum("gezc,cgepn->zgepn", carry_gezc, S_cgepn)

    # 4. tokens continuing the previous chunk's last sample read the state it left
    S_in_cgepn = torch.cat([torch.zeros_like(S_end_zgepn[:1]), S_end_zgepn[:-1]])
    seg_in_c = torch.cat([seg_last_c.new_full((1,), -2), seg_last_c[:-1]])
    cont_cl = seg_cl == seg_in_c[:, None]
    decay_in_clge = torch.exp(a_cgel.cumsum(-1)).permute(0, 3, 1, 2) * cont_cl[:, :, None, None]
    y_clgep = y_clgep + torch.einsum("clgn,cgepn->clgep", C_clgn, S_in_cgepn) * decay_in_clge.unsqueeze(-1)
    return y_clgep.reshape(nc * q, n_heads, p)[:t]


def ssd_states(x_THP: torch.Tensor, dt_TH: torch.Tensor, A_H: torch.Tensor, B_THS: torch.Tensor,
               spans: list[tuple[int, int]]) -> torch.Tensor:
    """``[N, H, P, S]``: the SSM state (``ssd_naive``'s h) after the last token of each sample
    ``spans[n] = (start, end)``, B per head. The decay is a scalar per head and token, so the state
    is a plain weighted sum, ``h = sum_j exp(sum_{s>j} dt_s A) dt_j x_j B_j^T``; the log-decays
    to the end are summed in fp64 (a reverse cumsum minus each term must not cancel)."""
    la_TH = (dt_TH * A_H).double()
    out = []
    for s, e in spans:  # once per sample in the prefill: one einsum each
        la_LH = la_TH[s:e]
        to_end_LH = torch.exp(la_LH.flip(0).cumsum(0).flip(0) - la_LH).to(x_THP.dtype) * dt_TH[s:e]
        out.append(torch.einsum("lhp,lhs->hps", x_THP[s:e] * to_end_LH[..., None], B_THS[s:e]))
    if not out:
        return x_THP.new_zeros(0, x_THP.shape[1], x_THP.shape[2], B_THS.shape[2])
    return torch.stack(out)


def ssd_step(h_NHPS: torch.Tensor, x_NHP: torch.Tensor, dt_NH: torch.Tensor, A_H: torch.Tensor, B_NHS: torch.Tensor,
             C_NHS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of Mamba-2's SSM per row (``ssd_naive``'s recurrence, B and C per head, no D
    skip): (y ``[N, H, P]``, the state after it)."""
    decay_NH = torch.exp(dt_NH * A_H)
    h_NHPS = decay_NH[..., None, None] * h_NHPS + (dt_NH[..., None] * x_NHP)[..., None] * B_NHS[:, :, None, :]
    return torch.einsum("nhps,nhs->nhp", h_NHPS, C_NHS), h_NHPS


def ssd_over_chunks(scan, x_THP, dt_TH, A_H, B_TGN, C_TGN, cp) -> torch.Tensor:
    """The SSM (as ``ssd_chunked``) over one CP rank's chunks (``mimo.llm.cp``), equal to the
    unsplit scan of each sample. ``scan(x, dt, A, B, C, seg_T, cu_seqlens)`` scans each segment
    from a zero state (any implementation: chunked, kernel, naive).

    Each chunk is scanned from zero with ``N`` virtual rows after it (dt = 0: no decay, no input;
    C = e_n) whose outputs are the columns of the state it leaves, ``b``; its transfer is the
    scalar decay ``exp(sum dt A)`` per head. ``CPChunks.states_in`` gives the true entering state
    ``S_in``, whose effect on token t is ``exp(sum_{s<=t} dt_s A) S_in C_t`` (cumulative log-decay
    within the chunk, in fp64), one grouped GEMM per B/C group over the chunks."""
    t, n_heads, p = x_THP.shape
    n_groups, n = B_TGN.shape[1:]
    e = n_heads // n_groups
    ext = cp.extend(0, n)
    eye_NGN = torch.eye(n, dtype=C_TGN.dtype, device=C_TGN.device)[:, None, :].expand(n, n_groups, n)
    seg_X, _ = segments(ext.cu_seqlens, ext.length)
    y_X = scan(ext.place(x_THP), ext.place(dt_TH), A_H, ext.place(B_TGN), ext.place(C_TGN, after=eye_NGN), seg_X,
               ext.cu_seqlens)
    y_THP = y_X.index_select(0, ext.real)
    b_LHPN = y_X.index_select(0, ext.after).view(cp.chunks, n, n_heads, p).permute(0, 2, 3, 1)
    # log-decays in fp64: a chunk's total (its transfer) and each token's running sum in it
    la_TH = (dt_TH * A_H).double()
    a_LH = la_TH.new_zeros(cp.chunks, n_heads).index_add(0, cp.chunk_T, la_TH)
    before_TH = la_TH.cumsum(0) - la_TH
    start_L = cp.ends_L - torch.tensor(cp.chunk_lens_L, dtype=torch.int64, device=cp.ends_L.device)
    acum_TH = before_TH + la_TH - before_TH.index_select(0, start_L).index_select(0, cp.chunk_T)
    S_in_LHPN = cp.states_in(lambda a, b, S: torch.exp(a).to(S.dtype)[..., None, None] * S + b, a_LH, b_LHPN)
    C_TGN = C_TGN.to(S_in_LHPN.dtype)
    corr = [gemm.grouped_linear(C_TGN[:, g].contiguous(), S_in_LHPN[:, g * e:(g + 1) * e].reshape(cp.chunks, e * p, n),
                                cp.ends_L).view(t, e, p) for g in range(n_groups)]
    return y_THP + torch.exp(acum_TH).to(y_THP.dtype)[..., None] * torch.cat(corr, 1)


class Mamba2Mixer(TPModule):
    """The Mamba-2 mixer on normed input, in_proj ... out_proj (no pre-norm, no residual).

    Parameters (full shapes; d = heads * head_dim, bc = groups * state): ``in_proj_weight``
    [2d + heads, D] (Mamba-2's in_proj rows z | x | dt, each part split over TP by heads) and
    ``in_bc_weight`` [2bc, D] (its rows B | C); ``conv_x_weight`` [d, K], ``conv_x_bias`` [d],
    ``conv_bc_weight`` [2bc, K], ``conv_bc_bias`` [2bc] (its conv1d over x | B | C);
    ``dt_bias``, ``A_log``, ``D`` [heads]; ``norm_weight`` [d]; ``out_proj.weight`` [D, d].
    The B | C parameters are split over TP (parts B, C) when tp divides the groups, else
    replicated with a partial gradient.
    """

    def __init__(self, cfg: Mamba2Config, ctx: ParallelContext | None = None, impl: str = "auto"):
        super().__init__(ctx)
        tp = self.tp_size
        if cfg.heads % tp or cfg.heads % cfg.groups:
            raise LayoutError(f"Mamba-2: heads={cfg.heads} must be divisible by tp={tp} and by groups={cfg.groups}")
        self.cfg, self.impl = cfg, impl
        d_inner, bc = cfg.heads * cfg.head_dim, cfg.groups * cfg.state
        self.heads_local = cfg.heads // tp
        self.d_local = self.heads_local * cfg.head_dim
        self.bc_sharded = cfg.groups % tp == 0  # B, C split with their heads; else replicated
        self.bc_local = (bc // tp) if self.bc_sharded else bc
        # global index of the group each local head belongs to (reads B, C of; norms with)
        first_head = self.tp_rank * self.heads_local
        head_group = (torch.arange(self.heads_local) + first_head) // (cfg.heads // cfg.groups)
        self.register_buffer("head_group", head_group, persistent=False)
        k = cfg.conv_kernel

        def bc_placement(shape) -> ParamPlacement:
            if self.bc_sharded:
                return sharded(shape, 0, parts=(bc, bc))
            return replicated(shape, partial=("tp",))  # each rank's heads read all of B, C: partial grads

        self._placements = {
            "in_proj_weight": self.ctx.gtp_shard(sharded((2 * d_inner + cfg.heads, cfg.hidden), 0, parts=(d_inner, d_inner, cfg.heads))),
            "in_bc_weight": self.ctx.gtp_shard(bc_placement((2 * bc, cfg.hidden))),
            "conv_x_weight": sharded((d_inner, k), 0),
            "conv_x_bias": sharded((d_inner,), 0),
            "conv_bc_weight": bc_placement((2 * bc, k)),
            "conv_bc_bias": bc_placement((2 * bc,)),
            "dt_bias": sharded((cfg.heads,), 0),
            "A_log": sharded((cfg.heads,), 0),
            "D": sharded((cfg.heads,), 0),
            "norm_weight": sharded((d_inner,), 0),
        }
        for name, placement in self._placements.items():
            self.register_parameter(name, self._new_param(placement, None, None))
        self.out_proj = RowParallelLinear(d_inner, cfg.hidden, bias=False, ctx=self.ctx, input_is_parallel=True)

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def lora_rows(self) -> dict[str, dict[str, int]]:
        """The input projection's rows (z | x | dt in one weight, B | C in the other), for
        adapters (``mimo.parallel.lora``): one adapter spans both, as Hugging Face's one in_proj."""
        cfg = self.cfg
        if not self.bc_sharded:
            raise ConfigError(f"lora: adapters on the Mamba-2 input projection (mamba_in) need its B | C rows split over "
                              f"tp, which needs tp ({self.tp_size}) to divide mamba_groups ({cfg.groups})")
        d, bc = cfg.heads * cfg.head_dim, cfg.groups * cfg.state
        return {"in_proj_weight": {"z": d, "x": d, "dt": cfg.heads}, "in_bc_weight": {"B": bc, "C": bc}}

    def param_init(self, name: str):
        """Init rules for ``mimo.parallel.params`` (as mamba_ssm); None: N(0, std) projections."""
        if name.startswith("conv_"):
            return init_conv(self.cfg.conv_kernel)
        return {"dt_bias": init_dt_bias(), "A_log": init_uniform_log(1.0, 16.0),
                "D": init_constant(1.0), "norm_weight": init_constant(1.0)}.get(name)

    def forward(self, x_TD: torch.Tensor, seq: SeqContext) -> torch.Tensor:
        cfg = self.cfg
        x_TD = gather_seq(x_TD, self.group) if self.sequence_parallel else copy_to_group(x_TD, self.group)
        t, dl, bcl, hl = x_TD.shape[0], self.d_local, self.bc_local, self.heads_local
        z_TC, x_TC, dt_TH = gemm.linear(x_TD, self.in_proj_weight, None, self.recipe).split([dl, dl, hl], dim=-1)
        # replicated B/C weights feed only this rank's heads: partial gradients (their placement)
        bc_TC = gemm.linear(x_TD, self.in_bc_weight, None, self.recipe)
        if self.lora:  # (one adapter on the z | x | dt | B | C rows of both weights)
            z_TC, x_TC, dt_TH, B_TC, C_TC = fused_adapters(self, x_TD, [z_TC, x_TC, dt_TH, *bc_TC.split([bcl, bcl], -1)])
            bc_TC = torch.cat([B_TC, C_TC], -1)

        cache = seq.cache
        state = None if cache is None else cache.state(self)  # its generation cache entry (mimo.llm.cache)
        x_TC = short_conv(self.impl, x_TC, self.conv_x_weight, self.conv_x_bias, seq, state, "conv_x")
        bc_TC = short_conv(self.impl, bc_TC, self.conv_bc_weight, self.conv_bc_bias, seq, state, "conv_bc")
        B_TC, C_TC = bc_TC.split([bcl, bcl], dim=-1)

        cdt = torch.promote_types(x_TD.dtype, torch.float32)  # the scan and norms run in fp32 at least
        x_THP = x_TC.reshape(t, hl, cfg.head_dim)
        B_TGN, C_TGN = (v.reshape(t, bcl // cfg.state, cfg.state) for v in (B_TC, C_TC))
        if not self.bc_sharded:  # each local head reads its own group's B, C
            B_TGN, C_TGN = B_TGN[:, self.head_group], C_TGN[:, self.head_group]
        dt_TH = F.softplus(dt_TH.to(cdt) + self.dt_bias.to(cdt))
        if cfg.dt_min > 0:  # Nemotron-H's time_step_limit[0] (mamba_ssm's dt_limit[0]): no gradient below it
            dt_TH = dt_TH.clamp_min(cfg.dt_min)
        A_H = -torch.exp(self.A_log.to(cdt))
        per_head = lambda v_TGS: v_TGS.repeat_interleave(hl // v_TGS.shape[1], dim=1).to(cdt)  # noqa: E731 (B, C of each head)
        if cache is not None and cache.decoding:  # one token per row, from the state the row left
            n = cache.rows
            y_NHP, state["ssm"] = ssd_step(state["ssm"], x_THP[:n].to(cdt), dt_TH[:n], A_H, per_head(B_TGN[:n]),
                                           per_head(C_TGN[:n]))
            y_THP = pad_rows(y_NHP, t)
        elif seq.cp is None:
            seg_T, _ = segments(seq.cu_seqlens, t)
            y_THP = self._scan(x_THP, dt_TH, A_H, B_TGN, C_TGN, seg_T, seq.cu_seqlens, cdt)
            if cache is not None:  # the prefill: each sample's state after its last token
                state["ssm"] = ssd_states(x_THP.to(cdt), dt_TH, A_H, per_head(B_TGN), cache.spans)
        else:
            y_THP = ssd_over_chunks(lambda *a: self._scan(*a, cdt), x_THP, dt_TH, A_H, B_TGN, C_TGN, seq.cp)
        y_THP = y_THP + x_THP.to(cdt) * self.D.to(cdt)[:, None]

        y_TC = self._gated_norm(y_THP, z_TC.to(cdt)).to(x_TD.dtype)
        return self.out_proj(y_TC)

    def _scan(self, x_THP, dt_TH, A_H, B_TGN, C_TGN, seg_T, cu_seqlens, cdt):
        if self.impl == "naive":
            return ssd_naive(x_THP.to(cdt), dt_TH, A_H, B_TGN.to(cdt), C_TGN.to(cdt), cu_seqlens)
        fn = find_kernel("ssd", self.impl, x_THP)
        if fn is None and self.impl == "kernel":
            raise RuntimeError("Mamba-2 impl='kernel' needs the mamba_ssm package (and CUDA)")
        if fn is not None:  # seq_idx: the kernel's own segment masks
            y = fn(x_THP.unsqueeze(0), dt_TH.unsqueeze(0), A_H, B_TGN.unsqueeze(0), C_TGN.unsqueeze(0),
                   chunk_size=self.cfg.chunk, seq_idx=seg_T.to(torch.int32).unsqueeze(0))
            return y.squeeze(0).to(cdt)
        return ssd_chunked(x_THP.to(cdt), dt_TH, A_H, B_TGN.to(cdt), C_TGN.to(cdt), seg_T, self.cfg.chunk)

    def _gated_norm(self, y_THP: torch.Tensor, z_TC: torch.Tensor) -> torch.Tensor:
        """RMSNorm(y * SiLU(z)) over groups of d/groups channels (mamba_ssm's norm_before_gate=False)."""
        t, hl, p = y_THP.shape
        y_THP = y_THP * F.silu(z_TC).reshape(t, hl, p)
        per_group = self.cfg.heads // self.cfg.groups  # heads in one norm group
        ss_TH = y_THP.pow(2).sum(-1)
        if self.bc_sharded:  # whole groups live on this rank
            ms_TG = ss_TH.reshape(t, hl // per_group, per_group).sum(-1) / (per_group * p)
            ms_TH = ms_TG.repeat_interleave(per_group, dim=1)
        else:  # a group spans TP ranks: sum its squares over the group (all-reduce forward and backward)
            ss_TG = ss_TH.new_zeros(t, self.cfg.groups).index_add(1, self.head_group, ss_TH)
            ss_TG = reduce_from_group(copy_to_group(ss_TG, self.group), self.group)
            ms_TH = ss_TG[:, self.head_group] / (per_group * p)
        y_THP = y_THP * torch.rsqrt(ms_TH + self.cfg.norm_eps).unsqueeze(-1)
        return y_THP.reshape(t, hl * p) * self.norm_weight.to(y_THP.dtype)

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"heads={c.heads} (local {self.heads_local}), head_dim={c.head_dim}, state={c.state}, "
                f"groups={c.groups} ({'sharded' if self.bc_sharded else 'replicated'}), chunk={c.chunk}, "
                f"sequence_parallel={self.sequence_parallel}, impl={self.impl}")


class Mamba2(PreNormResidual):
    """``forward(h_TD, seq) -> h_TD``: ``h + mixer(norm(h))`` (``[T/tp, D]`` blocks under SP)."""

    def __init__(self, cfg: Mamba2Config, ctx: ParallelContext | None = None, impl: str = "auto"):
        ctx = ParallelContext.for_tp() if ctx is None else ctx
        super().__init__(cfg.hidden, cfg.norm_eps, Mamba2Mixer(cfg, ctx, impl), ctx)


def build_mamba2(arch: HybridArch, spec, ctx: ParallelContext | None = None) -> Mamba2:
    """Builder of the ``"mamba"`` layer kind (``mimo.llm.blocks.PROVIDERS`` names it)."""
    return Mamba2(Mamba2Config.from_arch(arch), ctx)

