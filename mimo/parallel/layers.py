"""Tensor-parallel layers: column / row parallel linear and vocab-parallel embedding.

Weights are shaped as ``torch.nn.Linear`` ([out, in]). Activations are token-major ``[T, D]``
(packed THD sequences; leading dims other than the last are allowed without sequence
parallel). With sequence parallel (SP) the tensors between TP regions hold this rank's
contiguous token block ``[T/tp, D]``: ColumnParallelLinear all-gathers it on the way in,
RowParallelLinear and VocabParallelEmbedding reduce-scatter on the way out, so T must be a
multiple of tp (the packer pads to that).

Every layer describes its parameters with ``shard_specs()`` (sharded dim, full unpadded
shape), initialises TP-invariantly with ``init_weights(seed, std)``, and converts to and from
full tensors with ``full_state()`` (collective) and ``load_full_(state)`` (local).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.parallel.collectives import (
    copy_to_group,
    gather_along,
    gather_seq,
    group_rank,
    group_size,
    reduce_from_group,
    reduce_scatter_seq,
    scatter_along,
)
from mimo.parallel.init import init_shard, param_seed
from mimo.parallel.sharding import ShardSpec, gather_shard, pad_to_multiple, shard_tensor

__all__ = ["TPModule", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


class TPModule(nn.Module):
    """Base of the TP layers: group bookkeeping and full <-> shard conversion."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.tp_size = group_size(group)
        self.tp_rank = group_rank(group)

    def shard_specs(self) -> dict[str, ShardSpec]:
        raise NotImplementedError

    def _new_param(self, spec: ShardSpec, device, dtype) -> nn.Parameter:
        return nn.Parameter(torch.empty(spec.local_shape(self.tp_size), device=device, dtype=dtype))

    @torch.no_grad()
    def init_weights(self, seed: int, std: float, bias_std: float = 0.0) -> None:
        """Weight ~ N(0, std), bias ~ N(0, bias_std) (zero by default), at full shape.

        ``seed`` is this layer's seed (``param_seed(base, "layers.3.mlp.fc1")``); each
        parameter derives its own from it, so any TP gives the one-process weights.
        """
        for name, spec in self.shard_specs().items():
            s = std if name == "weight" else bias_std
            local = init_shard(spec, param_seed(seed, name), self.tp_rank, self.tp_size, std=s)
            getattr(self, name).copy_(local)

    @torch.no_grad()
    def load_full_(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slices of full (unpadded) tensors into the parameters."""
        for name, spec in self.shard_specs().items():
            getattr(self, name).copy_(shard_tensor(state[name].detach().cpu(), spec, self.tp_rank, self.tp_size))

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective over the TP group: the full, unpadded parameters on every rank."""
        return {name: gather_shard(getattr(self, name).detach(), spec, self.group).clone()
                for name, spec in self.shard_specs().items()}


class ColumnParallelLinear(TPModule):
    """y = x W^T + b with W's rows (output features) split over TP.

    Input: replicated ``[T, D]``, or with SP this rank's ``[T/tp, D]``. Output: this rank's
    ``[T, F/tp]``, or replicated ``[T, F]`` with ``gather_output``. ``pad_out_features`` pads
    F to a multiple of tp with zero rows (an LM head over a vocab not divisible by tp; the
    padded columns must be ignored downstream, as vocab_parallel_cross_entropy does).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group=None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        *,
        pad_out_features: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        padded = pad_to_multiple(out_features, self.tp_size) if pad_out_features else None
        self._specs = {"weight": ShardSpec((out_features, in_features), dim=0, padded=padded)}
        if bias:
            self._specs["bias"] = ShardSpec((out_features,), dim=0, padded=padded)
        self.weight = self._new_param(self._specs["weight"], device, dtype)
        self.bias = self._new_param(self._specs["bias"], device, dtype) if bias else None
        self.padded_out_features = self._specs["weight"].padded_size

    def shard_specs(self) -> dict[str, ShardSpec]:
        return self._specs

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x_TD = gather_seq(x_TD, self.group)
        else:
            x_TD = copy_to_group(x_TD, self.group)
        y_TF = F.linear(x_TD, self.weight, self.bias)
        if self.gather_output:
            y_TF = gather_along(y_TF, -1, self.group)
            if self.padded_out_features != self.out_features:
                y_TF = y_TF[..., : self.out_features]
        return y_TF

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(TPModule):
    """y = x W^T + b with W's columns (input features) split over TP.

    Input: this rank's ``[T, D/tp]`` (``input_is_parallel``), or replicated ``[T, D]``.
    Output: replicated ``[T, F]`` (all-reduce), or with SP this rank's ``[T/tp, F]``
    (reduce-scatter). The bias is replicated and added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group=None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__(group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self._specs = {"weight": ShardSpec((out_features, in_features), dim=1)}
        if bias:
            self._specs["bias"] = ShardSpec((out_features,), dim=None)
        self.weight = self._new_param(self._specs["weight"], device, dtype)
        self.bias = self._new_param(self._specs["bias"], device, dtype) if bias else None

    def shard_specs(self) -> dict[str, ShardSpec]:
        return self._specs

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x_TD = scatter_along(x_TD, -1, self.group)
        partial_TF = F.linear(x_TD, self.weight)
        if self.sequence_parallel:
            y_TF = reduce_scatter_seq(partial_TF, self.group)
            if self.bias is not None:
                # each rank sees only its tokens, so its bias grad is partial: all-reduce it
                # in backward (keeps the replicated bias's grad complete on every rank)
                y_TF = y_TF + copy_to_group(self.bias, self.group)
            return y_TF
        y_TF = reduce_from_group(partial_TF, self.group)
        return y_TF if self.bias is None else y_TF + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(TPModule):
    """Embedding whose rows (the vocab) are split over TP.

    The vocab is padded to a multiple of tp with zero rows that no token ever reads (also the
    layout a tied ``ColumnParallelLinear(..., pad_out_features=True)`` LM head uses).
    Input: token ids ``[T]``, replicated. Output: replicated ``[T, D]``, or with SP this rank's
    ``[T/tp, D]``. Token ids must lie in ``[0, vocab_size)`` (not checked: that would cost a
    device sync; at tp > 1 an id outside it embeds to zero).
    """

    def __init__(self, vocab_size: int, dim: int, group=None, sequence_parallel: bool = False,
                 *, device=None, dtype=None):
        super().__init__(group)
        self.vocab_size, self.dim, self.sequence_parallel = vocab_size, dim, sequence_parallel
        padded = pad_to_multiple(vocab_size, self.tp_size)
        self._specs = {"weight": ShardSpec((vocab_size, dim), dim=0, padded=padded)}
        self.weight = self._new_param(self._specs["weight"], device, dtype)
        self.padded_vocab_size = padded
        per_rank = padded // self.tp_size
        # rows [start, end) of the real vocab live here; padding rows are never looked up
        self.vocab_start = self.tp_rank * per_rank
        self.vocab_end = min(self.vocab_start + per_rank, vocab_size)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return self._specs

    def forward(self, tokens_T: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(tokens_T, self.weight)
        outside_T = (tokens_T < self.vocab_start) | (tokens_T >= self.vocab_end)
        local_T = (tokens_T - self.vocab_start).masked_fill(outside_T, 0)
        partial_TD = F.embedding(local_T, self.weight).masked_fill(outside_T.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_seq(partial_TD, self.group)
        return reduce_from_group(partial_TD, self.group)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab_size}), dim={self.dim}, "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")
