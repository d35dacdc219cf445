"""Full-tensor views of a module built from TP layers: specs, TP-invariant init, load, gather.

A module here mixes ``mimo.parallel`` TP layers (which describe their parameters with
``shard_specs()``) and plain replicated parameters (LayerNorms, position embeddings). These
helpers walk it once and treat every parameter alike by its full, layout-independent name
(``blocks.3.attn.qkv.weight``), so the tower and the projectors share one implementation of
"initialise at full shape and slice", "load this rank's slices of full tensors" and "gather to
full tensors" -- the three things checkpoints, weight import and the parity tests need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn as nn

from mimo.core.errors import MimoError
from mimo.parallel import ShardSpec, TPModule, init_shard, param_seed, shard_tensor
from mimo.parallel.params import full_tensors, param_table

__all__ = ["TPParam", "tp_params", "shard_specs", "init_tp_invariant", "load_full_", "full_state", "full_grads"]

# fills a full-shape CPU tensor in place from a generator; chosen per parameter
InitFn = Callable[[torch.Tensor, torch.Generator], object]


@dataclass(frozen=True)
class TPParam:
    name: str  # full, layout-independent name
    param: nn.Parameter  # this rank's slice (the whole tensor when replicated)
    owner: nn.Module  # the module the parameter belongs to
    spec: ShardSpec  # sharded dim and full shape (dim None: replicated)

    @property
    def group(self):
        return self.owner.group if isinstance(self.owner, TPModule) else None

    @property
    def tp_rank(self) -> int:
        return self.owner.tp_rank if isinstance(self.owner, TPModule) else 0

    @property
    def tp_size(self) -> int:
        return self.owner.tp_size if isinstance(self.owner, TPModule) else 1


def tp_params(module: nn.Module) -> list[TPParam]:
    """Every parameter of ``module`` in ``named_parameters`` order, with its shard spec."""
    out = []
    for name, param in module.named_parameters():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if isinstance(owner, TPModule):
            spec = owner.shard_specs()[attr]
        else:
            spec = ShardSpec(tuple(param.shape), dim=None)
        out.append(TPParam(name, param, owner, spec))
    return out


def shard_specs(module: nn.Module) -> dict[str, ShardSpec]:
    return {p.name: p.spec for p in tp_params(module)}


@torch.no_grad()
def init_tp_invariant(module: nn.Module, seed: int, init_fn_for: Callable[[TPParam], InitFn]) -> None:
    """Draw every parameter at full shape from ``param_seed(seed, name)``, keep this rank's slice."""
    for p in tp_params(module):
        local = init_shard(p.spec, param_seed(seed, p.name), p.tp_rank, p.tp_size, init_fn=init_fn_for(p))
        p.param.copy_(local)


def check_full_state(module: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """MimoError naming the first missing tensor or the first whose shape is not the full one."""
    for p in tp_params(module):
        if p.name not in state:
            raise MimoError(f"{what}: missing tensor {p.name!r} (expected shape {tuple(p.spec.full_shape)})")
        got = tuple(state[p.name].shape)
        if got != tuple(p.spec.full_shape):
            raise MimoError(f"{what}: tensor {p.name!r} has shape {got}, expected {tuple(p.spec.full_shape)}")


@torch.no_grad()
def load_full_(module: nn.Module, state: Mapping[str, torch.Tensor], what: str = "weights") -> None:
    """Copy this rank's slices of full tensors (keys: full names; extra keys are ignored)."""
    check_full_state(module, state, what)
    for p in tp_params(module):
        full = state[p.name].detach().to("cpu")
        p.param.copy_(shard_tensor(full, p.spec, p.tp_rank, p.tp_size))


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Collective over each TP group: the full parameters on every rank (CPU copies)."""
    return {n: t.cpu() for n, t in full_tensors(param_table(module)).items()}


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: full gradients (zeros where a parameter got none), for the parity checks."""
    return {n: t.cpu() for n, t in full_tensors(param_table(module), grads=True).items()}
