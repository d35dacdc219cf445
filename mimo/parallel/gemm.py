"""The one GEMM seam: every matrix product of every model goes through ``linear``.

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
    """``x @ weight.T + bias`` (``weight`` is ``[out, in]``, as ``torch.nn.Linear``)."""
    return F.linear(x, weight, bias)
