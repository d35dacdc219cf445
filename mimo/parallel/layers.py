"""Tensor-parallel layers: column / row parallel linear (plain and fused) and vocab-parallel embedding.

Weights are shaped as ``torch.nn.Linear`` ([out, in]). Activations are token-major ``[T, D]``
(packed THD sequences; leading dims other than the last are allowed without sequence
parallel). With sequence parallel (SP) the tensors between TP regions hold this rank's
contiguous token block ``[T/tp, D]``: ColumnParallelLinear all-gathers it on the way in,
RowParallelLinear and VocabParallelEmbedding reduce-scatter on the way out, so T must be a
multiple of tp (the packer pads to that).

Every layer takes its module's ``ParallelContext`` (the TP group and whether SP is on come
from it), describes its parameters with ``placements()`` (``mimo.parallel.placement``),
initialises layout-independently with ``init_weights(seed, std)`` (drawing only its shard),
converts to and from full tensors with ``full_state()`` (collective) and ``load_full_(state)``
(local), and multiplies through ``mimo.parallel.gemm.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from mimo.core.errors import ConfigError
from mimo.parallel import gemm
from mimo.parallel.collectives import (
    copy_to_group,
    gather_along,
    gather_seq,
    reduce_from_group,
    reduce_scatter_seq,
    scatter_along,
)
from mimo.parallel.context import ParallelContext
from mimo.parallel.init import init_local, param_seed
from mimo.parallel.placement import ParamPlacement, gather_full, replicated, shard_full, sharded

__all__ = ["TPModule", "ColumnParallelLinear", "FusedColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_lookup", "ReplicatedLinear", "fused_rows", "fused_parts", "fused_cols", "local_parts", "fused_adapters",
           "experts_layer", "AdaptedWeight", "adapted_weights"]


# ---------------------------------------------------------------- what adapters adapt (mimo.parallel.lora): fused rows, experts, linear layers


def fused_rows(layer: nn.Module) -> dict[str, dict[str, int]] | None:
    """A layer whose weights hold several projections' rows fused (each part split over TP by
    rows, this rank's rows of every part of a weight adjacent, in part order): weight name -> its
    parts' full sizes, in row order (Mamba-2's input rows live in two weights), from its
    ``lora_rows()``; None for any other layer."""
    rows = getattr(layer, "lora_rows", None)
    return rows() if callable(rows) else None


def fused_parts(layer: nn.Module) -> dict[str, int]:
    """Every part of a fused layer (``fused_rows``) and its full size, weight after weight."""
    return {part: n for parts in fused_rows(layer).values() for part, n in parts.items()}


def fused_cols(layer: nn.Module) -> dict[str, str]:
    """A fused layer's weights split over TP by input columns (a row-parallel projection inside
    it, its output a partial sum), each adapted whole: part name -> weight name, from its
    ``lora_cols()``; none for most layers."""
    cols = getattr(layer, "lora_cols", None)
    return cols() if callable(cols) else {}


def experts_layer(layer: nn.Module) -> dict | None:
    """A grouped-experts layer's sizes (its ``lora_experts()``), None for any other layer."""
    sizes = getattr(layer, "lora_experts", None)
    return sizes() if callable(sizes) else None


@dataclass(frozen=True)
class AdaptedWeight:
    """What one adapter of a layer adapts (``adapted_weights``): its key under the layer's
    adapters (None: the layer's one adapter), the weight holding its rows (``weight``, the first
    of two), their full sizes ``[out, in]`` and how that weight is split over TP (``rows``,
    ``cols``, None: replicated); ``parts``: its rows are several parts, each split on its own;
    ``partial_grads``: a replicated weight whose gradient is a partial sum over TP;
    ``experts``: one per expert (``[E, out, in]``), laid out on the expert view where ``folded``."""

    key: str | None
    weight: str
    in_features: int
    out_features: int
    split: str | None
    parts: tuple[int, ...] = ()
    partial_grads: bool = False
    experts: int = 0
    folded: bool = False


def adapted_weights(layer: nn.Module, groups: list[tuple[str, ...]] | None = None) -> list[AdaptedWeight]:
    """What the adapters of ``layer`` adapt, one each (``mimo.parallel.lora``): a grouped-experts
    layer's up and down projections; a fused layer's ``groups`` of parts (``_fused_weights``);
    any other tensor-parallel linear layer's weight."""
    sizes = experts_layer(layer)
    if sizes is not None:
        return _expert_weights(sizes)
    if fused_rows(layer) is not None:
        return _fused_weights(layer, groups)
    return [_linear_weight(layer)]


