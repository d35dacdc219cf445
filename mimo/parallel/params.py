"""Full (layout-independent) view of a module's parameters: placements, init, gather, load.

Every parameter belongs to a module that either declares its placement (``placements()``: a
``TPModule`` such as ``ColumnParallelLinear``, a layer's own sharded module, a norm whose
gradient is a partial sum under sequence parallelism) or not: then it is replicated over
every axis of its context (its full shape is its local shape). A module's context is its
``ctx`` attribute, else the one ``param_table`` is given.

On that basis ``param_table`` lists every parameter with its placement and the view of the
context its axes live in; ``init_params_`` draws each one's local shard from
``param_seed(seed, prefix + name)`` (so the weights do not depend on the layout or on the order
modules were built); ``full_tensors`` gathers parameters or gradients to full tensors
(collective over each shard axis); ``load_full_`` copies this rank's slices in from full
tensors; ``ParamInfo.is_owner`` says whether this rank's copy is the one counted in the global
norm and written to a checkpoint.

Gradients: a parameter's gradient is its ``main_grad`` where training keeps one (the run's
fp32 main-gradient buffers, ``mimo.training.optim.GradSync``), else its ``.grad``
(``main_grad``). A parameter whose placement is ``partial`` over an axis (a norm weight under
sequence parallelism) has only a partial sum there after backward: training sums those in
buckets once per step; a forward and backward outside training (a layer test, a verify tool)
calls ``reduce_partial_grads`` before reading them.

Initialisation rules: a module may define ``param_init(self, name) -> fn | None`` where
``fn(tensor, generator)`` fills a full fp32 tensor in place (norms: ones; Mamba's ``A_log``:
its own). Otherwise biases are zero and weights ``N(0, std)``, or the std given by name in
``stds`` (output projections get a smaller one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from mimo.core.errors import LayoutError
from mimo.parallel.context import AxisView, ParallelContext
from mimo.parallel.init import init_local
from mimo.parallel.placement import ParamPlacement, gather_full, replicated, shard_full


@dataclass
class TrainParam:
    """A local trainable parameter: its module, layout-independent name, the group its
    gradient is summed over, and whether this rank's copy counts in the global norm."""

    module: str
    name: str
    param: nn.Parameter
    dp_group: object | None  # gradients are summed over it; None: one rank
    counts_in_norm: bool
    weight_decay: bool = True
    partial_groups: tuple = ()  # groups over which each rank's gradient is a partial sum (TP): summed first
    # counts in the norm but for its data-parallel copies (a sharded optimizer's shards decide those)
    counts_in_shard_norm: bool = False


def main_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient a step uses: the run's fp32 main gradient where there is one, else ``.grad``."""
    g = getattr(param, "main_grad", None)
    return param.grad if g is None else g


