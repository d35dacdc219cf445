"""The one GEMM seam: every matrix product of every model goes through ``linear`` (dense) or
``grouped_linear`` (MoE experts: one product per group of rows).

TP layers, fused projections, Mamba-2 / GDN projections, the ViT, projectors and the LM head
call ``mimo.parallel.gemm.linear(x, w, b, recipe)`` and nothing else, so a precision recipe
(FP8 scaling, a Transformer Engine backend) changes every product in one place, and a test
can count or replace them (call it through the module, ``gemm.linear``, so that patching the
attribute reaches every caller).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mimo.core.errors import ConfigError

RECIPES = ("default",)


@dataclass(frozen=True)
class GemmRecipe:
    """How a matrix product computes. ``default``: in the operands' dtype (fp32 or bf16, the
    precision policy's choice), accumulating as the backend does. FP8 recipes come later."""

    kind: str = "default"

    def __post_init__(self):
        if self.kind not in RECIPES:
            raise ConfigError(f"unknown GEMM recipe {self.kind!r}; known: {', '.join(RECIPES)}")


DEFAULT_RECIPE = GemmRecipe()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           recipe: GemmRecipe = DEFAULT_RECIPE) -> torch.Tensor:
    """``x @ weight.T + bias`` (``weight`` is ``[out, in]``, as ``torch.nn.Linear``); a weight
    GTP shards is gathered just in time (``mimo.parallel.gtp``)."""
    if getattr(weight, "gtp", None) is not None:
        from mimo.parallel.gtp import gtp_linear

        return gtp_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _grouped_mm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` computes this product: fp32 / bf16 / fp16 (bf16 only on
    CUDA) and rows of a multiple of 16 bytes (its stride rule)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.dtype not in ((torch.bfloat16,) if x.is_cuda else (torch.float32, torch.bfloat16, torch.float16)):
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], weight.shape[-2]))


def grouped_linear(x_RI: torch.Tensor, weight_EOI: torch.Tensor, offsets_E: torch.Tensor,
                   recipe: GemmRecipe = DEFAULT_RECIPE) -> torch.Tensor:
    """``out[rows of group e] = x[rows of group e] @ weight[e].T`` for rows sorted by group:
    group e is rows ``offsets[e-1] .. offsets[e]`` (int32 cumulative ends, ``offsets[-1]`` =
    R). ``weight_EOI`` is ``[E, out, in]`` (``nn.Linear``'s convention per group).

    One ``torch._grouped_mm`` (no host synchronisation) where it takes the dtype and sizes;
    otherwise (fp64 references, sizes off its 16-byte rule, fp32 on CUDA) one product per
    group, which reads the offsets on the host. An expert weight split over egtp is gathered
    just in time (``mimo.parallel.gtp``)."""
    if getattr(weight_EOI, "gtp", None) is not None:
        from mimo.parallel.gtp import gtp_grouped_linear

        return gtp_grouped_linear(x_RI, weight_EOI, offsets_E, _grouped)
    return _grouped(x_RI, weight_EOI, offsets_E)


def _grouped(x_RI: torch.Tensor, weight_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    if _grouped_mm_takes(x_RI, weight_EOI):
        return torch._grouped_mm(x_RI, weight_EOI.transpose(-2, -1), offs=offsets_E.to(torch.int32))
    ends = offsets_E.tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        outs.append(F.linear(x_RI[start:end], weight_EOI[e]))
        start = end
    return torch.cat(outs) if outs else x_RI.new_zeros(0, weight_EOI.shape[1])