def _expert_weights(sizes: dict) -> list[AdaptedWeight]:
    """Grouped experts (``experts_layer``): an adapter per expert on the up (gate | up) rows, and
    on the down projection, split as the experts' weights are."""
    E, dim, ffn, gated, folded = (sizes[k] for k in ("experts", "dim", "ffn", "gated", "folded"))
    return [AdaptedWeight("up", "up_proj", dim, 2 * ffn if gated else ffn, "rows", (ffn, ffn) if gated else (),
                          experts=E, folded=folded),
            AdaptedWeight("down", "down_proj", ffn, dim, "cols", experts=E, folded=folded)]


def _fused_weights(layer: nn.Module, groups: list[tuple[str, ...]] | None) -> list[AdaptedWeight]:
    """A fused layer's adapters: one per group of its parts (consecutive, in part order;
    default: one per part), keyed by the parts joined by ``_``; a column-split weight's part
    alone, adapted as ``RowParallelLinear``'s. A group with a part the layer lacks (a non-gated
    MLP's gate) has nothing to adapt: dropped."""
    rows, parts, cols = fused_rows(layer), fused_parts(layer), fused_cols(layer)
    names = list(parts) + list(cols)
    groups = sorted((g for g in groups or [(p,) for p in names] if all(p in names for p in g)),
                    key=lambda g: names.index(g[0]))
    covered = [p for group in groups for p in group]
    if len(covered) != len(set(covered)):
        raise ValueError(f"adapter groups {groups} of {names} overlap: each part takes at most one adapter")
    out = []
    for group in groups:
        idx = [names.index(p) for p in group]
        if (idx != list(range(idx[0], idx[0] + len(idx))) or any("_" in p for p in group)
                or (len(group) > 1 and any(p in cols for p in group))):
            raise ValueError(f"adapter parts {group} must be consecutive parts of {names} without '_' "
                             f"(a column-split one alone)")
        if group[0] in cols:
            w = getattr(layer, cols[group[0]])
            out.append(AdaptedWeight(group[0], cols[group[0]], w.shape[1] * layer.ctx.tp_size, w.shape[0], "cols"))
        else:
            weight = next(name for name, held in rows.items() if group[0] in held)
            sizes = tuple(parts[p] for p in group)
            out.append(AdaptedWeight("_".join(group), weight, getattr(layer, weight).shape[1], sum(sizes), "rows", sizes))
    return out


def _linear_weight(layer: nn.Module) -> AdaptedWeight:
    """A tensor-parallel linear layer's weight, split as the layer splits it (a replicated one's
    gradient partial where the layer's is: under SP)."""
    if isinstance(layer, ColumnParallelLinear):
        if layer.padded_out_features != layer.out_features:
            raise ConfigError("lora: a layer with padded output rows (a vocab-split head) takes no adapter")
        return AdaptedWeight(None, "weight", layer.in_features, layer.out_features, "rows")
    if isinstance(layer, RowParallelLinear):
        return AdaptedWeight(None, "weight", layer.in_features, layer.out_features, "cols")
    if isinstance(layer, ReplicatedLinear):
        return AdaptedWeight(None, "weight", layer.in_features, layer.out_features, None,
                             partial_grads=layer.sequence_parallel)
    raise TypeError(f"LoRA attaches to the tensor-parallel linear layers, not {type(layer).__name__}")


