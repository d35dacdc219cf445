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
from mimo.parallel.layers import AdaptedWeight, adapted_weights, experts_layer, fused_cols, fused_rows, local_parts
from mimo.parallel.lora_config import LoraConfig, LoraSpec
from mimo.parallel.placement import ParamPlacement

__all__ = ["LoraConfig", "LoraSpec", "LoraAdapter", "LoraTarget", "AdapterSite", "AdapterLayout", "adapter_layouts", "attach",
           "attach_targets", "init_magnitudes_", "adapter_sites", "merge_adapters", "merged_rows", "is_adapter_tensor",
           "ExpertLoraAdapter", "experts_layer"]


@dataclass(frozen=True)
class LoraTarget:
    """One target name of a module kind: the linear layers it adapts (module paths matching
    ``pattern``, held by a module of class ``owner`` where named), and for a fused layer the
    groups of its parts that get one adapter each."""

    pattern: str
    groups: tuple[tuple[str, ...], ...] | None = None
    owner: str | None = None
    cls: str | None = None  # the class of the matched module itself, where named


@dataclass(frozen=True)
class AdapterLayout:
    """One adapter as ``adapter_layouts`` decides it, before it is built: what it adapts
    (``adapted``), its split (module doc; None on a replicated weight, and at TP 1 but for
    experts, whose weights name their axes at any size), and for each of its tensors the
    placement and this rank's shape, with the sizes and this rank's coordinates of their axes."""

    adapted: AdaptedWeight
    split: str | None
    placements: dict[str, ParamPlacement]
    shapes: dict[str, tuple[int, ...]]
    sizes: dict[str, int]
    coords: dict[str, int]


def adapter_layouts(layer: nn.Module, spec: LoraSpec, groups: list[tuple[str, ...]] | None = None) -> list[AdapterLayout]:
    """The layout of every adapter ``layer`` takes (``adapted_weights``; ``groups``: a fused
    layer's), decided at once, before any is built: each split as the weight it adapts (module
    doc); per-expert adapters lead with the experts' dim, over ep on the expert view (their inner
    size over etp there)."""
    ctx = layer.ctx
    if ctx.gtp_size > 1 or ctx.egtp_size > 1:
        raise ConfigError("lora: adapters on GTP-sharded weights are not supported (parallel.gtp: 1, egtp: 1)")
    adapted = adapted_weights(layer, groups)
    if spec.dora and any(w.experts for w in adapted):
        raise ConfigError("lora: DoRA on the MoE experts is not built (dora: false, or leave experts out of targets)")
    folded = any(w.folded for w in adapted)
    axis, outer = ("etp", (("ep", 0),)) if folded else ("tp", ())
    axes = (axis, *(a for a, _ in outer))
    view = ctx.view(axes)
    sizes, coords = {a: view.size(a) for a in axes}, {a: view.coord(a) for a in axes}
    n, r = sizes[axis], spec.rank
    partial = (axis,) if n > 1 else ()
    layouts = []
    for w in adapted:
        lead = (w.experts,) if w.experts else ()
        split = w.split if n > 1 or w.experts else None
        parts = w.parts if len(w.parts) > 1 else ()
        shape_A, shape_B, shape_m = (*lead, r, w.in_features), (*lead, w.out_features, r), (w.out_features,)
        if split == "rows":
            placements = {"lora_A": ParamPlacement(shape_A, outer, partial),
                          "lora_B": ParamPlacement(shape_B, (*outer, (axis, len(lead))), parts=parts,
                                                   parts_dim=len(lead) if parts else None),
                          "lora_magnitude": ParamPlacement(shape_m, ((axis, 0),), parts=parts)}
        elif split == "cols":
            placements = {"lora_A": ParamPlacement(shape_A, (*outer, (axis, len(lead) + 1))),
                          "lora_B": ParamPlacement(shape_B, outer, partial),
                          "lora_magnitude": ParamPlacement(shape_m, (), partial)}
        else:
            replicas = partial if w.partial_grads else ()
            placements = {name: ParamPlacement(shape, (), replicas)
                          for name, shape in (("lora_A", shape_A), ("lora_B", shape_B), ("lora_magnitude", shape_m))}
        if not spec.dora:
            del placements["lora_magnitude"]
        shapes = {name: pl.local_shape(sizes) for name, pl in placements.items()}
        layouts.append(AdapterLayout(w, split, placements, shapes, sizes, coords))
    return layouts


