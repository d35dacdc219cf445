"""Feed-forward layer: pre-norm, column-parallel up projection(s), activation, row-parallel down.

``swiglu``: ``down(silu(gate(x)) * up(x))`` (Llama, Qwen; gate and up in one GEMM);
``relu2``: ``down(relu(up(x))^2)`` (Nemotron-H); ``gelu``: ``down(gelu(up(x)))`` (erf form).
The inner size ``ffn`` is split over TP; with sequence parallel the up projection gathers the
sequence and the down projection reduce-scatters it. Gate and up are one stored weight
``up_proj.weight`` ``[2 * ffn, hidden]`` (gate rows first, then up: each part split over TP on
its own), so one GEMM computes both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.norm import RMSNorm
from mimo.parallel.context import ParallelContext
from mimo.parallel.layers import FusedColumnParallelLinear, RowParallelLinear
from mimo.parallel.params import init_params_, param_table
from mimo.parallel.recompute import maybe

ACTIVATIONS = ("swiglu", "relu2", "gelu")


def activate(parts: tuple[torch.Tensor, ...], act: str) -> torch.Tensor:
    """The MLP activation of the up projection's output: ``(gate, up)`` for ``swiglu``,
    ``(up,)`` for the non-gated ones (shared by the MLP, the MoE experts and shared experts)."""
    if act == "swiglu":
        gate_TF, up_TF = parts
        return F.silu(gate_TF) * up_TF
    (up_TF,) = parts
    if act == "relu2":
        return F.relu(up_TF).square()
    if act == "gelu":
        return F.gelu(up_TF)
    raise ValueError(f"unknown MLP activation {act!r}; one of {ACTIVATIONS}")


def activate_maybe_recomputed(recompute: bool, parts: tuple[torch.Tensor, ...], act: str) -> torch.Tensor:
    """``activate``, recomputed in backward when ``recompute`` (selective recompute): only its
    inputs are kept, not what the activation keeps for its own backward."""
    return maybe(recompute, lambda *p: activate(p, act), *parts)


@dataclass(frozen=True)
class MLPConfig:
    hidden: int
    ffn: int
    act: str = "swiglu"
    bias: bool = False
    norm_eps: float = 1e-5

    @classmethod
    def from_arch(cls, arch: HybridArch) -> "MLPConfig":
        return cls(arch.hidden, arch.ffn, arch.mlp_act, arch.mlp_bias, arch.norm_eps)


class MLP(nn.Module):
    """``forward(h_TD, seq) -> h_TD``: ``h + down(act(up(norm(h))))``."""

    selective = False  # recompute the activation in backward (mimo.parallel.recompute)

    def __init__(self, cfg: MLPConfig, ctx: ParallelContext | None = None):
        super().__init__()
        if cfg.act not in ACTIVATIONS:
            raise ValueError(f"unknown MLP activation {cfg.act!r}; one of {ACTIVATIONS}")
        self.cfg = cfg
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        # under SP each rank normalises its own tokens: the norm weight's gradient is partial
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, ctx, partial=ctx.sequence_parallel)
        parts = {"gate": cfg.ffn, "up": cfg.ffn} if cfg.act == "swiglu" else {"up": cfg.ffn}
        self.up_proj = FusedColumnParallelLinear(cfg.hidden, parts, bias=cfg.bias, ctx=ctx)
        self.down_proj = RowParallelLinear(cfg.ffn, cfg.hidden, bias=cfg.bias, ctx=ctx, input_is_parallel=True)

    def init_weights(self, seed: int, std: float, out_std: float | None = None) -> None:
        """TP-invariant: each parameter from ``param_seed(seed, its name in this layer)``."""
        init_params_(param_table(self), seed, std, {"down_proj.weight": std if out_std is None else out_std})

    def forward(self, h_TD: torch.Tensor, seq: SeqContext) -> torch.Tensor:
        a_TF = activate_maybe_recomputed(self.selective, self.up_proj(self.norm(h_TD)), self.cfg.act)
        return h_TD + self.down_proj(a_TF)


def build_mlp(arch: HybridArch, spec, ctx: ParallelContext | None = None) -> MLP:
    return MLP(MLPConfig.from_arch(arch), ctx)