def local_parts(layer: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """(part names, this rank's rows of the weights per part) of a fused layer, then its
    column-split weights (``fused_cols``), whole."""
    tp, names, weights = layer.ctx.tp_size, [], []
    for weight_name, parts in fused_rows(layer).items():
        names += list(parts)
        weights += getattr(layer, weight_name).split([n // tp for n in parts.values()], dim=0)
    for part, weight_name in fused_cols(layer).items():
        names.append(part)
        weights.append(getattr(layer, weight_name))
    return names, weights


def fused_adapters(layer: nn.Module, x_TD: torch.Tensor, ys: list[torch.Tensor]) -> list[torch.Tensor]:
    """A fused layer's per-part outputs ``ys`` (this rank's, bias not added) with its adapters'
    (``layer.lora``: one per group of consecutive parts, keyed by their names joined by ``_``;
    a column-split weight's adapter is applied by the layer itself)."""
    names, weights = local_parts(layer)
    ys = list(ys)
    cols = fused_cols(layer)
    for key, adapter in layer.lora.items():
        if key in cols:
            continue
        idx = [names.index(p) for p in key.split("_")]
        y_TP = adapter(x_TD, torch.cat([ys[i] for i in idx], -1), torch.cat([weights[i] for i in idx], 0))
        for i, piece in zip(idx, y_TP.split([ys[i].shape[-1] for i in idx], dim=-1)):
            ys[i] = piece
    return ys


class TPModule(nn.Module):
    """Base of the TP layers: the context, placements, and full <-> shard conversion."""

    def __init__(self, ctx: ParallelContext | None, sequence_parallel: bool | None = None):
        super().__init__()
        self.ctx = ctx = ParallelContext.for_tp() if ctx is None else ctx
        self.group, self.tp_size, self.tp_rank = ctx.tp, ctx.tp_size, ctx.tp_rank
        # SP as the module's context resolved it, unless this layer is told otherwise
        self.sequence_parallel = ctx.sequence_parallel if sequence_parallel is None else (
            bool(sequence_parallel) and self.tp_size > 1)
        self.recipe = gemm.default_recipe()
        # low-rank adapters (mimo.parallel.lora): a LoraAdapter on a column or row-parallel
        # layer; on a fused one a ModuleDict of them keyed by the parts each covers, joined by "_"
        self.lora = None

    def placements(self) -> dict[str, ParamPlacement]:
        raise NotImplementedError

    def _sizes_coords(self, placement: ParamPlacement):
        view = self.ctx.view(placement.axes)
        return {a: view.size(a) for a in placement.axes}, {a: view.coord(a) for a in placement.axes}

    def _new_param(self, placement: ParamPlacement, device, dtype) -> nn.Parameter:
        sizes, _ = self._sizes_coords(placement)
        param = nn.Parameter(torch.empty(placement.local_shape(sizes), device=device, dtype=dtype))
        self.ctx.gtp_register(param, placement)  # a GTP-sharded weight is gathered when used
        return param

    @torch.no_grad()
    def init_weights(self, seed: int, std: float, bias_std: float = 0.0) -> None:
        """Weights ~ N(0, std), biases ~ N(0, bias_std) (zero by default), this rank's shard only.

        ``seed`` is this layer's seed (``param_seed(base, "layers.3.mlp.fc1")``); each
        parameter derives its own from it, so any layout gives the one-process weights.
        """
        for name, placement in self.placements().items():
            s = bias_std if name == "bias" or name.endswith("_bias") else std
            local = init_local(placement, *self._sizes_coords(placement), param_seed(seed, name), std=s)
            getattr(self, name).copy_(local)

    @torch.no_grad()
    def load_full_(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slices of full (unpadded) tensors into the parameters."""
        for name, placement in self.placements().items():
            getattr(self, name).copy_(shard_full(state[name].detach().cpu(), placement, *self._sizes_coords(placement)))

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective over the TP group: the full, unpadded parameters on every rank."""
        return {name: gather_full(getattr(self, name).detach(), placement, self.ctx.view(placement.axes)).clone()
                for name, placement in self.placements().items()}


class ReplicatedLinear(TPModule):
    """y = x W^T + b with W (and b) replicated over TP, applied to the rows this rank holds with
    no collective (``mimo.llm.mla``'s down projections). Under sequence parallelism those rows are this
    rank's token block, so the weight's gradient is a partial sum over TP and its placement says
    so; without it every rank holds the whole pack and a complete gradient."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, ctx: ParallelContext | None = None):
        super().__init__(ctx)
        self.in_features, self.out_features = in_features, out_features
        partial = ("tp",) if self.sequence_parallel else ()
        self._placements = {"weight": replicated((out_features, in_features), partial=partial)}
        if bias:
            self._placements["bias"] = replicated((out_features,), partial=partial)
        self.weight = self._new_param(self._placements["weight"], None, None)
        self.bias = self._new_param(self._placements["bias"], None, None) if bias else None

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return gemm.linear(x_TD, self.weight, self.bias, self.recipe)
        y_TF = self.lora(x_TD, gemm.linear(x_TD, self.weight, None, self.recipe), self.weight)
        return y_TF if self.bias is None else y_TF + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"grad_partial_over_tp={self.sequence_parallel}")


class ColumnParallelLinear(TPModule):
    """y = x W^T + b with W's rows (output features) split over TP.

    Input: replicated ``[T, D]``, or with SP this rank's ``[T/tp, D]``. Output: this rank's
    ``[T, F/tp]``, or replicated ``[T, F]`` with ``gather_output``. ``pad_out_features`` pads
    F to a multiple of tp with zero rows (an LM head over a vocab not divisible by tp; the
    padded columns must be ignored downstream, as vocab_parallel_cross_entropy does).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, ctx: ParallelContext | None = None,
                 gather_output: bool = False, sequence_parallel: bool | None = None, *, pad_out_features: bool = False,
                 device=None, dtype=None):
        super().__init__(ctx, sequence_parallel)
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self._placements = {"weight": self.ctx.gtp_shard(sharded((out_features, in_features), 0, pad=pad_out_features))}
        if bias:
            self._placements["bias"] = sharded((out_features,), 0, pad=pad_out_features)
        self.weight = self._new_param(self._placements["weight"], device, dtype)
        self.bias = self._new_param(self._placements["bias"], device, dtype) if bias else None
        self.padded_out_features = self._placements["weight"].padded_shape({"tp": self.tp_size})[0]

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        x_TD = gather_seq(x_TD, self.group) if self.sequence_parallel else copy_to_group(x_TD, self.group)
        if self.lora is not None:
            y_TF = self.lora(x_TD, gemm.linear(x_TD, self.weight, None, self.recipe), self.weight)
            y_TF = y_TF if self.bias is None else y_TF + self.bias
        else:
            y_TF = gemm.linear(x_TD, self.weight, self.bias, self.recipe)
        if self.gather_output:
            y_TF = gather_along(y_TF, -1, self.group)
            if self.padded_out_features != self.out_features:
                y_TF = y_TF[..., : self.out_features]
        return y_TF

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class FusedColumnParallelLinear(TPModule):
    """Several column-parallel projections (q | k | v, gate | up) stored as one fused weight.

    ``weight`` is ``[sum(parts), in]`` in full; each part is split over TP on its own, so rank
    r holds rows ``[r*n/tp, (r+1)*n/tp)`` of every part, in part order (a ``parts`` placement),
    and one GEMM over the stored weight computes them all: no concatenation in the forward, and
    the SP input is gathered once. Returns this rank's ``[T, n_part/tp]`` per part.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False, ctx: ParallelContext | None = None,
                 sequence_parallel: bool | None = None, *, device=None, dtype=None):
        super().__init__(ctx, sequence_parallel)
        self.in_features, self.parts, self.has_bias = in_features, dict(parts), bias
        sizes = tuple(self.parts.values())
        self._placements = {"weight": self.ctx.gtp_shard(sharded((sum(sizes), in_features), 0, parts=sizes))}
        if bias:
            self._placements["bias"] = sharded((sum(sizes),), 0, parts=sizes)
        self.weight = self._new_param(self._placements["weight"], device, dtype)
        self.bias = self._new_param(self._placements["bias"], device, dtype) if bias else None
        self.local_sizes = [n // self.tp_size for n in sizes]

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def lora_rows(self) -> dict[str, dict[str, int]]:
        """The fused weight and its parts, for adapters per group of parts (``mimo.parallel.lora``)."""
        return {"weight": self.parts}

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x_TD = gather_seq(x_TD, self.group) if self.sequence_parallel else copy_to_group(x_TD, self.group)
        if not self.lora:
            y_TF = gemm.linear(x_TD, self.weight, self.bias, self.recipe)
            return tuple(y_TF.split(self.local_sizes, dim=-1))
        ys = fused_adapters(self, x_TD, gemm.linear(x_TD, self.weight, None, self.recipe).split(self.local_sizes, dim=-1))
        biases = self.bias.split(self.local_sizes, dim=0) if self.bias is not None else [None] * len(ys)
        out = [y_TP if b_P is None else y_TP + b_P for y_TP, b_P in zip(ys, biases)]
        return tuple(out)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, parts={self.parts}, tp={self.tp_size}, bias={self.has_bias}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(TPModule):
    """y = x W^T + b with W's columns (input features) split over TP.

    Input: this rank's ``[T, D/tp]`` (``input_is_parallel``), or replicated ``[T, D]``.
    Output: replicated ``[T, F]`` (all-reduce), or with SP this rank's ``[T/tp, F]``
    (reduce-scatter). The bias is replicated and added once, after the reduction; under SP
    each rank adds it to its own tokens only, so its gradient is a partial sum over TP.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, ctx: ParallelContext | None = None,
                 input_is_parallel: bool = True, sequence_parallel: bool | None = None, *, device=None, dtype=None):
        super().__init__(ctx, sequence_parallel)
        self.in_features, self.out_features, self.input_is_parallel = in_features, out_features, input_is_parallel
        self._placements = {"weight": self.ctx.gtp_shard(sharded((out_features, in_features), 1))}
        if bias:
            self._placements["bias"] = replicated((out_features,), partial=("tp",) if self.sequence_parallel else ())
        self.weight = self._new_param(self._placements["weight"], device, dtype)
        self.bias = self._new_param(self._placements["bias"], device, dtype) if bias else None

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x_TD = scatter_along(x_TD, -1, self.group)
        partial_TF = gemm.linear(x_TD, self.weight, None, self.recipe)
        if self.lora is not None:  # linear in the partial products: joins them before the reduction
            partial_TF = self.lora(x_TD, partial_TF, self.weight)
        if self.sequence_parallel:
            y_TF = reduce_scatter_seq(partial_TF, self.group)
            if self.bias is not None:
                # each rank sees only its tokens, so its bias grad is a partial sum over TP
                # (its placement says so: summed once per step with the other partial ones)
                y_TF = y_TF + self.bias
            return y_TF
        y_TF = reduce_from_group(partial_TF, self.group)
        return y_TF if self.bias is None else y_TF + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


def vocab_parallel_lookup(tokens_T: torch.Tensor, weight_VD: torch.Tensor, vocab_size: int, ctx: ParallelContext,
                          sequence_parallel: bool) -> torch.Tensor:
    """Rows of a vocab-split (padded) weight for token ids ``[T]``: ``VocabParallelEmbedding``'s
    lookup, also of a tied head's copy of the embedding (the same split)."""
    if ctx.tp_size == 1:
        return F.embedding(tokens_T, weight_VD)
    start = ctx.tp_rank * weight_VD.shape[0]  # rows [start, end) of the real vocab live here
    outside_T = (tokens_T < start) | (tokens_T >= min(start + weight_VD.shape[0], vocab_size))
    local_T = (tokens_T - start).masked_fill(outside_T, 0)
    partial_TD = F.embedding(local_T, weight_VD).masked_fill(outside_T.unsqueeze(-1), 0.0)
    if sequence_parallel:
        return reduce_scatter_seq(partial_TD, ctx.tp)
    return reduce_from_group(partial_TD, ctx.tp)


class VocabParallelEmbedding(TPModule):
    """Embedding whose rows (the vocab) are split over TP.

    The vocab is padded to a multiple of tp with zero rows that no token ever reads (also the
    layout a tied ``ColumnParallelLinear(..., pad_out_features=True)`` LM head uses).
    Input: token ids ``[T]``, replicated. Output: replicated ``[T, D]``, or with SP this rank's
    ``[T/tp, D]``. Token ids must lie in ``[0, vocab_size)`` (not checked: that would cost a
    device sync; at tp > 1 an id outside it embeds to zero).
    """

    def __init__(self, vocab_size: int, dim: int, ctx: ParallelContext | None = None,
                 sequence_parallel: bool | None = None, *, device=None, dtype=None):
        super().__init__(ctx, sequence_parallel)
        self.vocab_size, self.dim = vocab_size, dim
        self._placements = {"weight": sharded((vocab_size, dim), 0, pad=True)}
        self.weight = self._new_param(self._placements["weight"], device, dtype)
        self.padded_vocab_size = padded = self.weight.shape[0] * self.tp_size
        per_rank = padded // self.tp_size
        # rows [start, end) of the real vocab live here; padding rows are never looked up
        self.vocab_start = self.tp_rank * per_rank
        self.vocab_end = min(self.vocab_start + per_rank, vocab_size)

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    def forward(self, tokens_T: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(tokens_T, self.weight, self.vocab_size, self.ctx, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab_size}), dim={self.dim}, "
                f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}")
