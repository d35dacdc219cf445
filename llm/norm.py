"""RMSNorm, computed as Hugging Face's Llama / Qwen do (normalise in fp32, scale in the input dtype).

Its weight is replicated over TP. When the tensor it normalises is split over the TP group
(sequence parallel: each rank holds a block of tokens; QK-norm: each rank holds a block of
heads), each rank's weight gradient covers only its part: ``partial=True`` says so. The
placement then records ``partial=("tp",)``, and the gradient stays that partial sum after
backward: training sums it over TP once per step, in buckets (``mimo.training.optim.
GradSync``); outside training, ``mimo.parallel.params.reduce_partial_grads`` does.

``zero_centred=True`` (Qwen3-Next / Qwen3.5, ``HybridArch.norm_zero_centred``): the weight is
stored as an offset from 1 (initialised to zeros) and the whole computation stays in fp32 (at
least) until the end, as Hugging Face's ``Qwen3NextRMSNorm`` / ``Qwen3_5RMSNorm`` do:
``y = (x32 * rsqrt(mean(x32^2) + eps) * (1 + w32)).to(x.dtype)``. Loading ``1 + w`` into the
ordinary norm is not the same function in bf16 (it rounds the normalised x before the scale).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mimo.parallel.collectives import copy_to_group, reduce_from_group
from mimo.parallel.context import ParallelContext
from mimo.parallel.placement import ParamPlacement, replicated, sharded
from mimo.parallel.recompute import maybe


class RMSNorm(nn.Module):
    selective = False  # recompute in backward instead of keeping the fp32 intermediates (mimo.parallel.recompute)

    def __init__(self, dim: int, eps: float = 1e-5, ctx: ParallelContext | None = None, *, partial: bool = False,
                 zero_centred: bool = False, device=None, dtype=None):
        super().__init__()
        self.ctx = ParallelContext.for_tp() if ctx is None else ctx
        self.dim, self.eps, self.zero_centred = dim, eps, zero_centred
        self.partial = partial and self.ctx.tp_size > 1  # only a real TP split makes the gradient partial
        self.weight = nn.Parameter(torch.full((dim,), self.identity, device=device, dtype=dtype))

    @property
    def identity(self) -> float:
        """The weight value that scales by 1: 0 for a zero-centred norm, else 1."""
        return 0.0 if self.zero_centred else 1.0

    def placements(self) -> dict[str, ParamPlacement]:
        return {"weight": replicated((self.dim,), partial=("tp",) if self.partial else ())}

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.0) -> None:
        self.weight.fill_(self.identity)

    def param_init(self, name: str):
        """Initialisation rule for ``mimo.parallel.params.init_params_``: ones (zero-centred: zeros)."""
        value = self.identity
        return lambda t, gen: t.fill_(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return maybe(self.selective, self._norm, x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.promote_types(dtype, torch.float32))  # fp32 at least (fp64 references stay fp64)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self._scale(x32, dtype)

    def _scale(self, x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Weight times the normalised x: in x's dtype (Llama), or zero-centred in fp32 (Qwen3-Next)."""
        if self.zero_centred:
            return (x32 * (1.0 + self.weight.to(x32.dtype))).to(dtype)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        zc = ", zero_centred=True" if self.zero_centred else ""
        return f"{self.dim}, eps={self.eps}{zc}, grad_partial_over_tp={self.partial}"


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a last dim that is split over TP (OLMoE's QK-norm over all heads' q / k at
    once): each rank holds its slice of the weight (so its gradient is whole, not partial), and
    the sum of squares is summed over TP, in the forward and (every rank's slice feeds every
    rank's normaliser) in the backward."""

    def __init__(self, dim: int, eps: float = 1e-5, ctx: ParallelContext | None = None, *, zero_centred: bool = False):
        super().__init__(dim, eps, ctx, zero_centred=zero_centred)
        self.weight = nn.Parameter(torch.full((dim // self.ctx.tp_size,), self.identity))

    def placements(self) -> dict[str, ParamPlacement]:
        return {"weight": sharded((self.dim,), 0)}

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.promote_types(dtype, torch.float32))
        ss = x32.pow(2).sum(-1, keepdim=True)
        if self.ctx.tp_size > 1:  # forward: all-reduce; backward: all-reduce (copy_to_group's)
            ss = reduce_from_group(copy_to_group(ss, self.ctx.tp), self.ctx.tp)
        x32 = x32 * torch.rsqrt(ss / self.dim + self.eps)
        return self._scale(x32, dtype)
