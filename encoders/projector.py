"""Projectors: vision features ``[rows, D_vision]`` -> LLM embeddings ``[rows, D_llm]``, TP-aware.

Input and output are replicated over the TP group (the tower's output is), so the projector's
layers never run sequence parallel, whatever the encoder's context says. Parameter names
follow Hugging Face LLaVA's ``multi_modal_projector`` (``linear_1``, ``linear_2``).

Adding a projector: write an ``nn.Module`` taking ``(in_dim, out_dim, ctx, *, device,
dtype)``, register it in ``PROJECTORS`` and add its name to ``ProjectorConfig.kind``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.core.errors import LayoutError, MimoError
from mimo.encoders.tp_state import full_state, init_tp_invariant, load_full_
from mimo.parallel.context import ParallelContext
from mimo.parallel.layers import ColumnParallelLinear, RowParallelLinear
from mimo.parallel.params import ParamInfo

__all__ = ["PROJECTORS", "build_projector", "Mlp2xGeluProjector", "LinearProjector"]


class _Projector(nn.Module):
    """The context and the full-tensor weight helpers shared by the projectors (see ``encoders.tp_state``)."""

    def __init__(self, out_dim: int, ctx: ParallelContext | None, what: str):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        if out_dim % ctx.tp_size:
            raise LayoutError(f"tp={ctx.tp_size} does not divide the projector's {what} {out_dim}")

    def init_weights(self, seed: int) -> None:
        """TP-invariant, ``nn.Linear``'s default distribution (what LLaVA trains from)."""
        init_tp_invariant(self, seed, _linear_default_init)

    def load_full_(self, state, what: str = "projector weights") -> None:
        load_full_(self, state, what)

    def full_state(self) -> dict[str, torch.Tensor]:
        return full_state(self)


class Mlp2xGeluProjector(_Projector):
    """LLaVA-1.5: Linear(D_vision, D_llm) -> GELU -> Linear(D_llm, D_llm); column then row parallel."""

    def __init__(self, in_dim: int, out_dim: int, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__(out_dim, ctx, "hidden size")
        dd = {"device": device, "dtype": dtype}
        self.linear_1 = ColumnParallelLinear(in_dim, out_dim, True, self.ctx, sequence_parallel=False, **dd)
        self.linear_2 = RowParallelLinear(out_dim, out_dim, True, self.ctx, input_is_parallel=True,
                                          sequence_parallel=False, **dd)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x_TD)))


class LinearProjector(_Projector):
    """One Linear(D_vision, D_llm), column parallel, gathered to a replicated output."""

    def __init__(self, in_dim: int, out_dim: int, ctx: ParallelContext | None = None, *, device=None, dtype=None):
        super().__init__(out_dim, ctx, "output size")
        self.linear = ColumnParallelLinear(in_dim, out_dim, True, self.ctx, gather_output=True, sequence_parallel=False,
                                           device=device, dtype=dtype)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.linear(x_TD)


PROJECTORS: dict[str, Callable[..., _Projector]] = {
    "mlp2x_gelu": Mlp2xGeluProjector,
    "linear": LinearProjector,
}


def build_projector(kind: str, in_dim: int, out_dim: int, ctx: ParallelContext | None = None, *, device=None,
                    dtype=None) -> _Projector:
    """``out_dim`` is the LLM's hidden size; ``ctx`` the encoder's parallel context (None: one process)."""
    try:
        cls = PROJECTORS[kind]
    except KeyError:
        raise MimoError(f"unknown projector kind {kind!r}; known: {', '.join(sorted(PROJECTORS))}") from None
    return cls(in_dim, out_dim, ctx, device=device, dtype=dtype)


def _linear_default_init(name: str, info: ParamInfo):
    """``nn.Linear.reset_parameters``: weight and bias uniform(+-1/sqrt(fan_in))."""
    fan_in = info.module.in_features
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return lambda t, g: nn.init.uniform_(t, -bound, bound, generator=g)
