"""Low-rank adapters (LoRA, and DoRA) on the tensor-parallel linear layers.

An adapter adds ``s * B A x`` to a projection ``y = W x`` (``s = alpha / rank``; A ``[r, in]``,
B ``[out, r]``, B zero at the start so that the model starts as its base). Its weights are split
as the base weight is, so that no rank computes what another holds:

* ``rows`` (column-parallel base, W's output rows split over TP): B's rows split with W's, A
  replicated. A rank's A gradient covers only its output rows: a partial sum over TP, summed
  once per step like every ``partial`` gradient.
* ``cols`` (row-parallel base, W's input columns split): A's columns split with W's, B
  replicated; the adapter's output joins the partial product before the TP reduction, so B's
  gradient is partial too.
* ``None``: a replicated base (TP 1, or a layer outside TP): both replicated.

DoRA (weight-decomposed LoRA) scales each output row by ``m / ||W + s B A||``, the norm over the
row's input features taken without gradient, as the DoRA paper (section 4.3) and PEFT do:
``y = g * (W x + s B A x)`` with ``g = m / norm`` (a row-parallel weight's norm sums its
shards' squares over TP). ``m`` starts at the base rows' norms (``init_magnitude_``, after the
base weights are loaded) and is split as B is.

Dropout (``dropout > 0``) drops the adapter's input only; each rank draws its own mask, so runs
with dropout are not layout-independent (verify layouts at 0).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mimo.core.errors import ConfigError
from mimo.parallel.context import ParallelContext
from mimo.parallel.init import init_local, param_seed
from mimo.parallel.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, fused_cols, fused_parts, fused_rows, local_parts
from mimo.parallel.lora_config import LoraConfig, LoraSpec
from mimo.parallel.placement import ParamPlacement, replicated, sharded

__all__ = ["LoraConfig", "LoraSpec", "LoraAdapter", "LoraTarget", "AdapterSite", "attach", "attach_targets", "init_magnitudes_",
           "adapter_sites", "merge_adapters", "merged_rows", "is_adapter_tensor", "ExpertLoraAdapter", "experts_layer"]


@dataclass(frozen=True)
class LoraTarget:
    """One target name of a module kind: the linear layers it adapts (module paths matching
    ``pattern``, held by a module of class ``owner`` where named), and for a fused layer the
    groups of its parts that get one adapter each."""

    pattern: str
    groups: tuple[tuple[str, ...], ...] | None = None
    owner: str | None = None
    cls: str | None = None  # the class of the matched module itself, where named


class LoraAdapter(nn.Module):
    """The adapter of one projection of full shape ``[out, in]``. ``split``: how the base weight is
    split over TP (module doc). ``parts``: the output is several parts of a fused weight, each
    split over TP on its own (a Hugging Face ``qkv`` over mimo's fused q | k | v), B and the
    magnitude split likewise; ``out`` is their sum."""

    def __init__(self, in_features: int, out_features: int, spec: LoraSpec, ctx: ParallelContext, split: str | None,
                 *, parts: tuple[int, ...] = (), partial_grads: bool = False, device=None, dtype=None):
        super().__init__()
        if split not in ("rows", "cols", None):
            raise ValueError(f"split must be rows, cols or None, got {split!r}")
        self.spec, self.ctx, self.in_features, self.out_features = spec, ctx, in_features, out_features
        tp = ctx.tp_size > 1
        self.split = split if tp else None
        r = spec.rank
        partial = ("tp",) if tp else ()
        if self.split == "rows":
            parts = tuple(parts) if len(parts) > 1 else ()
            self._placements = {"lora_A": replicated((r, in_features), partial),
                                "lora_B": sharded((out_features, r), 0, parts=parts)}
            magnitude = sharded((out_features,), 0, parts=parts)
        elif self.split == "cols":
            self._placements = {"lora_A": sharded((r, in_features), 1), "lora_B": replicated((out_features, r), partial)}
            magnitude = replicated((out_features,), partial)
        else:  # a replicated weight; ``partial_grads``: its gradient a partial sum over TP (each rank its own rows)
            partial = partial if partial_grads else ()
            self._placements = {"lora_A": replicated((r, in_features), partial), "lora_B": replicated((out_features, r), partial)}
            magnitude = replicated((out_features,), partial)
        if spec.dora:
            self._placements["lora_magnitude"] = magnitude
        for name, placement in self._placements.items():
            setattr(self, name, nn.Parameter(torch.empty(self._local_shape(placement), device=device, dtype=dtype)))

    def _view(self, placement: ParamPlacement):
        view = self.ctx.view(placement.axes)
        return {a: view.size(a) for a in placement.axes}, {a: view.coord(a) for a in placement.axes}

    def _local_shape(self, placement: ParamPlacement) -> tuple[int, ...]:
        return placement.local_shape(self._view(placement)[0])

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """A ~ N(0, 1/in) (the variance of PEFT's default uniform draw), B = 0; this rank's
        shard of the one-process draw. DoRA's magnitude is set from the base weight afterwards
        (``init_magnitude_``)."""
        a = self._placements["lora_A"]
        self.lora_A.copy_(init_local(a, *self._view(a), param_seed(seed, "lora_A"), std=1.0 / math.sqrt(self.in_features)))
        self.lora_B.zero_()

    @torch.no_grad()
    def init_magnitude_(self, weight_OI: torch.Tensor) -> None:
        """DoRA: m = ||W + s B A|| per output row of this rank's base shard ``weight_OI``."""
        if self.spec.dora:
            self.lora_magnitude.copy_(self.row_norm(weight_OI).to(self.lora_magnitude.dtype))

    @torch.no_grad()
    def row_norm(self, weight_OI: torch.Tensor) -> torch.Tensor:
        """``||W + s B A||`` per output row (float32 at least), over all of the row's input
        features: a row-parallel shard's squares are summed over TP."""
        wide = torch.promote_types(weight_OI.dtype, torch.float32)
        merged = weight_OI.to(wide) + self.spec.scale * (self.lora_B.to(wide) @ self.lora_A.to(wide))
        squares_O = merged.square().sum(1)
        if self.split == "cols":
            dist.all_reduce(squares_O, group=self.ctx.tp)
        return squares_O.sqrt()

    def delta_weight(self) -> torch.Tensor:
        """``s B A`` of this rank's shard (a merge adds it to the base weight's shard)."""
        return self.spec.scale * (self.lora_B @ self.lora_A)

    def forward(self, x_TI: torch.Tensor, y_TO: torch.Tensor, weight_OI: torch.Tensor) -> torch.Tensor:
        """The projection's output with the adapter: ``x_TI`` the base product's input (this
        rank's columns for a row-parallel one), ``y_TO`` its output without bias (a partial sum
        for a row-parallel one), ``weight_OI`` its weight (this rank's shard)."""
        dropped_TI = F.dropout(x_TI, self.spec.dropout, self.training) if self.spec.dropout else x_TI
        u_TR = F.linear(dropped_TI, self.lora_A.to(x_TI.dtype))
        lora_TO = F.linear(u_TR, self.lora_B.to(x_TI.dtype)) * self.spec.scale
        if not self.spec.dora:
            return y_TO + lora_TO
        g_O = (self.lora_magnitude / self.row_norm(weight_OI.detach())).to(y_TO.dtype)
        if dropped_TI is not x_TI:  # as PEFT: the magnitude's rescaling of the base acts on the dropped input
            return y_TO + (g_O - 1) * F.linear(dropped_TI, weight_OI.detach()) + g_O * lora_TO
        return g_O * (y_TO + lora_TO)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, rank={self.spec.rank}, alpha={self.spec.alpha}, "
                f"split={self.split}, dora={self.spec.dora}")


class ExpertLoraAdapter(nn.Module):
    """The adapters of one grouped expert projection, one per expert: A ``[E, r, in]``, B
    ``[E, out, r]``, split as the experts' weight is (``mimo.llm.experts``): experts over ``ep``
    on the expert view, and the inner size over etp (or tp on the dense view): B's rows for the up
    projection (``rows``, A replicated there, its gradient partial), A's columns for the down
    projection (``cols``, B's gradient partial, its output joining the partial product). No DoRA
    (a per-expert row norm): refused at attach."""

    def __init__(self, experts: int, in_features: int, out_features: int, spec: LoraSpec, ctx: ParallelContext,
                 split: str, folded: bool, *, parts: tuple[int, ...] = (), device=None, dtype=None):
        super().__init__()
        self.spec, self.ctx, self.in_features, self.out_features = spec, ctx, in_features, out_features
        inner = "etp" if folded else "tp"
        view_size = ctx.expert.size("etp") if folded else ctx.tp_size
        outer = (("ep", 0),) if folded else ()
        partial = (inner,) if view_size > 1 else ()
        r = spec.rank
        if split == "rows":
            self._placements = {
                "lora_A": ParamPlacement((experts, r, in_features), outer, partial),
                "lora_B": ParamPlacement((experts, out_features, r), (*outer, (inner, 1)), (), False, tuple(parts),
                                         1 if parts else None)}
        else:
            self._placements = {"lora_A": ParamPlacement((experts, r, in_features), (*outer, (inner, 2))),
                                "lora_B": ParamPlacement((experts, out_features, r), outer, partial)}
        view = ctx.view(tuple(a for pl in self._placements.values() for a in pl.axes))
        for name, pl in self._placements.items():
            shape = pl.local_shape({a: view.size(a) for a in pl.axes})
            setattr(self, name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))

    def placements(self) -> dict[str, ParamPlacement]:
        return self._placements

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """As ``LoraAdapter``: A ~ N(0, 1/in) per expert (this rank's tile of the full draw), B = 0."""
        a = self._placements["lora_A"]
        view = self.ctx.view(a.axes)
        sizes, coords = {x: view.size(x) for x in a.axes}, {x: view.coord(x) for x in a.axes}
        self.lora_A.copy_(init_local(a, sizes, coords, param_seed(seed, "lora_A"), std=1.0 / math.sqrt(self.in_features)))
        self.lora_B.zero_()

    def forward(self, x_RI: torch.Tensor, y_RO: torch.Tensor, ends_L: torch.Tensor) -> torch.Tensor:
        """``y_RO`` (the expert product of rows grouped by local expert, ``ends_L`` their ends)
        plus each row's expert's ``s B A x``."""
        from mimo.parallel.grouped import grouped_rows

        dropped_RI = F.dropout(x_RI, self.spec.dropout, self.training) if self.spec.dropout else x_RI
        u_RR = grouped_rows(dropped_RI, self.lora_A.to(x_RI.dtype), ends_L)
        return y_RO + grouped_rows(u_RR, self.lora_B.to(x_RI.dtype), ends_L) * self.spec.scale

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.spec.rank}, alpha={self.spec.alpha}"


