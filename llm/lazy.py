"""Lazy readers of checkpoint tensors: indexable by a tuple of slices (each with explicit
bounds), they read from their sources only what an index covers, so a rank loads only its own
slice of a tensor that a checkpoint stores concatenated, split or per expert."""

from __future__ import annotations

from typing import Callable

import torch


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
