"""Triton kernels for FP8 quantization where the data moves anyway (issue 50, item 2).

``group_columns_t_fused`` (``mimo.parallel.fp8.group_columns_t`` the op that runs it, beside its
torch reference): the operands of an FP8 expert weight gradient ``g.T @ x``, which contracts
each expert's rows. Each operand ``t [R, C]`` (rows sorted by expert) is scaled per expert and
column (``mimo.parallel.fp8.quantize_group_columns``) and the grouped kernel wants it transposed,
``t.T [C, R]`` row-major (``g.T`` as it is, ``x`` as its column-major view). In torch that is an
fp32 ``|t|``, a scattered amax, the scaled cast, and a transposing copy of the float8 result:
four passes over ``R x C``. Here one program per (expert, block of columns) reads its rows twice
(the column amaxes, then the cast) and writes the transposed float8 tile once; where the experts'
rows must start at multiples of 16 (``padded``), it writes them there, into a zeroed buffer.

On the CPU (and without Triton) the torch code runs; the kernel runs on CUDA, or on the CPU under
``TRITON_INTERPRET=1`` (the suite's check). Scales bit for bit as the torch code's: its
``448 / amax`` is ``amax.reciprocal() * 448`` (two roundings), then the reciprocal of that; the
cast e4m3 round-to-nearest-even (the GPU's; the interpreter's own cast rounds otherwise, so the
suite checks it writing the scaled fp32 values instead: ``q``'s dtype is the output's).
"""

from __future__ import annotations

import torch

from mimo.parallel.kernels import tl, triton

FP8_MAX = 448.0  # e4m3
TINY = 1e-12  # as mimo.parallel.fp8: an all-zero column's scale stays finite


if triton is not None:
    _MAX, _TINY = tl.constexpr(FP8_MAX), tl.constexpr(TINY)  # (a kernel reads constexpr globals only)

    @triton.jit
    def _group_columns_t_kernel(t_ptr, ends_ptr, pends_ptr, q_ptr, inv_ptr, cols, width, t_stride,
                                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        e = tl.program_id(1)
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < cols
        end = tl.load(ends_ptr + e).to(tl.int64)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        pstart = tl.load(pends_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            ok = (r < end)[:, None] & c_ok[None, :]
            t = tl.load(t_ptr + r[:, None] * t_stride + c[None, :], mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(t), axis=0))
        one = tl.full((BLOCK_C,), 1.0, tl.float32)
        scale = tl.math.div_rn(one, tl.maximum(amax, _TINY)) * _MAX  # torch's 448 / amax: amax.reciprocal() * 448
        tl.store(inv_ptr + e * cols + c, tl.math.div_rn(one, scale), mask=c_ok)
        for r0 in range(start, end, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            ok = (r < end)[:, None] & c_ok[None, :]
            t = tl.load(t_ptr + r[:, None] * t_stride + c[None, :], mask=ok, other=0.0).to(tl.float32)
            q = tl.clamp(t * scale[None, :], -_MAX, _MAX).to(q_ptr.dtype.element_ty)
            dest = pstart + r - start
            tl.store(q_ptr + c[None, :].to(tl.int64) * width + dest[:, None], q, mask=ok)


BLOCK_R, BLOCK_C = 64, 64  # a program's tile: rows per step of its loops, columns it owns


def group_columns_t_fused(t_RC: torch.Tensor, ends_E: torch.Tensor, pends_E: torch.Tensor, width: int,
                          dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_columns_t_reference`` as one Triton kernel (its module doc); ``dtype`` of ``q``:
    e4m3, or fp32 for the clamped scaled values before the cast (the interpreter's check)."""
    t_RC = t_RC.contiguous()
    E, C = ends_E.shape[0], t_RC.shape[1]
    q = torch.zeros(C, width, dtype=dtype, device=t_RC.device)
    inv = torch.empty(E, C, dtype=torch.float32, device=t_RC.device)
    if E and C:
        _group_columns_t_kernel[(triton.cdiv(C, BLOCK_C), E)](t_RC, ends_E.contiguous(), pends_E.contiguous(), q, inv, C,
                                                             width, t_RC.stride(0), BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return q, inv
