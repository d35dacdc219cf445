"""MoE experts: routed experts as grouped GEMMs, the shared expert, and the permutation.

**Routed experts** (``GroupedExperts``) store all experts' weights in two tensors, each
expert's as ``nn.Linear`` would (``[out, in]``):

    up_proj    [E, 2F, I]  gated (SwiGLU: gate rows, then up rows);  [E, F, I] non-gated
    down_proj  [E, I, F]

(``I``: the hidden size, or the latent size with Nemotron's latent projections). ``F`` is
split over TP (each rank holds its F-slice of every expert, of gate and up separately), so a
rank's expert output is a partial sum over TP, reduced once by the MoE layer together with
the shared expert's. Under parallel folding (the context has an expert view: ep > 1 or
etp != tp) the experts live on that view instead: ``E`` splits over ``ep`` into contiguous
blocks of ``E / ep`` experts (rank ``ep = j`` holds experts ``j·E/ep ..``), ``F`` over
``etp``; their gradients are summed over ``edp`` (the view's gradient group) and each shard is
written and counted in the norm by its ``edp = 0`` rank. Initialisation stays per expert and
layout-independent (``mimo.parallel.init`` draws the tiles of the local experts only).

Tokens reach their experts through the layer's dispatcher (``mimo.llm.dispatch``: the local
permutation on the dense view — a stable sort by expert, dropless, no host read — or the
all-to-all over EP / ETP on the expert view); ``compute`` is the expert GEMM seam: one
``mimo.parallel.gemm.grouped_linear`` per projection over rows grouped by local expert.

**Shared expert** (``SharedExpert``): a dense MLP of inner size ``shared_ffn`` on every token
(F split over TP, output a partial sum), optionally scaled by ``sigmoid(x @ gate)`` per token
(Qwen2-MoE's ``shared_expert_gate``).

``experts_loop`` is the per-expert reference (the test oracle): token by token through each
expert's own weights, as Hugging Face's eager MoE does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from mimo.llm.dispatch import make_dispatcher
from mimo.llm.mlp import activate, activate_maybe_recomputed
from mimo.llm.router import Routing
from mimo.parallel import gemm, swiglu
from mimo.parallel.context import ParallelContext
from mimo.parallel.layers import fused_adapters
from mimo.parallel.placement import ParamPlacement, replicated, sharded, sharded_dims
from mimo.parallel.recompute import maybe


def _up_placement(shape: tuple[int, ...], ffn: int, gated: bool, dim: int) -> ParamPlacement:
    return sharded(shape, dim, parts=(ffn, ffn) if gated else ())


def expert_placements(experts: int, dim: int, ffn: int, gated: bool, folded: bool, egtp: int = 1) -> dict[str, ParamPlacement]:
    """The two weights' placements: F over tp (EP = 1, ETP = TP: the dense view), or, on the
    expert view (parallel folding), E over ep (contiguous blocks of ``E / ep`` experts) and F
    over etp (gate and up each split); with ``egtp`` each expert's output rows split further
    over egtp inside ETP (GTP for experts: ``mimo.parallel.gtp``)."""
    width = 2 * ffn if gated else ffn
    if not folded:
        return {"up_proj": _up_placement((experts, width, dim), ffn, gated, 1),
                "down_proj": sharded((experts, dim, ffn), 2)}
    split = (("egtp", 1),) if egtp > 1 else ()
    return {"up_proj": sharded_dims((experts, width, dim), (("ep", 0), ("etp", 1), *split), parts=(ffn, ffn) if gated else (),
                                    parts_dim=1),
            "down_proj": sharded_dims((experts, dim, ffn), (("ep", 0), ("etp", 2), *split))}


class GroupedExperts(nn.Module):
    """``E`` experts of inner size ``ffn`` on inputs of size ``dim`` (see module doc)."""

    def __init__(self, experts: int, dim: int, ffn: int, act: str, ctx: ParallelContext | None = None):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        self.experts, self.dim, self.ffn, self.act = experts, dim, ffn, act
        self.gated = act == "swiglu"
        # a context with the expert view lays the experts out on it (see module doc)
        self.folded = ctx.expert is not None
        self._placements = expert_placements(experts, dim, ffn, self.gated, self.folded, ctx.egtp_size)
        view = ctx.view(self._placements["down_proj"].axes)
        for name, pl in self._placements.items():
            setattr(self, name, nn.Parameter(torch.empty(pl.local_shape({a: view.size(a) for a in pl.axes}))))
            ctx.gtp_register(getattr(self, name), pl)  # split over egtp: gathered when used
        ep = view.size("ep") if self.folded else 1
        self.local_experts = experts // ep  # this rank's experts: first_expert .. first_expert + local_experts - 1
        self.first_expert = (view.coord("ep") if self.folded else 0) * self.local_experts
        self.recipe = gemm.default_recipe()
        self.dispatcher = make_dispatcher("auto", experts, ctx)  # train.moe_dispatcher may replace it
        self.lora = None  # per-expert adapters (mimo.parallel.lora.attach)

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def lora_experts(self) -> dict:
        """Sizes and layout for per-expert adapters (``mimo.parallel.lora.ExpertLoraAdapter``)."""
        return {"experts": self.experts, "dim": self.dim, "ffn": self.ffn, "gated": self.gated, "folded": self.folded}

    def forward(self, x_TI: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``sum_k gate_tk * expert_{idx_tk}(x_t)`` for the tokens given, ``[T, I]``: this rank's
        partial sum over TP on the dense view; complete on the expert view (see ``run``)."""
        return self.run(x_TI, routing)[0]

    selective = False  # recompute the permutation and the activation in backward (mimo.parallel.recompute)

    def run(self, x_TI: torch.Tensor, routing: Routing, while_in_flight=None) -> tuple[torch.Tensor, object]:
        """The routed experts' output through this layer's dispatcher, and what
        ``while_in_flight()`` returned: it runs while the tokens are in flight to the experts'
        ranks (the shared expert's GEMMs). On the expert view each rank passes tokens no other
        rank of its EP group passes (the MoE layer: its TP slice of the pack)."""
        d = self.dispatcher.dispatch(x_TI, routing, while_in_flight, align=gemm.grouped_row_align(self.recipe))
        with regathered(d.x_RD, d.gathered_from if self.selective else None):
            y_RI = self.compute(d.x_RD, d.ends_L, d.gate_R, d.aligned)
        return self.dispatcher.combine(y_RI, d, gated=True), d.overlapped

    def compute(self, x_RI: torch.Tensor, ends_L: torch.Tensor, gate_R: torch.Tensor | None = None,
                aligned: bool = False) -> torch.Tensor:
        """The local experts on rows grouped by expert (``ends_L``: cumulative row ends): the
        expert GEMM seam (one grouped GEMM per projection). ``gate_R``: each row's gate, applied
        to the activation (the down projection is linear; fused with the activation, and the
        combine then keeps nothing for backward), as Megatron-Core's grouped MLP does.
        ``aligned``: the groups start where the recipe wants them (``gemm.grouped_row_align``)."""
        h_RF = gemm.grouped_linear(x_RI, self.up_proj, ends_L, self.recipe, aligned)
        if self.lora is not None:  # per-expert adapters (lora target experts)
            h_RF = self.lora["up"](x_RI, h_RF, ends_L)
        parts = h_RF.chunk(2, dim=-1) if self.gated else (h_RF,)
        if gate_R is None:
            a_RF = activate_maybe_recomputed(self.selective, parts, self.act)
        elif self.act == "swiglu" and swiglu.takes(h_RF):  # its backward in one pass
            a_RF = maybe(self.selective, swiglu.weighted_swiglu, h_RF, gate_R)
        else:
            a_RF = maybe(self.selective, lambda g_R, *p: activate(p, self.act) * g_R[:, None].to(p[0].dtype), gate_R, *parts)
        y_RI = gemm.grouped_linear(a_RF, self.down_proj, ends_L, self.recipe, aligned)
        return y_RI if self.lora is None else self.lora["down"](a_RF, y_RI, ends_L)

    def extra_repr(self) -> str:
        where = (f"local={self.first_expert}:{self.first_expert + self.local_experts}, etp={self.ctx.expert.size('etp')}"
                 if self.folded else f"tp={self.ctx.tp_size}")
        return f"experts={self.experts}, dim={self.dim}, ffn={self.ffn}, act={self.act}, {where}"


