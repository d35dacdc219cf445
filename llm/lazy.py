"""Lazy readers of checkpoint tensors: indexable by a tuple of slices (each with explicit
bounds), they read from their sources only what an index covers, so a rank loads only its own
slice of a tensor that a checkpoint stores concatenated, split or per expert."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from mimo.core.errors import MimoError


def concat_reader(sources: list, sizes: tuple[int, ...], dim: int = 0) -> Callable[[tuple[slice, ...]], torch.Tensor]:
    """``read(index)`` of the concatenation of ``sources`` along ``dim`` (each indexable by a
    tuple of slices: a tensor, a safetensors slice, a window), reading from each only what
    ``index`` covers (every slice of ``index`` has explicit bounds)."""
    if len(sources) == 1:
        return lambda index: sources[0][index]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def read(index: tuple[slice, ...]) -> torch.Tensor:
        want = index[dim]
        pieces = []
        for src, start, size in zip(sources, starts, sizes):
            lo, hi = max(want.start, start), min(want.stop, start + size)
            if hi > lo:
                pieces.append(src[(*index[:dim], slice(lo - start, hi - start), *index[dim + 1:])])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)  # load time, not a forward

    return read


class StackedExperts:
    """Lazy ``[E, rows, ...]`` stack of per-expert tensors, each expert's rows the concatenation of
    its parts along dim 0 (gate | up): indexing reads only the experts and rows asked for."""

    def __init__(self, experts: list[list], sizes: tuple[int, ...]):
        self.readers = [concat_reader(parts, sizes, 0) for parts in experts]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        chosen, rest = index[0], tuple(index[1:])
        return torch.stack([self.readers[e](rest) for e in range(*chosen.indices(len(self.readers)))])


def stacked_experts(name: str, keys_ep: list[list[str]], shapes: Mapping[str, tuple[int, ...]], get: Callable[[str], object],
                    where: str = "") -> tuple[tuple[int, ...], Callable[[], StackedExperts]]:
    """(shape, loader) of per-expert tensors (``keys_ep``: expert -> its parts' keys, gate | up)
    stacked as ``name`` ``[E, rows, ...]`` (``StackedExperts``, read lazily); MimoError (after
    ``where``) naming a tensor unlike expert 0's, or parts that differ beyond dim 0."""
    first = [tuple(shapes[k]) for k in keys_ep[0]]
    for ks in keys_ep:
        for k, want, k0 in zip(ks, first, keys_ep[0]):
            if tuple(shapes[k]) != want:
                raise MimoError(f"{where}tensor {k!r} has shape {tuple(shapes[k])}, unlike expert 0's {want} ({k0!r})")
    if len({s[1:] for s in first}) != 1:
        raise MimoError(f"{where}tensors {keys_ep[0]} of {name!r} differ in shape beyond dim 0: {first}")
    sizes = tuple(s[0] for s in first)
    return (len(keys_ep), sum(sizes), *first[0][1:]), lambda: StackedExperts([[get(k) for k in ks] for ks in keys_ep], sizes)