def experts_layer(layer: nn.Module) -> dict | None:
    """A grouped-experts layer's sizes (its ``lora_experts()``), None for any other layer."""
    sizes = getattr(layer, "lora_experts", None)
    return sizes() if callable(sizes) else None


def attach(layer: nn.Module, spec: LoraSpec, seed: int | None, groups: list[tuple[str, ...]] | None = None) -> list[str]:
    """Adapters on one tensor-parallel linear layer, initialised from ``seed`` (``init_weights``;
    None: left uninitialised, as on the meta device); returns their names under ``layer``. A fused layer gets one adapter per group of its parts
    (consecutive, in part order; default: one per part), keyed by the parts joined by ``_``."""
    if layer.ctx.gtp_size > 1 or layer.ctx.egtp_size > 1:
        raise ConfigError("lora: adapters on GTP-sharded weights are not supported (parallel.gtp: 1, egtp: 1)")
    sizes = experts_layer(layer)
    if sizes is not None:
        if spec.dora:
            raise ConfigError("lora: DoRA on the MoE experts is not built (dora: false, or leave experts out of targets)")
        weight = layer.up_proj
        dd = {"device": weight.device, "dtype": weight.dtype}
        E, dim, ffn, gated, folded = (sizes[k] for k in ("experts", "dim", "ffn", "gated", "folded"))
        layer.lora = nn.ModuleDict({
            "up": ExpertLoraAdapter(E, dim, 2 * ffn if gated else ffn, spec, layer.ctx, "rows", folded,
                                    parts=(ffn, ffn) if gated else (), **dd),
            "down": ExpertLoraAdapter(E, ffn, dim, spec, layer.ctx, "cols", folded, **dd)})
        if seed is not None:
            for key, adapter in layer.lora.items():
                adapter.init_weights(param_seed(seed, key))
        return ["lora.up", "lora.down"]
    rows = fused_rows(layer)
    if rows is not None:
        parts, cols = fused_parts(layer), fused_cols(layer)
        weight = getattr(layer, next(iter(rows)))
        dd = {"device": weight.device, "dtype": weight.dtype}
        names = list(parts) + list(cols)
        groups = groups or [(p,) for p in names]
        covered = [p for group in groups for p in group]
        if len(covered) != len(set(covered)):
            raise ValueError(f"adapter groups {groups} of {names} overlap: each part takes at most one adapter")
        layer.lora = nn.ModuleDict()
        for group in groups:
            idx = [names.index(p) for p in group]
            if (idx != list(range(idx[0], idx[0] + len(idx))) or any("_" in p for p in group)
                    or (len(group) > 1 and any(p in cols for p in group))):
                raise ValueError(f"adapter parts {group} must be consecutive parts of {names} without '_' "
                                 f"(a column-split one alone)")
            if group[0] in cols:  # a row-parallel projection inside the layer: adapted as RowParallelLinear's
                w = getattr(layer, cols[group[0]])
                adapter = LoraAdapter(w.shape[1] * layer.ctx.tp_size, w.shape[0], spec, layer.ctx, "cols", **dd)
            else:
                sizes = tuple(parts[p] for p in group)
                adapter = LoraAdapter(weight.shape[1], sum(sizes), spec, layer.ctx, "rows", parts=sizes, **dd)
            if seed is not None:
                adapter.init_weights(param_seed(seed, "_".join(group)))
            layer.lora["_".join(group)] = adapter
        return [f"lora.{key}" for key in layer.lora]
    dd = {"device": layer.weight.device, "dtype": layer.weight.dtype}
    partial_grads = False
    if isinstance(layer, ColumnParallelLinear):
        if layer.padded_out_features != layer.out_features:
            raise ConfigError("lora: a layer with padded output rows (a vocab-split head) takes no adapter")
        split = "rows"
    elif isinstance(layer, RowParallelLinear):
        split = "cols"
    elif isinstance(layer, ReplicatedLinear):  # replicated as its weight, partial where its gradient is
        split, partial_grads = None, layer.sequence_parallel
    else:
        raise TypeError(f"LoRA attaches to the tensor-parallel linear layers, not {type(layer).__name__}")
    layer.lora = LoraAdapter(layer.in_features, layer.out_features, spec, layer.ctx, split, partial_grads=partial_grads, **dd)
    if seed is not None:
        layer.lora.init_weights(seed)
    return ["lora"]


