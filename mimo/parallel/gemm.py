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
from mimo.parallel.fp8 import fp8_grouped_linear, fp8_linear, fp8_takes
from mimo.parallel.grouped import GROUP_ALIGN, grouped_rows

RECIPES = ("default", "tensorwise", "rowwise", "delayed", "blockwise")


@dataclass(frozen=True)
class GemmRecipe:
    """How a matrix product computes. ``default``: in the operands' dtype (fp32 or bf16, the
    precision policy's choice), accumulating as the backend does. A module under ``train.fp8``
    holds an ``mimo.parallel.fp8.FP8Site`` instead (same ``kind`` field: tensorwise, rowwise,
    delayed, blockwise), which makes its products float8 ones."""

    kind: str = "default"

    def __post_init__(self):
        if self.kind not in RECIPES:
            raise ConfigError(f"unknown GEMM recipe {self.kind!r}; known: {', '.join(RECIPES)}")


DEFAULT_RECIPE = GemmRecipe()  # the functions' default; a module holds its own (default_recipe)


def default_recipe() -> GemmRecipe:
    """A new ``default`` recipe for one module to hold. Never a shared object: torch.compile
    guards a module's ``recipe`` only where no other path of the traced code (a function's
    default argument, another module) reached the same object first, so a layer compiled with a
    shared default would serve a layer of the same class under FP8 with its plain products."""
    return GemmRecipe()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           recipe: GemmRecipe = DEFAULT_RECIPE) -> torch.Tensor:
    """``x @ weight.T + bias`` (``weight`` is ``[out, in]``, as ``torch.nn.Linear``); a weight
    GTP shards is gathered just in time (``mimo.parallel.gtp``)."""
    if getattr(weight, "gtp", None) is not None:
        from mimo.parallel.gtp import gtp_linear

        return gtp_linear(x, weight, bias)
    if recipe.kind != "default" and fp8_takes(x, weight):
        return fp8_linear(x, weight, bias, recipe)
    return F.linear(x, weight, bias)


def grouped_row_align(recipe: GemmRecipe) -> int:
    """Where ``grouped_linear`` under ``recipe`` wants each group's rows to start (a multiple
    of it): FP8's grouped kernel takes groups at multiples of 16 rows, and rows laid out so by
    the caller (``aligned=True``) spare it a padded copy of its operands and output. Block-wise
    FP8 experts multiply dequantized (no grouped kernel takes block scales): any rows do."""
    return GROUP_ALIGN if recipe.kind not in ("default", "blockwise") else 1


def grouped_linear(x_RI: torch.Tensor, weight_EOI: torch.Tensor, offsets_E: torch.Tensor,
                   recipe: GemmRecipe = DEFAULT_RECIPE, aligned: bool = False) -> torch.Tensor:
    """``out[rows of group e] = x[rows of group e] @ weight[e].T`` for rows sorted by group:
    group e is rows ``offsets[e-1] .. offsets[e]`` (int32 cumulative ends, ``offsets[-1]`` =
    R). ``weight_EOI`` is ``[E, out, in]`` (``nn.Linear``'s convention per group).
    ``aligned``: every group starts at a multiple of ``grouped_row_align(recipe)``.

    One ``torch._grouped_mm`` (no host synchronisation) where it takes the dtype and sizes;
    otherwise (fp64 references, sizes off its 16-byte rule, fp32 on CUDA) one product per
    group, which reads the offsets on the host. An expert weight split over egtp is gathered
    just in time (``mimo.parallel.gtp``)."""
    if getattr(weight_EOI, "gtp", None) is not None:
        from mimo.parallel.gtp import gtp_grouped_linear

        return gtp_grouped_linear(x_RI, weight_EOI, offsets_E, grouped_rows)
    if recipe.kind != "default" and fp8_takes(x_RI, weight_EOI):
        return fp8_grouped_linear(x_RI, weight_EOI, offsets_E, recipe, aligned)
    return grouped_rows(x_RI, weight_EOI, offsets_E)
