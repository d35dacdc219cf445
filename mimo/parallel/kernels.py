"""What the Triton kernels of ``mimo.parallel`` share: Triton itself (``triton`` / ``tl`` are None
where this torch has none: a CPU-only build, whose callers take their torch code), the widening
their torch references compute in, and where a kernel (rather than its reference) runs."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch
    triton = tl = None


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or kept in fp64 (the yardstick's reference runs)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def on_triton(t: torch.Tensor) -> bool:
    """Whether a custom op runs its Triton kernel on ``t`` (CUDA, Triton present), else its torch reference."""
    return t.is_cuda and triton is not None
