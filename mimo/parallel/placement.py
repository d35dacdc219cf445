"""Where every element of a parameter lives: one plain record per parameter.

A ``ParamPlacement`` names the parameter's full (unpadded) shape and, for each axis of its
module's context that splits it, the dim it splits (``shards``, outer axis first: a second
axis on the same dim splits each piece further, as GTP does inside TP). Axes it does not name
hold it replicated. ``partial`` names axes over which the value is replicated but each rank's
gradient is a partial sum (a norm weight under sequence parallelism): those gradients are
summed once per step. ``pad``: sharded dims are zero-padded up to a multiple of their shard
count (a vocab not divisible by tp). ``parts``: the sharded dim is a concatenation of
independently sharded parts (a fused q|k|v or gate|up weight): each rank holds its piece of
every part, in part order. (The rows of a boundary tensor that bridges move have their own
record, ``mimo.parallel.layout.Placement``.)

From this record alone: this rank's slice of a full tensor (``shard_full``), of a lazily read
one (``read_local``: safetensors ``get_slice``), the full tensor back (``gather_full``,
collective), which rank counts an element in the global norm and writes it in a checkpoint
(``is_owner``), and the record stored beside the tensor (``record``). Axis sizes and this
rank's coordinates come from an ``AxisView`` of the module's ``ParallelContext``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from mimo.core.errors import LayoutError

__all__ = ["ParamPlacement", "replicated", "sharded", "sharded_dims", "pad_to_multiple"]


def pad_to_multiple(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class ParamPlacement:
    full_shape: tuple[int, ...]
    shards: tuple[tuple[str, int], ...] = ()  # (axis, dim), outer first
    partial: tuple[str, ...] = ()
    pad: bool = False
    parts: tuple[int, ...] = ()  # sizes of the fused parts along the sharded dim ``parts_dim``
    parts_dim: int | None = None  # the dim ``parts`` split; None: the one sharded dim (more: name it)

    def __post_init__(self):
        object.__setattr__(self, "full_shape", tuple(int(s) for s in self.full_shape))
        dims = {d for _, d in self.shards}
        for _, d in self.shards:
            if not 0 <= d < len(self.full_shape):
                raise LayoutError(f"placement of a {self.full_shape} tensor shards dim {d}")
        if self.parts:
            d = self.parts_dim
            if d is None:
                if len(dims) != 1:
                    raise LayoutError("a fused placement sharding several dims names its parts_dim")
                (d,) = dims
                object.__setattr__(self, "parts_dim", d)
            elif d not in dims:
                raise LayoutError(f"fused parts along dim {d}, which no axis shards ({self.shards})")
            if sum(self.parts) != self.full_shape[d]:
                raise LayoutError(f"fused parts {self.parts} do not add up to dim {d} of {self.full_shape}")

    # ---- the record's own arithmetic ----
    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.shards)

    def count(self, dim: int, sizes: Mapping[str, int]) -> int:
        """How many pieces ``dim`` is split into."""
        return math.prod(sizes.get(a, 1) for a, d in self.shards if d == dim)

    def _parts_of(self, dim: int) -> tuple[int, ...]:
        return self.parts if self.parts and dim == self.parts_dim else (self.full_shape[dim],)

    def _padded_part(self, size: int, n: int, dim: int) -> int:
        if size % n == 0:
            return size
        if not self.pad:
            raise LayoutError(f"dim {dim} of a parameter of shape {self.full_shape} (size {size}) does not divide "
                              f"into {n} pieces ({dict(self.shards)})")
        return pad_to_multiple(size, n)

    def padded_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        out = []
        for d in range(len(self.full_shape)):
            n = self.count(d, sizes)
            out.append(sum(self._padded_part(p, n, d) for p in self._parts_of(d)))
        return tuple(out)

    def local_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(p // self.count(d, sizes) for d, p in enumerate(self.padded_shape(sizes)))

    def piece(self, dim: int, sizes: Mapping[str, int], coords: Mapping[str, int]) -> int:
        """This rank's piece index along ``dim`` (outer axes first)."""
        idx = 0
        for a, d in self.shards:
            if d == dim:
                idx = idx * sizes.get(a, 1) + coords.get(a, 0)
        return idx

    def runs(self, sizes: Mapping[str, int], coords: Mapping[str, int]) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """(slices of the full tensor, slices of the local one) for every region this rank holds;
        padding stays outside every region (its local elements are zero)."""
        per_dim = []
        for d in range(len(self.full_shape)):
            n, i = self.count(d, sizes), self.piece(d, sizes, coords)
            runs, start, local_start = [], 0, 0
            for part in self._parts_of(d):
                step = self._padded_part(part, n, d) // n
                lo, hi = min(i * step, part), min((i + 1) * step, part)
                if hi > lo:
                    runs.append((slice(start + lo, start + hi), slice(local_start, local_start + hi - lo)))
                start += part
                local_start += step
            per_dim.append(runs)
        return [tuple(zip(*combo)) for combo in itertools.product(*per_dim)]

    # ---- ownership ----
    def is_owner(self, view_axes: Sequence[str], coords: Mapping[str, int]) -> bool:
        """Whether this rank's copy is the one counted in the norm and written to checkpoints:
        coordinate 0 on every axis of the view that holds the parameter replicated."""
        return all(coords.get(a, 0) == 0 for a in view_axes if a != "pp" and a not in self.axes)

    def record(self, sizes: Mapping[str, int], coords: Mapping[str, int]) -> dict:
        """The plain-data record stored beside the tensor in a checkpoint."""
        return {"full_shape": list(self.full_shape), "shards": [list(s) for s in self.shards],
                "partial": list(self.partial), "pad": self.pad, "parts": list(self.parts),
                "parts_dim": self.parts_dim,
                "sizes": {a: int(sizes.get(a, 1)) for a in self.axes},
                "coords": {a: int(coords.get(a, 0)) for a in self.axes},
                "local_shape": list(self.local_shape(sizes))}

    @classmethod
    def from_record(cls, rec: Mapping) -> "ParamPlacement":
        return cls(tuple(rec["full_shape"]), tuple((a, int(d)) for a, d in rec["shards"]), tuple(rec["partial"]),
                   bool(rec["pad"]), tuple(rec["parts"]),
                   rec.get("parts_dim"))


