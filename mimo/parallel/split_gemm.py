"""fp32 products of a bf16 activation on bf16 tensor cores: the MoE router's logits.

The router multiplies bf16 hidden states by an fp32 weight and wants fp32 logits (routing
decisions must not depend on bf16 rounding of the weight). Run as an fp32 GEMM, that is a SIMT
kernel: issue 55's profile put the router's three products at 0.34 ms a layer (5.4 ms a step of
the 16-layer MoE model), at about 20 TFLOP/s. Here every fp32 operand is split into three bf16
parts whose sum is exactly it (8 + 8 + 8 significant bits: ``split3``), so each product is one
bf16 GEMM with fp32 accumulation and output over the parts stacked along a free dimension:

* logits ``x @ w.T``: ``x`` is bf16 already, so ``x @ [w_hi; w_mid; w_lo].T`` and the three
  column blocks summed in fp32 give every product term exactly, accumulated in fp32: an fp32
  GEMM's result up to the order of summation;
* weight gradient ``g.T @ x`` (``g`` fp32): ``[g_hi | g_mid | g_lo].T @ x``, blocks summed, likewise;
* input gradient ``g @ w`` (both fp32; the result is rounded to ``x``'s bf16): the three largest
  terms ``g_hi w_hi + g_hi w_mid + g_mid w_hi`` as one GEMM over the stacked contraction, a
  relative error near 2^-16 before the bf16 rounding of 2^-9.

CUDA only (``takes``; torch's ``mm`` with ``out_dtype``); elsewhere the router keeps its fp32
product. The CPU emulates the bf16 GEMMs with fp32 ones over the same parts (exact products,
fp32 sums), which the suite checks against fp64.
"""

from __future__ import annotations

import torch

_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(a, b, out_dtype=...)


def split3(t: torch.Tensor) -> torch.Tensor:
    """``[3, *t.shape]`` bf16 parts whose fp32 sum is ``t`` exactly (short of subnormal parts)."""
    hi = t.to(torch.bfloat16)
    r = t - hi.float()
    mid = r.to(torch.bfloat16)
    return torch.stack((hi, mid, (r - mid.float()).to(torch.bfloat16)))


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` of bf16 operands, accumulated in fp32, written in ``out_dtype``."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype)
    return (a.float() @ b.float()).to(out_dtype)


class _Fp32LinearOfBf16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        e = w_ED.shape[0]
        w3 = split3(w_ED)
        ctx.save_for_backward(x_TD, w3)
        y = _mm(x_TD, w3.reshape(3 * e, -1).t(), torch.float32)
        return (y[:, 2 * e:] + y[:, e:2 * e]) + y[:, :e]  # the small parts first

    @staticmethod
    def backward(ctx, g_TE: torch.Tensor):
        x_TD, w3 = ctx.saved_tensors
        e = w3.shape[1]
        g3 = split3(g_TE.float())
        dw = _mm(g3.transpose(1, 2).reshape(3 * e, -1), x_TD, torch.float32)  # [3E, D]
        dw = (dw[2 * e:] + dw[e:2 * e]) + dw[:e]
        lhs = torch.cat((g3[0], g3[0], g3[1]), dim=1)  # [T, 3E]: g_hi w_hi + g_hi w_mid + g_mid w_hi
        rhs = torch.cat((w3[0], w3[1], w3[0]), dim=0)  # [3E, D]
        dx = _mm(lhs, rhs, x_TD.dtype)
        return dx, dw


def takes(x_TD: torch.Tensor, w_ED: torch.Tensor) -> bool:
    """Whether the router's fp32 product of ``x`` and ``w`` runs here: a bf16 activation and an
    fp32 weight on CUDA (tests switch this on to run it on the CPU)."""
    return x_TD.is_cuda and _MM_OUT_DTYPE and x_TD.dtype == torch.bfloat16 and w_ED.dtype == torch.float32


def fp32_linear_of_bf16(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """``x.float() @ w.T`` (fp32 ``[T, E]``) for bf16 ``x`` and fp32 ``w``, on bf16 tensor cores (module doc)."""
    return _Fp32LinearOfBf16.apply(x_TD, w_ED)
