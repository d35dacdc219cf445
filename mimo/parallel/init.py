"""Layout-independent initialisation that draws only this rank's shard (docs/design.md §8, §9).

Each parameter draws from its own seed, ``param_seed(base_seed, name)``, so the weights never
depend on the layout, on the order parameters are created, or on the global RNG. A small
tensor (at most ``SMALL`` elements: norms, biases, per-head vectors, custom inits) is drawn
whole on the CPU and sliced. A large one is ``N(0, std)`` drawn tile by tile: the full tensor
is cut into fixed tiles (``TILE`` over its last two dims, one index of every leading dim), each
tile from its own generator, so a rank draws only the tiles its shard touches: time and memory
O(its shard), the same values at every layout.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import Callable, Mapping

import torch

from mimo.parallel.placement import ParamPlacement, read_local

__all__ = ["param_seed", "init_full", "init_local", "SMALL", "TILE"]

InitFn = Callable[[torch.Tensor, torch.Generator], object]  # fills its tensor in place
SMALL = 1 << 20
TILE = (128, 512)  # rows x columns of a tile over the last two dims (a 1-d tensor: TILE[0] * TILE[1])


def param_seed(base_seed: int, name: str) -> int:
    """A stable 63-bit seed for ``name`` (sha256, identical in every process and run)."""
    digest = hashlib.sha256(f"{int(base_seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_full(shape: tuple[int, ...], seed: int, *, std: float | None = None, init_fn: InitFn | None = None) -> torch.Tensor:
    """The full fp32 CPU tensor: ``normal(0, std)`` (tiled when large) or ``init_fn(tensor, generator)``."""
    if (std is None) == (init_fn is None):
        raise ValueError("give exactly one of std and init_fn")
    return init_local(ParamPlacement(tuple(shape)), {}, {}, seed, std=std, init_fn=init_fn)


def init_local(placement: ParamPlacement, sizes: Mapping[str, int], coords: Mapping[str, int], seed: int, *,
               std: float | None = None, init_fn: InitFn | None = None) -> torch.Tensor:
    """This rank's shard (fp32, CPU) of the full tensor drawn from ``seed`` (see module doc)."""
    if (std is None) == (init_fn is None):
        raise ValueError("give exactly one of std and init_fn")
    shape = placement.full_shape
    if math.prod(shape) <= SMALL or init_fn is not None or std == 0.0:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        full = torch.empty(shape, dtype=torch.float32)
        if init_fn is not None:
            init_fn(full, gen)
        elif std == 0.0:
            full.zero_()
        elif math.prod(shape) <= SMALL:
            full.normal_(0.0, std, generator=gen)
        else:
            full = None
        if full is not None:
            return read_local(lambda index: full[index], placement, sizes, coords, torch.float32)
    return read_local(lambda index: _tiled_normal(shape, index, seed, std), placement, sizes, coords, torch.float32)


def _tile_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 1:
        return (TILE[0] * TILE[1],)
    return (1,) * (len(shape) - 2) + TILE


def _tiled_normal(shape: tuple[int, ...], index: tuple[slice, ...], seed: int, std: float) -> torch.Tensor:
    """``full[index]`` of the tiled N(0, std) tensor, drawing only the tiles it overlaps."""
    tile = _tile_shape(shape)
    bounds = [(s.start, s.stop) for s in index]
    out = torch.empty([hi - lo for lo, hi in bounds], dtype=torch.float32)
    ranges = [range(lo // t, -(-hi // t)) for (lo, hi), t in zip(bounds, tile)]
    for tid in itertools.product(*ranges):
        t_lo = [i * t for i, t in zip(tid, tile)]
        t_hi = [min((i + 1) * t, n) for i, t, n in zip(tid, tile, shape)]
        gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, "tile" + ",".join(map(str, tid))))
        block = torch.empty([h - l for l, h in zip(t_lo, t_hi)], dtype=torch.float32).normal_(0.0, std, generator=gen)
        src = tuple(slice(max(lo, tl) - tl, min(hi, th) - tl) for (lo, hi), tl, th in zip(bounds, t_lo, t_hi))
        dst = tuple(slice(max(lo, tl) - lo, min(hi, th) - lo) for (lo, hi), tl, th in zip(bounds, t_lo, t_hi))
        out[dst] = block[src]
    return out
