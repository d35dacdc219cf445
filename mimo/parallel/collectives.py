"""Collectives for tensor and sequence parallelism, plain and differentiable.

A process group of ``None`` stands for a group of one rank (``ParallelGrid.group`` returns
``None`` there): every helper then does no communication and returns its input.

Gradient convention (docs/design.md §2): a tensor replicated over a TP group carries the complete
gradient on every rank. So the adjoint of "all-gather to a replicated tensor" is "keep your
own slice" (``gather_along``), while a gather whose consumers each produce a *partial*
gradient (sequence parallel: the gathered sequence feeds a column-sharded matmul) has a
reduce-scatter as its adjoint (``gather_seq``).

Gloo (the CPU backend) has no reduce-scatter and its all-gather rejects uneven sizes: we
reduce-scatter there by all-reduce + slice, and require sizes divisible by the group size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mimo.core.errors import LayoutError

__all__ = [
    "group_size",
    "group_rank",
    "all_reduce",
    "all_gather_along",
    "reduce_scatter_along",
    "split_along",
    "copy_to_group",
    "reduce_from_group",
    "scatter_along",
    "gather_along",
    "gather_seq",
    "reduce_scatter_seq",
]


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _native_tensor_collectives(group, x: torch.Tensor) -> bool:
    """True where the backend has reduce_scatter_tensor / all_gather_into_tensor (NCCL-like)."""
    if x.device.type == "cpu":
        return False
    backend = str(dist.get_backend(group)).lower()
    return "nccl" in backend or "xccl" in backend


def _check_divisible(size: int, n: int, what: str, dim: int) -> None:
    if size % n:
        raise LayoutError(
            f"{what} along dim {dim} needs a size divisible by the group size {n}, got {size}; "
            f"pad the sequence (or the sharded dim) to a multiple of {n}"
        )


# ---- plain (non-autograd) collectives ----
def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Out-of-place all-reduce (the input is left untouched, autograd may have saved it)."""
    if group_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    return out


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (all ranks must pass the same shape)."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    if _native_tensor_collectives(group, x):
        out_N = x.new_empty((n, *x.shape))
        dist.all_gather_into_tensor(out_N, x, group=group)
        # [n, ..., s, ...] -> [..., n*s, ...]
        return out_N.movedim(0, dim).flatten(dim, dim + 1).contiguous()
    # gloo aborts the process on uneven sizes; check shapes first (cheap next to gloo itself)
    _check_same_shape(x, dim, group, n)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


_META_LEN = 16


def _check_same_shape(x: torch.Tensor, dim: int, group, n: int) -> None:
    """Raise LayoutError on every rank alike unless all ranks pass the same shape."""
    if x.dim() >= _META_LEN:
        raise ValueError(f"all-gather supports at most {_META_LEN - 1} dims, got {x.dim()}")
    meta = torch.zeros(_META_LEN, dtype=torch.int64)
    meta[0] = x.dim()
    meta[1 : 1 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    metas = [torch.empty_like(meta) for _ in range(n)]
    dist.all_gather(metas, meta, group=group)
    if any(not torch.equal(m, meta) for m in metas):
        shapes = [tuple(m[1 : 1 + int(m[0])].tolist()) for m in metas]
        raise LayoutError(
            f"all-gather along dim {dim} needs the same shape on every rank of the group "
            f"(even sizes: pad to a multiple of the group size); got shapes {shapes} by group rank"
        )


def split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    _check_divisible(x.shape[dim], n, "split", dim)
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's slice along ``dim``."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    _check_divisible(x.shape[dim], n, "reduce-scatter", dim)
    if _native_tensor_collectives(group, x):
        x_N = x.movedim(dim, 0).contiguous()  # a no-op copy for dim 0
        out = x_N.new_empty((x_N.shape[0] // n, *x_N.shape[1:]))
        dist.reduce_scatter_tensor(out, x_N, group=group)
        return out.movedim(0, dim).contiguous()
    # gloo: no reduce_scatter; all-reduce then slice (n times the traffic, CPU tests only)
    return split_along(all_reduce(x, group), dim, group)


# ---- autograd collectives ----
class _CopyToGroup(torch.autograd.Function):
    """Forward identity (input already replicated); backward all-reduce of partial grads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward all-reduce of partial results; backward identity (output is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterAlong(torch.autograd.Function):
    """Forward keep own slice of a replicated tensor; backward all-gather (complete grad)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


class _GatherAlong(torch.autograd.Function):
    """Forward all-gather to a replicated tensor; backward keep own slice (see module doc)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.dim, ctx.group), None, None


class _GatherSeq(torch.autograd.Function):
    """SP: forward all-gather along tokens; backward reduce-scatter of partial grads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, 0, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    """SP: forward reduce-scatter of partial results along tokens; backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, 0, ctx.group), None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterAlong.apply(x, dim, group)


def gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherAlong.apply(x, dim, group)


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterSeq.apply(x, group)
