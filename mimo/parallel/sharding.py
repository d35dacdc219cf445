"""How a TP-sharded parameter maps to its full tensor: shard dim, full shape, padding.

Checkpoint code, weight import and tests use one ``ShardSpec`` per parameter to go from the
full (unpadded) tensor to this rank's slice (``shard_tensor``, local) and back
(``gather_shard``, collective over the TP group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mimo.core.errors import LayoutError
from mimo.parallel.collectives import all_gather_along

__all__ = ["ShardSpec", "pad_to_multiple", "shard_tensor", "gather_shard"]


def pad_to_multiple(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class ShardSpec:
    """``dim`` is the sharded dim (None: replicated); ``full_shape`` is unpadded.

    Along ``dim`` the full tensor is zero-padded to ``padded`` (a multiple of the TP size)
    and split into equal contiguous slices, rank r holding slice r.
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    padded: int | None = None  # padded size along dim; None: full_shape[dim] (no padding)

    @property
    def padded_size(self) -> int:
        assert self.dim is not None
        return self.full_shape[self.dim] if self.padded is None else self.padded

    def local_shape(self, tp: int) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(self.full_shape)
        size = self.padded_size
        if size % tp:
            raise LayoutError(
                f"dim {self.dim} of a parameter of shape {self.full_shape} (padded to {size}) "
                f"does not divide by tp={tp}"
            )
        shape = list(self.full_shape)
        shape[self.dim] = size // tp
        return tuple(shape)


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int, tp: int) -> torch.Tensor:
    """This rank's slice of a full (unpadded) tensor: zero-pad along ``spec.dim``, then split."""
    if tuple(full.shape) != tuple(spec.full_shape):
        raise LayoutError(f"expected a full tensor of shape {spec.full_shape}, got {tuple(full.shape)}")
    if spec.dim is None:
        return full
    local = spec.local_shape(tp)[spec.dim]
    extra = spec.padded_size - full.shape[spec.dim]
    if extra:
        # F.pad lists (left, right) pairs starting from the last dim
        pad = [0, 0] * (full.dim() - 1 - spec.dim) + [0, extra]
        full = F.pad(full, pad)
    return full.narrow(spec.dim, rank * local, local).contiguous()


def gather_shard(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """Collective over the TP group: every rank gets the full, unpadded tensor."""
    if spec.dim is None:
        return local
    full = all_gather_along(local, spec.dim, group)
    return full.narrow(spec.dim, 0, spec.full_shape[spec.dim])