def replicated(shape: Sequence[int], partial: Sequence[str] = ()) -> ParamPlacement:
    return ParamPlacement(tuple(shape), (), tuple(partial))


def sharded(shape: Sequence[int], dim: int, axis: str = "tp", *, pad: bool = False, parts: Sequence[int] = ()) -> ParamPlacement:
    return ParamPlacement(tuple(shape), ((axis, dim),), (), pad, tuple(parts))


def sharded_dims(shape: Sequence[int], shards: Sequence[tuple[str, int]], *, parts: Sequence[int] = (),
                 parts_dim: int | None = None) -> ParamPlacement:
    """Sharded over several axes, each on its dim (outer first): e.g. experts over ep on dim 0
    and their inner size over etp."""
    return ParamPlacement(tuple(shape), tuple((a, int(d)) for a, d in shards), (), False, tuple(parts),
                          parts_dim if parts else None)


# ---------------------------------------------------------------- tensors
def shard_full(full: torch.Tensor, placement: ParamPlacement, sizes: Mapping[str, int], coords: Mapping[str, int]) -> torch.Tensor:
    """This rank's slice of a full (unpadded) tensor (zeros in padding)."""
    if tuple(full.shape) != placement.full_shape:
        raise LayoutError(f"expected a full tensor of shape {placement.full_shape}, got {tuple(full.shape)}")
    return read_local(lambda index: full[index], placement, sizes, coords, full.dtype)


def read_local(read: Callable[[tuple[slice, ...]], torch.Tensor], placement: ParamPlacement, sizes: Mapping[str, int],
               coords: Mapping[str, int], dtype: torch.dtype, device=None) -> torch.Tensor:
    """This rank's slice from ``read(index)``, which returns the full tensor's ``[index]`` (e.g.
    a safetensors ``get_slice``): only the local regions are read."""
    local_shape = placement.local_shape(sizes)
    runs = placement.runs(sizes, coords)
    if len(runs) == 1 and placement.padded_shape(sizes) == placement.full_shape and not placement.parts:
        return read(runs[0][0]).to(dtype=dtype, device=device).reshape(local_shape).contiguous()
    out = torch.zeros(local_shape, dtype=dtype, device=device)
    for full_index, local_index in runs:
        out[local_index] = read(full_index).to(dtype=dtype, device=device)
    return out


def gather_full(local: torch.Tensor, placement: ParamPlacement, view) -> torch.Tensor:
    """Collective over every shard axis of ``view``: the full, unpadded tensor on every rank."""
    if not placement.shards:
        return local
    sizes = {a: view.size(a) for a in placement.axes}
    t = local
    if placement.parts:  # gather each part on its own, then put them back in order
        d = placement.parts_dim
        n = placement.count(d, sizes)
        steps = [placement._padded_part(p, n, d) // n for p in placement.parts]
        pieces = [_gather_dims(piece, placement, view) for piece in t.split(steps, dim=d)]
        return torch.cat([p.narrow(d, 0, size) for p, size in zip(pieces, placement.parts)], dim=d)
    full = _gather_dims(t, placement, view)
    for d, size in enumerate(placement.full_shape):
        if full.shape[d] != size:
            full = full.narrow(d, 0, size)
    return full


def _gather_dims(t: torch.Tensor, placement: ParamPlacement, view) -> torch.Tensor:
    from mimo.parallel.collectives import all_gather_along

    for axis, d in reversed(placement.shards):  # inner axes first: their pieces are adjacent
        t = all_gather_along(t, d, view.group(axis))
    return t