def regathered(x_RD: torch.Tensor, gathered_from: tuple | None):
    """Selective recompute of the MoE permutation: while it is active, ``x_RD`` (the permuted
    rows, ``source[index]``, the rows outside an optional ``keep`` zero) is not kept for
    backward by what consumes it; ``source`` and ``index`` are, and the rows are gathered again
    when backward needs them. ``None``: nothing changes."""
    if gathered_from is None:
        return contextlib.nullcontext()
    source, index, *keep = gathered_from
    keep = keep[0] if keep else None
    ptr = x_RD.untyped_storage().data_ptr()

    def pack(t):
        if t.numel() and t.untyped_storage().data_ptr() == ptr:  # x_RD or a view of it
            return (_Regather, source, index, keep, t.size(), t.stride(), t.storage_offset() - x_RD.storage_offset())
        return t

    def unpack(packed):
        if isinstance(packed, tuple) and packed[0] is _Regather:
            _, src, idx, kept, size, stride, offset = packed
            rows = src.detach().index_select(0, idx)
            if kept is not None:
                rows = torch.where(kept.view(-1, 1), rows, 0)
            return rows.as_strided(size, stride, offset)
        return packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class _Regather:
    """Marks a saved tensor replaced by its gather (``regathered``)."""


class SharedExpert(nn.Module):
    """A dense MLP on every token, inner size split over TP; output a partial sum over TP."""

    selective = False  # recompute the activation in backward (mimo.parallel.recompute)

    def __init__(self, dim: int, ffn: int, act: str, gate: bool, ctx: ParallelContext | None = None):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        self.ffn, self.act, self.gated = ffn, act, act == "swiglu"
        width = 2 * ffn if self.gated else ffn
        partial = ("tp",) if ctx.tp_size > 1 else ()
        self._placements = {"up_proj": ctx.gtp_shard(_up_placement((width, dim), ffn, self.gated, 0)),
                            "down_proj": ctx.gtp_shard(sharded((dim, ffn), 1))}
        if gate:  # applied to partial outputs: its gradient is a partial sum over TP
            self._placements["gate"] = replicated((1, dim), partial=partial)
        for name, pl in self._placements.items():
            view = ctx.view(pl.axes)
            setattr(self, name, nn.Parameter(torch.empty(pl.local_shape({a: view.size(a) for a in pl.axes}))))
            ctx.gtp_register(getattr(self, name), pl)
        self.has_gate = gate
        self.recipe = gemm.default_recipe()
        self.lora = None  # low-rank adapters (mimo.parallel.lora): gate, up (rows of up_proj), down

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def lora_rows(self) -> dict[str, dict[str, int]]:
        """The up projection's parts (gate | up rows), for adapters (``mimo.parallel.lora``)."""
        return {"up_proj": {"gate": self.ffn, "up": self.ffn} if self.gated else {"up": self.ffn}}

    def lora_cols(self) -> dict[str, str]:
        """The down projection: split by input columns, its output a partial sum."""
        return {"down": "down_proj"}

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h_TF = gemm.linear(x_TD, self.up_proj, None, self.recipe)
        if self.lora:
            h_TF = torch.cat(fused_adapters(self, x_TD, h_TF.chunk(2, dim=-1) if self.gated else [h_TF]), -1)
        a_TF = activate_maybe_recomputed(self.selective, h_TF.chunk(2, dim=-1) if self.gated else (h_TF,), self.act)
        y_TD = gemm.linear(a_TF, self.down_proj, None, self.recipe)
        if self.lora and "down" in self.lora:  # linear in the partial sums, as RowParallelLinear's
            y_TD = self.lora["down"](a_TF, y_TD, self.down_proj)
        if self.has_gate:
            y_TD = y_TD * torch.sigmoid(gemm.linear(x_TD, self.gate, None, self.recipe))
        return y_TD


def experts_loop(x_TI: torch.Tensor, routing: Routing, up_EFI: torch.Tensor, down_EIF: torch.Tensor,
                 act: str) -> torch.Tensor:
    """Reference of ``GroupedExperts`` (full weights, one process): each expert on its tokens,
    gated and summed back, as Hugging Face's eager MoE computes it."""
    out_TI = torch.zeros_like(x_TI)
    e = up_EFI.shape[0]
    for expert in range(e):
        token_N, slot_N = torch.where(routing.idx_TK == expert)
        if token_N.numel() == 0:
            continue
        h = x_TI[token_N] @ up_EFI[expert].T
        a = activate(h.chunk(2, dim=-1) if act == "swiglu" else (h,), act)
        y = (a @ down_EIF[expert].T) * routing.gate_TK[token_N, slot_N, None].to(x_TI.dtype)
        out_TI = out_TI.index_add(0, token_N, y)
    return out_TI
