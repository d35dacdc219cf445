"""Helpers of the tensor-parallel rank cases (``test_parallel``, ``test_lora_layers``): a TP group
of each size made once per worker process (every rank runs the same sequence of cases, so the
first ``grid.group()`` call of a size stays collective), and seeded generators."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mimo.parallel.grid import ParallelGrid
from mimo.parallel.init import param_seed

_GRIDS: dict[int, ParallelGrid] = {}


def tp_group(tp: int):
    """(group, tp_rank), or (None, None) on a rank outside the tp grid."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    grid = _GRIDS.setdefault(tp, ParallelGrid({"tp": tp}))
    group = grid.group("tp")
    if rank not in grid:
        return None, None
    return group, grid.coord(rank, "tp")


def seeded(seed: int, *salt) -> torch.Generator:
    return torch.Generator().manual_seed(param_seed(seed, "/".join(map(str, salt))))