class _Adapter(nn.Module):
    """What every adapter holds: ``s B A`` on a weight of full shape ``[out, in]`` (per expert),
    its tensors laid out as its ``AdapterLayout`` says, drawn by ``init_weights``."""

    def __init__(self, layout: AdapterLayout, spec: LoraSpec, ctx: ParallelContext, *, device=None, dtype=None):
        super().__init__()
        self.spec, self.ctx, self.layout, self.split = spec, ctx, layout, layout.split
        self.in_features, self.out_features = layout.adapted.in_features, layout.adapted.out_features
        for name, shape in layout.shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))

    def placements(self) -> dict[str, ParamPlacement]:
        return self.layout.placements

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """A ~ N(0, 1/in) (the variance of PEFT's default uniform draw; per expert), B = 0; this
        rank's shard of the one-process draw. DoRA's magnitude is set from the base weight
        afterwards (``init_magnitude_``)."""
        a = self.layout.placements["lora_A"]
        self.lora_A.copy_(init_local(a, self.layout.sizes, self.layout.coords, param_seed(seed, "lora_A"),
                                     std=1.0 / math.sqrt(self.in_features)))
        self.lora_B.zero_()


class LoraAdapter(_Adapter):
    """The adapter of one projection of full shape ``[out, in]``, split as its base weight is
    (module doc). Its output may be several parts of a fused weight, each split over TP on its
    own (a Hugging Face ``qkv`` over mimo's fused q | k | v), B and the magnitude split likewise;
    ``out`` is their sum."""

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


class ExpertLoraAdapter(_Adapter):
    """The adapters of one grouped expert projection, one per expert: A ``[E, r, in]``, B
    ``[E, out, r]``, split as the experts' weight is (``mimo.llm.experts``): experts over ``ep``
    on the expert view, and the inner size over etp (or tp on the dense view): B's rows for the up
    projection (``rows``, A replicated there, its gradient partial), A's columns for the down
    projection (``cols``, B's gradient partial, its output joining the partial product). No DoRA
    (a per-expert row norm): refused at attach."""

    def forward(self, x_RI: torch.Tensor, y_RO: torch.Tensor, ends_L: torch.Tensor) -> torch.Tensor:
        """``y_RO`` (the expert product of rows grouped by local expert, ``ends_L`` their ends)
        plus each row's expert's ``s B A x``."""
        from mimo.parallel.grouped import grouped_rows

        dropped_RI = F.dropout(x_RI, self.spec.dropout, self.training) if self.spec.dropout else x_RI
        u_RR = grouped_rows(dropped_RI, self.lora_A.to(x_RI.dtype), ends_L)
        return y_RO + grouped_rows(u_RR, self.lora_B.to(x_RI.dtype), ends_L) * self.spec.scale

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.spec.rank}, alpha={self.spec.alpha}"


def attach(layer: nn.Module, spec: LoraSpec, seed: int | None, groups: list[tuple[str, ...]] | None = None) -> list[str]:
    """Adapters on one tensor-parallel linear layer as ``adapter_layouts`` lays them out (a
    fused layer's per group of its parts), each initialised from ``seed`` (``init_weights``;
    None: left uninitialised, as on the meta device); returns their names under ``layer``."""
    adapters = {}
    for layout in adapter_layouts(layer, spec, groups):
        key, weight = layout.adapted.key, getattr(layer, layout.adapted.weight)
        kind = ExpertLoraAdapter if layout.adapted.experts else LoraAdapter
        adapter = adapters[key] = kind(layout, spec, layer.ctx, device=weight.device, dtype=weight.dtype)
        if seed is not None:
            adapter.init_weights(seed if key is None else param_seed(seed, key))
    if None in adapters:  # a plain layer's one adapter
        layer.lora = adapters[None]
        return ["lora"]
    if adapters:
        layer.lora = nn.ModuleDict(adapters)
    return [f"lora.{key}" for key in adapters]


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
    # (a fused layer with none of its targets' parts takes none: a non-gated MLP's gate)
    adapted = [path for path, groups in chosen.items()
               if attach(layers[path], spec, None if seed is None else param_seed(seed, path), groups)]
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
