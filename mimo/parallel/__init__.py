"""Tensor-parallel building blocks shared by encoders and the LLM (a base package).

Imports only torch, ``mimo.errors`` and ``mimo.grid``. Process groups are always arguments;
``None`` means a group of one rank (no communication).
"""

from mimo.parallel.collectives import (
    all_gather_along,
    all_reduce,
    copy_to_group,
    gather_along,
    gather_seq,
    group_rank,
    group_size,
    reduce_from_group,
    reduce_scatter_along,
    reduce_scatter_seq,
    scatter_along,
    split_along,
)
from mimo.parallel.cross_entropy import vocab_parallel_cross_entropy
from mimo.parallel.init import init_full, init_shard, param_seed
from mimo.parallel.layers import ColumnParallelLinear, RowParallelLinear, TPModule, VocabParallelEmbedding
from mimo.parallel.random import DropoutStreams, dropout, dropout_streams
from mimo.parallel.sharding import ShardSpec, gather_shard, pad_to_multiple, shard_tensor

__all__ = [
    "all_gather_along",
    "all_reduce",
    "copy_to_group",
    "gather_along",
    "gather_seq",
    "group_rank",
    "group_size",
    "reduce_from_group",
    "reduce_scatter_along",
    "reduce_scatter_seq",
    "scatter_along",
    "split_along",
    "vocab_parallel_cross_entropy",
    "init_full",
    "init_shard",
    "param_seed",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPModule",
    "VocabParallelEmbedding",
    "DropoutStreams",
    "dropout",
    "dropout_streams",
    "ShardSpec",
    "gather_shard",
    "pad_to_multiple",
    "shard_tensor",
]
