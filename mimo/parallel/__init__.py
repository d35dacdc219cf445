"""Parallel building blocks shared by encoders and the LLM (a base package): grids, parallel
contexts and the group registry, placements of parameters and of boundary rows, TP layers,
autograd collectives, the GEMM seam, vocab-parallel cross entropy, TP-invariant init.

Process groups are always arguments; ``None`` means a group of one rank (no communication).
The names below load lazily: ``mimo.parallel.grid`` (which ``mimo check-config`` reads) must
not pull in torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "mimo.parallel.collectives": (
        "all_gather_along", "all_reduce", "copy_to_group", "gather_along", "gather_seq", "group_rank", "group_size",
        "reduce_from_group", "reduce_scatter_along", "reduce_scatter_seq", "scatter_along", "split_along",
    ),
    "mimo.parallel.cross_entropy": ("vocab_parallel_cross_entropy",),
    "mimo.parallel.init": ("init_full", "init_local", "param_seed"),
    "mimo.parallel.layers": ("ColumnParallelLinear", "RowParallelLinear", "TPModule", "VocabParallelEmbedding"),
    "mimo.parallel.placement": ("ParamPlacement", "gather_full", "pad_to_multiple", "read_local", "replicated", "shard_full",
                                "sharded"),
    "mimo.parallel.context": ("ParallelContext",),
    "mimo.parallel.grid": ("GroupRegistry", "ParallelGrid"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'mimo.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
