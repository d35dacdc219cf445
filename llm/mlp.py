"""Feed-forward layer: pre-norm, column-parallel up projection(s), activation, row-parallel down.

``swiglu``: ``down(silu(gate(x)) * up(x))`` (Llama, Qwen; gate and up in one GEMM);
``relu2``: ``down(relu(up(x))^2)`` (Nemotron-H); ``gelu``: ``down(gelu(up(x)))`` (erf form).
The inner size ``ffn`` is split over TP; with sequence parallel the up projection gathers the
sequence and the down projection reduce-scatters it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.linear import FusedColumnParallelLinear
from mimo.llm.norm import RMSNorm
from mimo.parallel.params import init_params_, param_table
from mimo.parallel import RowParallelLinear, group_size

ACTIVATIONS = ("swiglu", "relu2", "gelu")


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
    """``forward(h_TD, ctx) -> h_TD``: ``h + down(act(up(norm(h))))``."""

    def __init__(self, cfg: MLPConfig, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        if cfg.act not in ACTIVATIONS:
            raise ValueError(f"unknown MLP activation {cfg.act!r}; one of {ACTIVATIONS}")
        self.cfg = cfg
        sp = sequence_parallel and group_size(tp_group) > 1
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, grad_group=tp_group if sp else None)
        parts = {"gate": cfg.ffn, "up": cfg.ffn} if cfg.act == "swiglu" else {"up": cfg.ffn}
        self.up_proj = FusedColumnParallelLinear(cfg.hidden, parts, bias=cfg.bias, group=tp_group, sequence_parallel=sp)
        self.down_proj = RowParallelLinear(cfg.ffn, cfg.hidden, bias=cfg.bias, group=tp_group,
                                           input_is_parallel=True, sequence_parallel=sp)

    def init_weights(self, seed: int, std: float, out_std: float | None = None) -> None:
        """TP-invariant: each parameter from ``param_seed(seed, its name in this layer)``."""
        init_params_(param_table(self), seed, std, {"down_proj.weight": std if out_std is None else out_std})

    def forward(self, h_TD: torch.Tensor, ctx: SeqContext) -> torch.Tensor:
        x_TD = self.norm(h_TD)
        if self.cfg.act == "swiglu":
            gate_TF, up_TF = self.up_proj(x_TD)
            a_TF = F.silu(gate_TF) * up_TF
        else:
            (up_TF,) = self.up_proj(x_TD)
            a_TF = F.relu(up_TF).square() if self.cfg.act == "relu2" else F.gelu(up_TF)
        return h_TD + self.down_proj(a_TF)


def build_mlp(arch: HybridArch, spec, tp_group, sequence_parallel: bool) -> MLP:
    return MLP(MLPConfig.from_arch(arch), tp_group, sequence_parallel)
