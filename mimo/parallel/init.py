"""TP-invariant initialisation (DESIGN §8).

Each parameter draws from its own seed, ``param_seed(base_seed, name)``, at its full
(unpadded) shape on CPU; it is then padded and sliced for the TP rank. So the weights never
depend on the TP size, on the order parameters are created, or on the global RNG.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

from mimo.parallel.sharding import ShardSpec, shard_tensor

__all__ = ["param_seed", "init_full", "init_shard"]

InitFn = Callable[[torch.Tensor, torch.Generator], object]  # fills its tensor in place


def param_seed(base_seed: int, name: str) -> int:
    """A stable 63-bit seed for ``name`` (sha256, identical in every process and run)."""
    digest = hashlib.sha256(f"{int(base_seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_full(
    shape: tuple[int, ...],
    seed: int,
    *,
    std: float | None = None,
    init_fn: InitFn | None = None,
) -> torch.Tensor:
    """The full fp32 CPU tensor: ``normal(0, std)`` or ``init_fn(tensor, generator)``."""
    if (std is None) == (init_fn is None):
        raise ValueError("give exactly one of std and init_fn")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = torch.empty(shape, dtype=torch.float32)
    if init_fn is not None:
        init_fn(out, gen)
    elif std == 0.0:
        out.zero_()
    else:
        out.normal_(0.0, std, generator=gen)
    return out


def init_shard(
    spec: ShardSpec,
    seed: int,
    rank: int,
    tp: int,
    *,
    std: float | None = None,
    init_fn: InitFn | None = None,
) -> torch.Tensor:
    """This TP rank's slice of the full tensor ``init_full`` would draw (CPU, fp32)."""
    full = init_full(tuple(spec.full_shape), seed, std=std, init_fn=init_fn)
    return shard_tensor(full, spec, rank, tp)
