"""Triton kernels for FP8 quantization where the data moves anyway (issue 50, item 2).

``group_columns_t``: the operands of an FP8 expert weight gradient ``g.T @ x``, which contracts
each expert's rows. Each operand ``t [R, C]`` (rows sorted by expert) is scaled per expert and
column (``quantize_group_columns``, here) and the grouped kernel wants it transposed,
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

from mimo.parallel.grouped import rows_expert
from mimo.parallel.kernels import on_triton, tl, triton

FP8_MAX = 448.0  # e4m3 (mimo.parallel.fp8's FP8_MAX[E4M3])
TINY = 1e-12  # as mimo.parallel.fp8: an all-zero column's scale stays finite


def quantize_group_columns(t_RC: torch.Tensor, expert_R: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [R, C]`` (rows sorted by group, ``expert_R`` each row's) quantized e4m3 with one scale
    per group and column: ``(q [R, C], inv [groups, C])``, ``t[r] ~ q[r] * inv[expert_R[r]]``.
    The scales of a weight gradient ``g.T @ x`` per expert: it contracts each group's rows."""
    amax_EC = torch.zeros(groups, t_RC.shape[1], dtype=torch.float32, device=t_RC.device)
    amax_EC.scatter_reduce_(0, expert_R[:, None].expand(-1, t_RC.shape[1]), t_RC.detach().abs().float(), "amax")
    scale_EC = FP8_MAX / amax_EC.clamp_min(TINY)
    q = (t_RC.float() * scale_EC[expert_R]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_EC.reciprocal()


def group_columns_t_reference(t_RC: torch.Tensor, ends_E: torch.Tensor, pends_E: torch.Tensor, width: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qT [C, width] e4m3, inv [E, C] fp32)``: ``t``'s rows of expert ``e`` (``ends_E``:
    cumulative row ends) scaled by its per-column scale, transposed, at the columns from
    ``pends_E[e-1]`` on (``pends_E``: the cumulative ends of each expert's block in the output,
    its rows first; ``ends_E`` itself where there is no padding), zeros elsewhere."""
    R = t_RC.shape[0]
    expert_R = rows_expert(ends_E, R)
    q, inv = quantize_group_columns(t_RC, expert_R, ends_E.shape[0])
    ends, pends = ends_E.to(torch.int64), pends_E.to(torch.int64)
    starts, pstarts = (torch.cat([v.new_zeros(1), v[:-1]]) for v in (ends, pends))
    dest_R = torch.arange(R, device=t_RC.device) + (pstarts - starts)[expert_R]
    out = torch.zeros(width, t_RC.shape[1], dtype=torch.uint8, device=t_RC.device)
    out[dest_R] = q.view(torch.uint8)
    return out.view(q.dtype).t().contiguous(), inv


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


@torch.library.custom_op("mimo::group_columns_t", mutates_args=())
def group_columns_t(t_RC: torch.Tensor, ends_E: torch.Tensor, pends_E: torch.Tensor, width: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s float8 transpose scaled per expert and column, written where each expert's block
    starts (``group_columns_t_reference``); the kernel on CUDA, the torch code elsewhere."""
    return (group_columns_t_fused if on_triton(t_RC) else group_columns_t_reference)(t_RC, ends_E, pends_E, width)


@group_columns_t.register_fake
def _(t_RC, ends_E, pends_E, width):
    return (t_RC.new_empty(t_RC.shape[1], width, dtype=torch.float8_e4m3fn),
            t_RC.new_empty(ends_E.shape[0], t_RC.shape[1], dtype=torch.float32))