@torch.no_grad()
def init_magnitudes_(root: nn.Module) -> None:
    """DoRA: every adapter's magnitude from its base weight as it is now (after the base weights
    are loaded; a no-op for plain LoRA)."""
    for module in root.modules():
        lora = getattr(module, "lora", None)
        if isinstance(lora, LoraAdapter):
            lora.init_magnitude_(module.weight)
        elif isinstance(lora, nn.ModuleDict) and fused_rows(module) is not None:
            names, weights = local_parts(module)
            for key, adapter in lora.items():
                adapter.init_magnitude_(torch.cat([weights[names.index(p)] for p in key.split("_")], 0))


def attach_targets(root: nn.Module, spec: LoraSpec, seed: int | None, table: dict[str, LoraTarget], targets: list[str],
                   what: str) -> list[str]:
    """Adapters on every layer of ``root`` that one of ``targets`` (names of ``table``) selects,
    each initialised from ``param_seed(seed, its module path)``; every other parameter of ``root``
    frozen, the adapters trained. Returns the adapted module paths. ``what`` names the module in
    errors (``modules.vision.lora``)."""
    unknown = [t for t in targets if t not in table]
    if unknown:
        raise ConfigError(f"{what}.targets: {', '.join(unknown)} not among this module's projections "
                          f"({', '.join(table)})")
    root.requires_grad_(False)
    chosen: dict[str, list[tuple[str, ...]] | None] = {}
    layers = dict(root.named_modules())
    for name in targets:
        target = table[name]
        hits = [path for path in layers if re.fullmatch(target.pattern, path)
                and (target.owner is None or _is_a(layers[path.rpartition(".")[0]], target.owner))
                and (target.cls is None or type(layers[path]).__name__ == target.cls)]
        for path in hits:
            if target.groups is None:
                chosen[path] = None
            else:
                chosen.setdefault(path, [])
                chosen[path] += list(target.groups)
    adapted = []
    for path, groups in chosen.items():
        layer = layers[path]
        if fused_rows(layer) is not None:
            order = list(fused_parts(layer)) + list(fused_cols(layer))
            # (a part the layer lacks has nothing to adapt: a non-gated MLP's gate)
            groups = [g for g in groups or [(p,) for p in order] if all(p in order for p in g)]
            if not groups:
                continue
            groups = sorted(groups, key=lambda g: order.index(g[0]))
        attach(layer, spec, None if seed is None else param_seed(seed, path), groups)
        adapted.append(path)
    for module in root.modules():
        lora = getattr(module, "lora", None)
        if lora is not None:
            lora.requires_grad_(True)
    return adapted


