"""Layer registry: pattern kind -> builder. Stages build their layers through it and never
know layer types.

**Builder signature** (shared by every kind)::

    build(arch: HybridArch, spec: LayerSpec, ctx: ParallelContext) -> nn.Module

``ctx`` is the LLM's ``ParallelContext`` (its TP group, whether sequence parallelism is on,
resolved once; the expert view for MoE); ``spec.index`` is the layer's global index
(layout-independent). The builder builds on CPU in fp32; the stage moves the result to its
device and dtype. ``register_layer(kind, build)`` installs a builder; kinds listed in
``PROVIDERS`` are looked up on first use as ``module.function`` (imported lazily, so
``mimo.llm.mamba2`` / ``mimo.llm.gdn`` / ``mimo.llm.mla`` plug in without this file importing them at load).

**Layer contract**

* ``forward(h_TD, seq: SeqContext) -> h_TD``, including its own pre-norm and residual add.
  Without sequence parallel ``h_TD`` is the whole local pack ``[T, D]``, replicated over TP;
  with it (``ctx.sequence_parallel``), this rank's contiguous ``[T/tp, D]`` block: gather
  before mixing tokens (e.g. ``ColumnParallelLinear``), reduce-scatter at the end
  (``RowParallelLinear``). ``seq`` describes the full local pack.
* Every sequence-mixing op honours ``seq.cu_seqlens``: nothing crosses a sample boundary
  (padding is its own trailing segment).
* With ``seq.cache`` (greedy generation, ``mimo.llm.cache``) a sequence-mixing layer keeps its
  per-sample state in ``seq.cache.state(self)`` in the prefill and, in a decode step, mixes each
  row's one new token with it; per-token layers (MLP, MoE) ignore it.
* Parameters: every sharded one is declared by its module's ``placements()``
  (``mimo.parallel.placement``); all others are replicated over TP. A replicated weight
  applied to TP-split activations (norm weights under sequence parallel, QK-norm over split
  heads, replicated Mamba-2 B/C) has a gradient that is a partial sum over TP: its placement
  says ``partial=("tp",)``, and the layer applies no collective to it: its gradient stays
  that partial sum after backward, and training sums all of them over TP once per step, in
  buckets (``mimo.training.optim.GradSync``; outside training
  ``mimo.parallel.params.reduce_partial_grads``; see ``mimo.llm.norm.RMSNorm``).
* Every matrix product with a weight goes through ``mimo.parallel.gemm.linear``; fused
  projections are stored fused (no weight concatenated in a forward).
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
from mimo.llm.norm import RMSNorm
from mimo.llm.pattern import LAYER_KINDS, LayerSpec
from mimo.parallel.context import ParallelContext

LayerBuilder = Callable[[HybridArch, LayerSpec, ParallelContext], nn.Module]

_REGISTRY: dict[str, LayerBuilder] = {}

# kind -> (module, builder function), imported on first use of the kind
PROVIDERS: dict[str, tuple[str, str]] = {
    "mamba": ("mimo.llm.mamba2", "build_mamba2"),
    "gdn": ("mimo.llm.gdn", "build_gdn"),
    "moe": ("mimo.llm.moe", "build_moe"),
    "mla": ("mimo.llm.mla", "build_mla"),
    "dsa": ("mimo.llm.dsa", "build_dsa"),
}

_SYMBOL = {kind: symbol for symbol, kind in LAYER_KINDS.items()}


def register_layer(kind: str, build: LayerBuilder) -> None:
    """Make ``build`` the builder of layer ``kind`` (a value of ``LAYER_KINDS``)."""
    if kind not in _SYMBOL:
        raise ValueError(f"unknown layer kind {kind!r}; kinds: {sorted(_SYMBOL)}")
    _REGISTRY[kind] = build


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


def build_layer(arch: HybridArch, spec: LayerSpec, ctx: ParallelContext | None = None) -> nn.Module:
    """Layer ``spec`` on ``ctx`` (default: one process, ``ParallelContext.for_tp()``)."""
    layer = layer_builder(spec.kind)(arch, spec, ParallelContext.for_tp() if ctx is None else ctx)
    if arch.norm_zero_centred:
        _zero_centre_pre_norm(layer, spec)
    return layer


def _zero_centre_pre_norm(layer: nn.Module, spec: LayerSpec) -> None:
    """``arch.norm_zero_centred`` for the kinds whose builders do not read it: the layer's
    pre-norm (``layer.norm``) becomes a zero-centred RMSNorm of the same size, eps and
    placement (attention builds its own, QK-norm included; inner gated norms stay as they are)."""
    norm = getattr(layer, "norm", None)
    if not isinstance(norm, RMSNorm):
        raise MimoError(f"norm_zero_centred: layer kind {spec.kind!r} has no RMSNorm pre-norm 'norm'")
    if not norm.zero_centred:
        layer.norm = RMSNorm(norm.dim, norm.eps, norm.ctx, partial=norm.partial, zero_centred=True)


register_layer("attention", build_attention)
register_layer("mlp", build_mlp)
