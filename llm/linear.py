"""A column-parallel projection with several named outputs (q/k/v, gate/up) in one GEMM.

Three separate ``ColumnParallelLinear`` for q, k and v would all-gather the sequence-parallel
input three times. Here the input is gathered once and multiplied by the concatenation of this
rank's slices of every part: rank r holds rows ``[r*n/tp, (r+1)*n/tp)`` of each part, exactly
what a ``ColumnParallelLinear`` per part would hold, so every part keeps its own plain
``ShardSpec`` (checkpointing and weight import see ordinary column-sharded tensors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mimo.parallel import ShardSpec, TPModule, copy_to_group, gather_seq, init_shard, param_seed


class FusedColumnParallelLinear(TPModule):
    """``y_part = x W_part^T (+ b_part)`` for each part; returns this rank's column slices.

    Parameters are ``<part>_weight`` ``[n_part, in]`` (and ``<part>_bias``). Input: replicated
    ``[T, D]``, or with sequence parallel this rank's ``[T/tp, D]``; outputs: ``[T, n_part/tp]``.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False, group=None,
                 sequence_parallel: bool = False):
        super().__init__(group)
        self.in_features, self.parts = in_features, dict(parts)
        self.sequence_parallel, self.has_bias = sequence_parallel, bias
        self._specs: dict[str, ShardSpec] = {}
        for name, out in self.parts.items():
            self._specs[f"{name}_weight"] = ShardSpec((out, in_features), dim=0)
            if bias:
                self._specs[f"{name}_bias"] = ShardSpec((out,), dim=0)
        for pname, spec in self._specs.items():
            self.register_parameter(pname, self._new_param(spec, None, None))
        self.local_sizes = [self._specs[f"{n}_weight"].local_shape(self.tp_size)[0] for n in self.parts]

    def shard_specs(self) -> dict[str, ShardSpec]:
        return self._specs

    @torch.no_grad()
    def init_weights(self, seed: int, std: float, bias_std: float = 0.0) -> None:
        for name, spec in self._specs.items():
            s = std if name.endswith("_weight") else bias_std
            getattr(self, name).copy_(init_shard(spec, param_seed(seed, name), self.tp_rank, self.tp_size, std=s))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x_TD = gather_seq(x_TD, self.group) if self.sequence_parallel else copy_to_group(x_TD, self.group)
        names = list(self.parts)
        # concatenating the (local) weights costs one weight-sized copy, far less than a GEMM
        w = torch.cat([getattr(self, f"{n}_weight") for n in names]) if len(names) > 1 else getattr(self, f"{names[0]}_weight")
        b = None
        if self.has_bias:
            b = torch.cat([getattr(self, f"{n}_bias") for n in names]) if len(names) > 1 else getattr(self, f"{names[0]}_bias")
        y_TF = F.linear(x_TD, w, b)
        return tuple(y_TF.split(self.local_sizes, dim=-1))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, parts={self.parts}, tp={self.tp_size}, bias={self.has_bias}, "
                f"sequence_parallel={self.sequence_parallel}")