# ---------------------------------------------------------------- adapters on full tensors (export)


@dataclass(frozen=True)
class AdapterSite:
    """Where one adapter sits in its module's full (one-process) state: its tensors are
    ``<adapter>.lora_A`` ``[r, in]``, ``.lora_B`` ``[out, r]`` (DoRA: ``.lora_magnitude``
    ``[out]``); its rows ``first:first + hi - lo`` adapt rows ``lo:hi`` of the full weight
    ``weight`` ``[out, in]`` (an adapter on the rows of two weights has a site on each)."""

    adapter: str
    weight: str
    rows: tuple[int, int]
    spec: LoraSpec
    first: int = 0  # the adapter's row (of B, of the magnitude) that the weight's row lo takes


def adapter_sites(root: nn.Module) -> list[AdapterSite]:
    """Every adapter of ``root`` (adapters attached, any device, the meta one included), by
    the full names of a one-process module's state."""
    sites = []
    for path, module in root.named_modules():
        lora = getattr(module, "lora", None)
        prefix = f"{path}." if path else ""
        if isinstance(lora, LoraAdapter):
            sites.append(AdapterSite(f"{prefix}lora", f"{prefix}weight", (0, lora.out_features), lora.spec))
        elif isinstance(lora, nn.ModuleDict) and experts_layer(module) is not None:
            for key, adapter in lora.items():  # per expert, on every row of the expert's weight
                sites.append(AdapterSite(f"{prefix}lora.{key}", f"{prefix}{key}_proj", (0, adapter.out_features), adapter.spec))
        elif isinstance(lora, nn.ModuleDict) and fused_rows(module) is not None:
            for key, adapter in lora.items():
                if key in fused_cols(module):  # a whole row-parallel weight
                    sites.append(AdapterSite(f"{prefix}lora.{key}", prefix + fused_cols(module)[key],
                                             (0, adapter.out_features), adapter.spec))
                    continue
                group, first = key.split("_"), 0
                for weight_name, parts in fused_rows(module).items():
                    starts = dict(zip(parts, itertools.accumulate(parts.values(), initial=0)))
                    mine = [p for p in parts if p in group]
                    if mine:
                        lo = starts[mine[0]]
                        hi = lo + sum(parts[p] for p in mine)
                        sites.append(AdapterSite(f"{prefix}lora.{key}", prefix + weight_name, (lo, hi), adapter.spec, first))
                        first += hi - lo
    return sites