def set_main_grad_(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Give ``param`` the gradient ``grad`` as a training backward leaves it: copied into its main
    gradient where the run keeps one, else as its ``.grad`` (a bucket with nothing to sum keeps
    autograd's own gradients: ``mimo.training.optim.GradSync``), in the weights' dtype."""
    g = getattr(param, "main_grad", None)
    if g is not None:
        g.copy_(grad)
    else:
        param.grad = grad.detach().to(device=param.device, dtype=param.dtype).clone()


@dataclass
class ParamInfo:
    param: nn.Parameter
    placement: ParamPlacement
    view: AxisView  # the view of the module's context the placement's axes live in
    module: nn.Module
    local_name: str  # the parameter's name inside ``module``

    @property
    def sizes(self) -> dict[str, int]:
        return {a: self.view.size(a) for a in self.placement.axes}

    @property
    def coords(self) -> dict[str, int]:
        return {a: self.view.coord(a) for a in self.placement.axes}

    @property
    def is_owner(self) -> bool:
        """This rank's copy is the one counted in the global norm and written to checkpoints."""
        return self.placement.is_owner(tuple(self.view.grid.shape), self.view.grid.coords(self.view.rank))

    @property
    def is_owner_but_data_parallel(self) -> bool:
        """``is_owner`` over every axis but those its gradient is summed over (dp and cp; edp on
        the expert view): the copies a sharded optimizer's shards do not tell apart already."""
        grad_axes = ("edp",) if "edp" in self.view.grid.shape else ("cp", "dp")
        axes = tuple(a for a in self.view.grid.shape if a not in grad_axes)
        return self.placement.is_owner(axes, self.view.grid.coords(self.view.rank))

    def record(self) -> dict:
        return self.placement.record(self.sizes, self.coords)

    @property
    def partial_groups(self) -> tuple:
        """The groups (of more than one rank) over which this rank's gradient is a partial sum."""
        return tuple(g for g in (self.view.group(a) for a in self.placement.partial) if g is not None)


def param_table(module: nn.Module, rename: Callable[[str], str] = lambda n: n,
                ctx: ParallelContext | None = None) -> dict[str, ParamInfo]:
    """Every parameter of ``module`` by (renamed) full name, with its placement. A submodule's
    context is its own ``ctx``, else its parent's (``ctx`` for the root without one)."""
    contexts = {"": getattr(module, "ctx", None) or ctx or ParallelContext.for_tp()}
    table: dict[str, ParamInfo] = {}
    for mod_name, mod in module.named_modules():  # parents come before their children
        placements = mod.placements() if callable(getattr(mod, "placements", None)) else {}
        mod_ctx = contexts[mod_name] = getattr(mod, "ctx", None) or contexts[mod_name.rpartition(".")[0]]
        for pname, p in mod.named_parameters(recurse=False):
            full = rename(f"{mod_name}.{pname}" if mod_name else pname)
            placement = placements.get(pname) or replicated(tuple(p.shape))
            table[full] = ParamInfo(p, placement, mod_ctx.view(placement.axes), mod, pname)
    return table


def _init_fn(info: ParamInfo, std: float):
    custom = getattr(info.module, "param_init", None)
    fn = custom(info.local_name) if callable(custom) else None
    if fn is not None:
        return {"init_fn": fn}
    if info.local_name == "bias" or info.local_name.endswith("_bias"):
        return {"std": 0.0}
    return {"std": std}


@torch.no_grad()
def init_params_(table: Mapping[str, ParamInfo], seed: int, std: float, stds: Mapping[str, float] = {}) -> None:
    """Layout-independent random init of every parameter in ``table``, local shards only."""
    from mimo.parallel.init import param_seed

    for name, info in table.items():
        local = init_local(info.placement, info.sizes, info.coords, param_seed(seed, name),
                           **_init_fn(info, stds.get(name, std)))
        info.param.copy_(local)


@torch.no_grad()
def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of ``module`` by full name (its state beside the parameters)."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return {name: t for name, t in module.state_dict(keep_vars=True).items() if name not in params}


def full_tensors(table: Mapping[str, ParamInfo], grads: bool = False) -> dict[str, torch.Tensor]:
    """Full, unpadded parameters (or gradients; zeros where none) on every rank.

    Collective over every shard axis in the table: all its ranks call it together.
    """
    out = {}
    for name, info in table.items():
        t = info.param
        if grads:
            g = main_grad(t)
            t = g if g is not None else torch.zeros_like(t)
        out[name] = gather_full(t.detach(), info.placement, info.view).clone()
    return out


@torch.no_grad()
def reduce_partial_grads(table: Mapping[str, ParamInfo]) -> None:
    """Sum every partial gradient of ``table`` over its partial axes, in place (one all-reduce
    per parameter): after a forward and backward outside training, what training's bucketed
    once-per-step sum does (``mimo.training.optim.GradSync``). A parameter without a gradient
    takes part as zeros. Collective over each such group: all its ranks call it together."""
    seen: set[int] = set()
    for info in table.values():
        p, groups = info.param, info.partial_groups
        if not groups or not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        grad = main_grad(p)
        if grad is None:
            p.grad = grad = torch.zeros_like(p)
        for group in groups:
            dist.all_reduce(grad, group=group)


@torch.no_grad()
def load_full_(table: Mapping[str, ParamInfo], state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Copy this rank's slices of full tensors into the parameters of ``table``."""
    missing = [n for n in table if n not in state]
    if strict and missing:
        raise LayoutError(f"no tensor for parameter {missing[0]!r} ({len(missing)} missing)")
    for name, info in table.items():
        if name not in state:
            continue
        full = state[name]
        if tuple(full.shape) != info.placement.full_shape:
            raise LayoutError(f"parameter {name!r}: expected shape {info.placement.full_shape}, got {tuple(full.shape)}")
        info.param.copy_(shard_full(full.detach(), info.placement, info.sizes, info.coords))  # copy_ converts device and dtype
