"""Full (layout-independent) view of a module's parameters: init, gather, load.

Every parameter of an LLM stage is one of:

* owned by a module with ``shard_specs()`` (a ``TPModule``: ``ColumnParallelLinear``, ...,
  or a layer's own sharded module): sharded as its ``ShardSpec`` says, over that module's
  ``group``;
* anything else: replicated over TP (its full shape is its local shape).

On that basis ``param_table`` lists every parameter with its spec; ``init_params_`` draws each
one at full shape from ``param_seed(seed, prefix + name)`` and keeps this rank's slice (so the
weights do not depend on TP, PP, or the order modules were built); ``full_tensors`` gathers
parameters or gradients to full tensors (collective over each TP group); ``load_full_``
copies this rank's slices in from full tensors.

Initialisation rules: a module may define ``param_init(self, name) -> fn | None`` where
``fn(tensor, generator)`` fills a full fp32 tensor in place (norms: ones; Mamba's ``A_log``:
its own). Otherwise biases are zero and weights ``N(0, std)``, or the std given by name in
``stds`` (output projections get a smaller one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn as nn

from mimo.core.errors import LayoutError
from mimo.parallel import ShardSpec, gather_shard, group_rank, group_size, init_full, param_seed, shard_tensor


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


@dataclass
class ParamInfo:
    param: nn.Parameter
    spec: ShardSpec
    group: object  # TP group the spec shards over (None: replicated / one rank)
    module: nn.Module
    local_name: str  # the parameter's name inside ``module``


def param_table(module: nn.Module, rename: Callable[[str], str] = lambda n: n) -> dict[str, ParamInfo]:
    """Every parameter of ``module`` by (renamed) full name, with how it is sharded."""
    table: dict[str, ParamInfo] = {}
    for mod_name, mod in module.named_modules():
        specs = mod.shard_specs() if callable(getattr(mod, "shard_specs", None)) else {}
        for pname, p in mod.named_parameters(recurse=False):
            full = rename(f"{mod_name}.{pname}" if mod_name else pname)
            if pname in specs:
                table[full] = ParamInfo(p, specs[pname], getattr(mod, "group", None), mod, pname)
            else:
                table[full] = ParamInfo(p, ShardSpec(tuple(p.shape), None), None, mod, pname)
    return table


def _init_fn(info: ParamInfo, std: float):
    custom = getattr(info.module, "param_init", None)
    fn = custom(info.local_name) if callable(custom) else None
    if fn is not None:
        return fn
    if info.local_name == "bias" or info.local_name.endswith("_bias"):
        return lambda t, gen: t.zero_()
    return lambda t, gen: t.normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_params_(table: Mapping[str, ParamInfo], seed: int, std: float, stds: Mapping[str, float] = {}) -> None:
    """TP-invariant random init of every parameter in ``table`` (see module doc)."""
    for name, info in table.items():
        full = init_full(info.spec.full_shape, param_seed(seed, name), init_fn=_init_fn(info, stds.get(name, std)))
        local = shard_tensor(full, info.spec, group_rank(info.group), group_size(info.group))
        info.param.copy_(local)


@torch.no_grad()
def full_tensors(table: Mapping[str, ParamInfo], grads: bool = False) -> dict[str, torch.Tensor]:
    """Full, unpadded parameters (or gradients; zeros where none) on every rank.

    Collective over every TP group in the table: all its ranks call it together.
    """
    out = {}
    for name, info in table.items():
        t = info.param
        if grads:
            t = t.grad if t.grad is not None else torch.zeros_like(t)
        out[name] = gather_shard(t.detach(), info.spec, info.group).clone()
    return out


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
        if tuple(full.shape) != tuple(info.spec.full_shape):
            raise LayoutError(f"parameter {name!r}: expected shape {tuple(info.spec.full_shape)}, got {tuple(full.shape)}")
        local = shard_tensor(full.detach(), info.spec, group_rank(info.group), group_size(info.group))
        info.param.copy_(local)  # copy_ converts device and dtype
