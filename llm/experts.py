"""MoE experts: routed experts as grouped GEMMs, the shared expert, and the permutation.

**Routed experts** (``GroupedExperts``) store all experts' weights in two tensors, each
expert's as ``nn.Linear`` would (``[out, in]``):

    up_proj    [E, 2F, I]  gated (SwiGLU: gate rows, then up rows);  [E, F, I] non-gated
    down_proj  [E, I, F]

(``I``: the hidden size, or the latent size with Nemotron's latent projections). ``F`` is
split over TP (each rank holds its F-slice of every expert, of gate and up separately), so a
rank's expert output is a partial sum over TP, reduced once by the MoE layer together with
the shared expert's.

Permutation (dropless, no host synchronisation at EP = 1): the ``T*K`` (token, slot)
assignments are sorted by expert with a stable argsort (so rows of one expert keep token
order), gathered, and multiplied by one ``mimo.parallel.gemm.grouped_linear`` per projection
over the per-expert row counts; the gated rows are summed back per token with ``index_add``.
Padding carries the sentinel expert ``E``: its rows sort last and ride along in the last
group with gate 0, so the offsets never need a host read and nothing of the padding reaches
a token.

**Shared expert** (``SharedExpert``): a dense MLP of inner size ``shared_ffn`` on every token
(F split over TP, output a partial sum), optionally scaled by ``sigmoid(x @ gate)`` per token
(Qwen2-MoE's ``shared_expert_gate``).

``experts_loop`` is the per-expert reference (the test oracle): token by token through each
expert's own weights, as Hugging Face's eager MoE does.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mimo.llm.mlp import activate
from mimo.llm.router import Routing
from mimo.parallel import gemm
from mimo.parallel.context import ParallelContext
from mimo.parallel.placement import ParamPlacement, replicated, sharded


def _up_placement(shape: tuple[int, ...], ffn: int, gated: bool, dim: int) -> ParamPlacement:
    return sharded(shape, dim, parts=(ffn, ffn) if gated else ())


class GroupedExperts(nn.Module):
    """``E`` experts of inner size ``ffn`` on inputs of size ``dim`` (see module doc)."""

    def __init__(self, experts: int, dim: int, ffn: int, act: str, ctx: ParallelContext | None = None):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        self.experts, self.dim, self.ffn, self.act = experts, dim, ffn, act
        self.gated = act == "swiglu"
        width = 2 * ffn if self.gated else ffn
        self._placements = {
            "up_proj": _up_placement((experts, width, dim), ffn, self.gated, 1),
            "down_proj": sharded((experts, dim, ffn), 2),
        }
        sizes = {"tp": ctx.tp_size}
        for name, pl in self._placements.items():
            setattr(self, name, nn.Parameter(torch.empty(pl.local_shape(sizes))))
        self.recipe = gemm.DEFAULT_RECIPE

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def forward(self, x_TI: torch.Tensor, routing: Routing) -> torch.Tensor:
        """This rank's partial (over TP) ``sum_k gate_tk * expert_{idx_tk}(x_t)``, ``[T, I]``."""
        idx_TK, gate_TK = routing.idx_TK, routing.gate_TK
        k, e = idx_TK.shape[1], self.experts
        flat_R = idx_TK.reshape(-1)
        order_R = torch.argsort(flat_R, stable=True)
        counts = torch.zeros(e + 1, dtype=torch.int64, device=flat_R.device)
        counts.scatter_add_(0, flat_R, torch.ones_like(flat_R))
        ends_E = counts.cumsum(0)[:e].clone()
        ends_E[-1] = flat_R.numel()  # the padding rows (sentinel E) ride along in the last group
        token_R = order_R // k
        x_RI = x_TI[token_R]
        h_RF = gemm.grouped_linear(x_RI, self.up_proj, ends_E, self.recipe)
        a_RF = activate(h_RF.chunk(2, dim=-1) if self.gated else (h_RF,), self.act)
        y_RI = gemm.grouped_linear(a_RF, self.down_proj, ends_E, self.recipe)
        y_RI = y_RI * gate_TK.reshape(-1)[order_R, None].to(y_RI.dtype)
        return torch.zeros_like(x_TI).index_add(0, token_R, y_RI)

    def extra_repr(self) -> str:
        return f"experts={self.experts}, dim={self.dim}, ffn={self.ffn}, act={self.act}, tp={self.ctx.tp_size}"


class SharedExpert(nn.Module):
    """A dense MLP on every token, inner size split over TP; output a partial sum over TP."""

    def __init__(self, dim: int, ffn: int, act: str, gate: bool, ctx: ParallelContext | None = None):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        self.ffn, self.act, self.gated = ffn, act, act == "swiglu"
        width = 2 * ffn if self.gated else ffn
        partial = ("tp",) if ctx.tp_size > 1 else ()
        self._placements = {"up_proj": _up_placement((width, dim), ffn, self.gated, 0),
                            "down_proj": sharded((dim, ffn), 1)}
        if gate:  # applied to partial outputs: its gradient is a partial sum over TP
            self._placements["gate"] = replicated((1, dim), partial=partial)
        sizes = {"tp": ctx.tp_size}
        for name, pl in self._placements.items():
            setattr(self, name, nn.Parameter(torch.empty(pl.local_shape(sizes))))
        self.has_gate = gate
        self.recipe = gemm.DEFAULT_RECIPE

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h_TF = gemm.linear(x_TD, self.up_proj, None, self.recipe)
        a_TF = activate(h_TF.chunk(2, dim=-1) if self.gated else (h_TF,), self.act)
        y_TD = gemm.linear(a_TF, self.down_proj, None, self.recipe)
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
