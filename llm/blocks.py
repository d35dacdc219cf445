"""Layer registry: pattern kind -> builder. Stages build their layers through it and never
know layer types.

**Builder signature** (shared by every kind)::

    build(arch: HybridArch, spec: LayerSpec, tp_group, sequence_parallel: bool) -> nn.Module

``tp_group`` is the module's TP process group (``None`` for tp = 1); ``spec.index`` is the
layer's global index (layout-independent). The builder builds on CPU in fp32; the stage moves
the result to its device and dtype. ``register_layer(kind, build)`` installs a builder; kinds
listed in ``PROVIDERS`` are looked up on first use as ``module.function`` (imported lazily,
so ``mimo.llm.mamba2`` / ``mimo.llm.gdn`` plug in without this file importing them at load).

**Layer contract**

* ``forward(h_TD, ctx: SeqContext) -> h_TD``, including its own pre-norm and residual add.
  Without sequence parallel ``h_TD`` is the whole local pack ``[T, D]``, replicated over TP;
  with it, this rank's contiguous ``[T/tp, D]`` block: gather before mixing tokens (e.g.
  ``ColumnParallelLinear(sequence_parallel=True)``), reduce-scatter at the end
  (``RowParallelLinear(sequence_parallel=True)``). ``ctx`` describes the full local pack.
* Every sequence-mixing op honours ``ctx.cu_seqlens``: nothing crosses a sample boundary
  (padding is its own trailing segment).
* Parameters: sharded ones live in modules with ``shard_specs()`` (``TPModule``); all others
  are replicated over TP and must hold complete gradients on every TP rank after backward —
  a replicated weight applied to TP-split activations (norm weights under sequence parallel,
  QK-norm over split heads) goes through ``copy_to_group`` (see ``mimo.llm.norm.RMSNorm``).
* ``init_weights(seed, std, out_std=None)``: TP-invariant random init from the layer's seed
  (the stage passes ``param_seed(base_seed, "layers.<index>")``); ``out_std`` is for
  projections writing into the residual stream. ``mimo.parallel.params.init_params_`` does it
  generically.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch.nn as nn

from mimo.core.errors import MimoError
from mimo.llm.attention import build_attention
from mimo.llm.config import HybridArch
from mimo.llm.mlp import build_mlp
from mimo.llm.pattern import LAYER_KINDS, LayerSpec

LayerBuilder = Callable[[HybridArch, LayerSpec, object, bool], nn.Module]

_REGISTRY: dict[str, LayerBuilder] = {}

# kind -> (module, builder function), imported on first use of the kind
PROVIDERS: dict[str, tuple[str, str]] = {
    "mamba": ("mimo.llm.mamba2", "build_mamba2"),
    "gdn": ("mimo.llm.gdn", "build_gdn"),
}

_SYMBOL = {kind: symbol for symbol, kind in LAYER_KINDS.items()}


def register_layer(kind: str, build: LayerBuilder) -> None:
    """Make ``build`` the builder of layer ``kind`` (a value of ``LAYER_KINDS``)."""
    if kind not in _SYMBOL:
        raise ValueError(f"unknown layer kind {kind!r}; kinds: {sorted(_SYMBOL)}")
    _REGISTRY[kind] = build


def _moe_not_supported(arch: HybridArch, spec: LayerSpec, tp_group, sequence_parallel: bool) -> nn.Module:
    raise MimoError(f"MoE layers ('E', layer {spec.index}) are not supported yet")


def layer_builder(kind: str) -> LayerBuilder:
    if kind not in _REGISTRY and kind in PROVIDERS:
        module_name, fn_name = PROVIDERS[kind]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
        else:  # the module may have registered itself on import; else take its builder
            if kind not in _REGISTRY and callable(getattr(module, fn_name, None)):
                _REGISTRY[kind] = getattr(module, fn_name)
    if kind not in _REGISTRY:
        raise MimoError(f"layer kind {kind!r} ({_SYMBOL.get(kind, '?')!s}) is not available in this version of mimo")
    return _REGISTRY[kind]


def build_layer(arch: HybridArch, spec: LayerSpec, tp_group=None, sequence_parallel: bool = False) -> nn.Module:
    return layer_builder(spec.kind)(arch, spec, tp_group, sequence_parallel)


register_layer("attention", build_attention)
register_layer("mlp", build_mlp)
register_layer("moe", _moe_not_supported)  # the seam: the MoE engine registers here later
