"""Full-tensor views of a module built from TP layers: TP-invariant init, load, gather.

A tower or projector mixes ``mimo.parallel`` TP layers and its own modules (LayerNorms,
position embeddings); every parameter has a placement (``param_table``: declared by its
module's ``placements()``, else replicated). These helpers walk that table once and treat
every parameter alike by its full, layout-independent name (``blocks.3.attn.qkv.weight``), so
the tower and the projectors share one implementation of "draw this rank's shard of the full
tensor", "load this rank's slices of full tensors" and "gather to full tensors" -- the three
things checkpoints, weight import and the parity tests need.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.nn as nn

from mimo.core.errors import MimoError
from mimo.parallel.init import InitFn, init_local, param_seed
from mimo.parallel.params import ParamInfo, full_tensors, param_table
from mimo.parallel.placement import read_local

__all__ = ["init_tp_invariant", "check_full_state", "load_full_", "full_state", "full_grads"]


@torch.no_grad()
def init_tp_invariant(module: nn.Module, seed: int, init_fn_for: Callable[[str, ParamInfo], InitFn]) -> None:
    """Each parameter: this rank's shard of the full tensor ``init_fn_for(name, info)`` fills
    from ``param_seed(seed, name)`` (the same values at every layout)."""
    for name, info in param_table(module).items():
        local = init_local(info.placement, info.sizes, info.coords, param_seed(seed, name), init_fn=init_fn_for(name, info))
        info.param.copy_(local)


def check_full_state(table: Mapping[str, ParamInfo], state: Mapping[str, object], what: str) -> None:
    """MimoError naming the first missing tensor or the first whose shape is not the full one."""
    for name, info in table.items():
        want = info.placement.full_shape
        if name not in state:
            raise MimoError(f"{what}: missing tensor {name!r} (expected shape {want})")
        got = tuple(state[name].shape)
        if got != want:
            raise MimoError(f"{what}: tensor {name!r} has shape {got}, expected {want}")


@torch.no_grad()
def load_full_(module: nn.Module, state: Mapping[str, object], what: str = "weights") -> None:
    """Copy this rank's slices of full tensors in (keys: full names; extra keys are ignored).

    A value is a tensor or anything indexed like one that reads lazily (a source tensor still
    in its safetensors file, ``encoders.weights``): only this rank's regions are read."""
    table = param_table(module)
    check_full_state(table, state, what)
    for name, info in table.items():
        source = state[name]
        local = read_local(lambda index: source[index], info.placement, info.sizes, info.coords, info.param.dtype)
        info.param.copy_(local)


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Collective over each TP group: the full parameters on every rank (CPU copies)."""
    return {n: t.cpu() for n, t in full_tensors(param_table(module)).items()}


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: full gradients (zeros where a parameter got none), for the parity checks."""
    return {n: t.cpu() for n, t in full_tensors(param_table(module), grads=True).items()}
