"""Grouped products in the activations' dtype: the experts' GEMM rows grouped by expert, and
its weight gradient (``mimo.parallel.gemm`` and ``mimo.parallel.fp8`` both use them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mm_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` computes this product: fp32 / bf16 / fp16 (bf16 only on
    CUDA) and rows of a multiple of 16 bytes (its stride rule)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.dtype not in ((torch.bfloat16,) if x.is_cuda else (torch.float32, torch.bfloat16, torch.float16)):
        return False
    return all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], weight.shape[-2]))


GROUP_ALIGN = 16  # rows: where each group of torch._scaled_grouped_mm must start


def rows_expert(ends_E: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows]``: the group of each row of a grouped product (``ends_E``: cumulative ends)."""
    return torch.bucketize(torch.arange(rows, device=ends_E.device), ends_E, right=True)


def padded_groups(ends_E: torch.Tensor, rows: int, align: int = GROUP_ALIGN) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each row goes when every group starts at a multiple of ``align``: ``(dest_R,
    padded_ends_E, capacity)``, on the device, with no host read (``capacity`` = rows + align
    x groups bounds the padded length)."""
    ends_E = ends_E.to(torch.int64)
    counts_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    padded_E = (counts_E + align - 1) // align * align
    pends_E = torch.cumsum(padded_E, 0)
    starts_E, pstarts_E = ends_E - counts_E, pends_E - padded_E
    group_R = rows_expert(ends_E, rows)
    dest_R = torch.arange(rows, device=ends_E.device) - starts_E[group_R] + pstarts_E[group_R]
    return dest_R, pends_E, rows + align * ends_E.numel()


def grouped_rows(x_RI: torch.Tensor, weight_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``gemm.grouped_linear`` in the operands' dtype: one ``torch._grouped_mm`` where it takes
    them, else one product per group (reading the offsets on the host)."""
    if grouped_mm_takes(x_RI, weight_EOI):
        return torch._grouped_mm(x_RI, weight_EOI.transpose(-2, -1), offs=offsets_E.to(torch.int32))
    ends = offsets_E.tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        outs.append(F.linear(x_RI[start:end], weight_EOI[e]))
        start = end
    return torch.cat(outs) if outs else x_RI.new_zeros(0, weight_EOI.shape[1])


def grouped_weight_grad(g_RO: torch.Tensor, x_RI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``[E, O, I]``: each group's ``g.T @ x`` over its rows (the weight gradient of
    ``grouped_linear``); one ``torch._grouped_mm`` where it takes the operands, else per group."""
    e = offsets_E.numel()
    if grouped_mm_takes(x_RI, g_RO) and g_RO.shape[0] * g_RO.element_size() % 16 == 0:
        return torch._grouped_mm(g_RO.t(), x_RI, offs=offsets_E.to(torch.int32))
    out, start = [], 0
    for end in offsets_E.tolist():
        out.append(g_RO[start:end].t() @ x_RI[start:end])
        start = end
    return torch.stack(out) if out else g_RO.new_zeros(e, g_RO.shape[1], x_RI.shape[1])


# ---- the same as ops that torch.compile calls whole, without tracing into them -------------
# (the FP8 experts': mimo.parallel.fp8) Their dequantized products (off the GPU's FP8 kernel)
# are fp32, whose torch._grouped_mm the CPU runs but its meta rejects (CUDA's rule: bf16 /
# fp16); their weight gradient takes the per-group loop, a host read, on row counts off the
# 16-byte rule. Traced, either would break the graph; as ops they compute exactly the same.


@torch.library.custom_op("mimo::grouped_rows", mutates_args=())
def grouped_rows_op(x_RI: torch.Tensor, weight_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return grouped_rows(x_RI, weight_EOI, offsets_E)


@grouped_rows_op.register_fake
def _(x_RI, weight_EOI, offsets_E):
    return x_RI.new_empty(x_RI.shape[0], weight_EOI.shape[1])


@torch.library.custom_op("mimo::grouped_weight_grad", mutates_args=())
def grouped_weight_grad_op(g_RO: torch.Tensor, x_RI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return grouped_weight_grad(g_RO, x_RI, offsets_E)


@grouped_weight_grad_op.register_fake
def _(g_RO, x_RI, offsets_E):
    return g_RO.new_empty(offsets_E.shape[0], g_RO.shape[1], x_RI.shape[1])
