"""The MoE layer (pattern symbol ``E``): pre-norm, router, routed experts, shared expert, residual.

    h + reduce_TP( latent_out(experts(latent_in(x), route(x))) + shared(x) ),  x = norm(h)

At expert parallel size 1 every rank holds every expert, its F-slice over TP (ETP = TP).
Routing happens on the whole local pack on every TP rank alike: without sequence
parallelism the normalised tokens are replicated (``copy_to_group``: their gradient is summed
over TP); with it each rank computes the router logits of its own ``[T/tp]`` tokens, and the
logits and tokens are gathered over TP (``gather_seq``: gradients reduce-scattered back). The
routed and shared experts' partial outputs are summed once: an all-reduce, or under sequence
parallelism a reduce-scatter back to this rank's tokens. Weights applied to partial sums or to
replicated inputs whose gradient is partial (router, shared-expert gate, latent projections)
are replicated with ``partial=("tp",)`` placements (docs/design.md §2).

Parameter names (canonical, inside ``layers.<i>.``): ``norm.weight``, ``router.weight``,
``experts.up_proj`` / ``experts.down_proj`` (``mimo.llm.experts``), ``shared.up_proj`` /
``shared.down_proj`` / ``shared.gate``, ``latent_in.weight`` / ``latent_out.weight``; buffers
``router.expert_bias`` / ``router.qb_beta`` (``mimo.llm.router``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.llm.config import HybridArch, MoEArch
from mimo.llm.context import SeqContext
from mimo.llm.dispatch import make_dispatcher
from mimo.llm.experts import GroupedExperts, SharedExpert
from mimo.llm.norm import RMSNorm
from mimo.llm.router import Router, Routing, attach_loss
from mimo.parallel import gemm
from mimo.parallel.collectives import copy_to_group, gather_seq, reduce_from_group, reduce_scatter_seq
from mimo.parallel.context import ParallelContext
from mimo.parallel.params import init_params_, param_table
from mimo.parallel.placement import ParamPlacement, replicated


class Projection(nn.Module):
    """A replicated ``[out, in]`` projection (Nemotron's latent projections) whose gradient is a
    partial sum over TP (it sees replicated inputs with partial gradients, or partial inputs)."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def placements(self) -> dict[str, ParamPlacement]:
        return {"weight": replicated(tuple(self.weight.shape), partial=("tp",) if self.ctx.tp_size > 1 else ())}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(x, self.weight)


class MoE(nn.Module):
    """``forward(h_TD, seq) -> h_TD`` (see module doc)."""

    def __init__(self, hidden: int, cfg: MoEArch, norm_eps: float = 1e-5, ctx: ParallelContext | None = None):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        self.cfg, self.hidden = cfg, hidden
        # under SP each rank normalises its own tokens: the norm weight's gradient is partial
        self.norm = RMSNorm(hidden, norm_eps, ctx, partial=ctx.sequence_parallel)
        self.router = Router(hidden, cfg, ctx)
        dim = cfg.latent or hidden
        if cfg.latent:
            self.latent_in = Projection(hidden, cfg.latent, ctx)
            self.latent_out = Projection(cfg.latent, hidden, ctx)
        self.experts = GroupedExperts(cfg.experts, dim, cfg.ffn, cfg.act, ctx)
        if cfg.shared_ffn:
            self.shared = SharedExpert(hidden, cfg.shared_ffn, cfg.act, cfg.shared_gate, ctx)

    def init_weights(self, seed: int, std: float, out_std: float | None = None) -> None:
        """TP-invariant: each parameter from ``param_seed(seed, its name in this layer)``; the
        balancing buffers start at zero."""
        out_std = std if out_std is None else out_std
        init_params_(param_table(self), seed, std, {n: out_std for n in ("experts.down_proj", "shared.down_proj",
                                                                          "latent_out.weight")})
        for name in ("expert_bias", "qb_beta"):
            if hasattr(self.router, name):
                getattr(self.router, name).zero_()

    def forward(self, h_TD: torch.Tensor, seq: SeqContext) -> torch.Tensor:
        tp, sp = self.ctx.tp, self.ctx.sequence_parallel
        x_TD = self.norm(h_TD)
        x_mine = x_TD  # under SP: this rank's rows of the pack
        if sp:  # the router GEMM on this rank's tokens; route the whole pack
            logits_TE = gather_seq(self.router.logits(x_TD), tp)
            if self.cfg.shared_ffn or not self.experts.folded:
                x_TD = gather_seq(x_TD, tp)
        else:
            x_TD = copy_to_group(x_TD, tp)
            logits_TE = self.router.logits(x_TD)
        valid_T = seq.real_mask()
        routing = self.router.route(logits_TE, valid_T, seq.num_real, seq.cp)
        shared = (lambda: self.shared(x_TD)) if self.cfg.shared_ffn else (lambda: None)
        if self.experts.folded:
            y_TD = self._routed_on_expert_view(x_mine if sp else x_TD, routing, shared)
        else:
            routed_TD, s_TD = self.experts.run(self.latent_in(x_TD) if self.cfg.latent else x_TD, routing, shared)
            y_TD = self.latent_out(routed_TD) if self.cfg.latent else routed_TD
            y_TD = y_TD if s_TD is None else y_TD + s_TD
            y_TD = reduce_scatter_seq(y_TD, tp) if sp else reduce_from_group(y_TD, tp)
        if self.training and seq.loss_norm is not None and self.router.has_aux_loss:
            aux = self.router.aux_loss(logits_TE, routing, valid_T, seq.sample_ids(), seq.num_samples,
                                       seq.loss_norm, self.ctx.grad_group, None if seq.cp is None else seq.cp.group)
            if aux is not None:
                y_TD = attach_loss(y_TD, aux)
        return h_TD + y_TD.to(h_TD.dtype)

    def _routed_on_expert_view(self, x_TD: torch.Tensor, routing: Routing, shared) -> torch.Tensor:
        """Experts on the expert view: every TP rank holds the routing of the whole pack but
        dispatches only its own slice of the tokens (its SP rows; without SP the same split of
        the replicated pack), so an EP group sees each token once. Its combined output is
        complete for those rows; the shared expert's is a partial sum over TP of the pack.
        ``x_TD``: this rank's rows under SP, else the whole (replicated) pack."""
        tp, sp, tp_size = self.ctx.tp, self.ctx.sequence_parallel, self.ctx.tp_size
        t, rank = routing.idx_TK.shape[0], self.ctx.tp_rank
        q, extra = divmod(t, tp_size)  # torch.tensor_split's parts: the first t % tp one row longer
        lo = rank * q + min(rank, extra)
        rows = slice(lo, lo + q + (rank < extra))
        mine = Routing(routing.idx_TK[rows], routing.gate_TK[rows])
        x_RD = x_TD if sp else x_TD[rows]
        y_RD, s_TD = self.experts.run(self.latent_in(x_RD) if self.cfg.latent else x_RD, mine, shared)
        if self.cfg.latent:
            y_RD = self.latent_out(y_RD)
        if sp:  # the shared expert's partial sums reduce-scattered to this rank's rows
            return y_RD if s_TD is None else reduce_scatter_seq(s_TD, tp) + y_RD
        y_TD = F.pad(y_RD, (0, 0, rows.start, t - rows.stop))  # other TP ranks' rows: theirs
        return reduce_from_group(y_TD if s_TD is None else y_TD + s_TD, tp)

    def active_params(self) -> int:
        """Parameters one token uses (router, its topk experts, shared expert, projections), for
        FLOP counts and the pipeline split."""
        return self.cfg.active_params(self.hidden)


def build_moe(arch: HybridArch, spec, ctx: ParallelContext | None = None) -> MoE:
    return MoE(arch.hidden, arch.moe, arch.norm_eps, ctx)


def set_dispatchers(model: nn.Module, kind: str) -> None:
    """Give every MoE layer of ``model`` the ``train.moe_dispatcher`` of ``kind`` (the local
    permutation where its experts are not folded, whatever the kind)."""
    for mod in model.modules():
        if isinstance(mod, GroupedExperts):
            mod.dispatcher = make_dispatcher(kind, mod.experts, mod.ctx)


def dispatchers(model: nn.Module) -> list:
    """The dispatchers of ``model``'s MoE layers, in layer order."""
    return [mod.dispatcher for mod in model.modules() if isinstance(mod, GroupedExperts)]