@torch.no_grad()
def merged_rows(site: AdapterSite, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The adapted rows of ``site``'s weight, ``W + s B A`` (DoRA: each row rescaled to its
    magnitude), computed in float32 at least and returned in the weight's dtype."""
    weight = state[site.weight]
    lo, hi = site.rows
    mine = slice(site.first, site.first + hi - lo)  # the adapter's rows on this weight
    wide = torch.promote_types(weight.dtype, torch.float32)
    A, B = state[f"{site.adapter}.lora_A"].to(wide), state[f"{site.adapter}.lora_B"][..., mine, :].to(wide)
    merged_OI = weight[..., lo:hi, :].to(wide) + site.spec.scale * (B @ A)  # (an expert weight: per expert)
    if site.spec.dora:
        m_O = state[f"{site.adapter}.lora_magnitude"][mine].to(wide)
        merged_OI = m_O[:, None] * merged_OI / merged_OI.norm(dim=1, keepdim=True)
    return merged_OI.to(weight.dtype)


def merge_adapters(state: dict[str, torch.Tensor], sites: list[AdapterSite]) -> dict[str, torch.Tensor]:
    """A full state with every adapter folded into its base weight (``merged_rows``) and the
    adapters' tensors gone: the module as it computes, without adapters."""
    out = dict(state)
    for site in sites:
        weight = out[site.weight] = out[site.weight].clone() if out[site.weight] is state[site.weight] else out[site.weight]
        weight[..., site.rows[0]:site.rows[1], :] = merged_rows(site, state)
    return {name: t for name, t in out.items() if not is_adapter_tensor(name)}


def is_adapter_tensor(name: str) -> bool:
    return name.rpartition(".")[2] in ("lora_A", "lora_B", "lora_magnitude")


def _is_a(module, class_name: str) -> bool:
    """Whether ``module`` is of the class named (or a subclass of it: DSA layers are MLA layers)."""
    return any(c.__name__ == class_name for c in type(module).__mro__)
