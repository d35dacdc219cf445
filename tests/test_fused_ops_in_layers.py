"""The GPU-only ops inside real layers, compiled: ``mimo.parallel.norm_rope`` in a Qwen3-style
attention layer, ``mimo.parallel.swiglu`` and the router's ``mimo.parallel.split_gemm`` in a
routed-expert MoE layer. Layers take them on
CUDA only (``takes``); here ``takes`` is switched on so that the CPU runs the same custom ops
(their torch functions inside) through dynamo and inductor as the GPU will, and the layer's
output and every gradient are checked against the same layer on its plain modules, with the fp64
yardstick (docs/design.md §9): the fp64 runs of both paths agree to rounding, and the compiled
fp32 run of the ops (bf16 for the MoE layer, beside the plain layer compiled in bf16) is at most
``YARDSTICK_K`` times the plain run's error (a wrong
gradient path through the op, a table or a gate lost at the seam, fails it)."""

from __future__ import annotations

import copy

import pytest
import torch

from mimo.core.testing import YARDSTICK_K, rel_err
from mimo.llm.blocks import LayerSpec, build_layer
from mimo.llm.config import HybridArch, MoEArch
from mimo.llm.context import SeqContext
from mimo.parallel import norm_rope, split_gemm, swiglu

LENS = [37, 1, 90, 16]


def _arch() -> HybridArch:
    return HybridArch(pattern="*E", hidden=64, heads=4, kv_heads=2, head_dim=16, qk_norm=True, vocab=100, norm_eps=1e-6,
                      moe=MoEArch(experts=6, topk=2, ffn=24))


def _run(layer, x, grad):
    x = x.detach().clone().requires_grad_(True)
    out = layer(x, SeqContext.from_seqlens(LENS))
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad for _, p in sorted(layer.named_parameters())]


@pytest.mark.parametrize("kind", ["attention", "moe"])
def test_fused_ops_match_the_modules_compiled(monkeypatch, kind):
    arch = _arch()
    base = build_layer(arch, LayerSpec(0, kind))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / p.shape[-1] ** 0.5) + (1.0 if p.dim() == 1 else 0.0))
    t = sum(LENS)
    x, grad = torch.randn(t, arch.hidden, generator=gen), torch.randn(t, arch.hidden, generator=gen)
    if kind == "attention":
        base.impl = "exact"

    def run(fused: bool, dtype, compiled: bool):
        monkeypatch.setattr(norm_rope, "takes", lambda _t: fused)
        monkeypatch.setattr(swiglu, "takes", lambda _t: fused)
        monkeypatch.setattr(split_gemm, "takes", lambda x_, w_: fused and x_.dtype == torch.bfloat16)
        layer = copy.deepcopy(base).to(dtype)
        if compiled:
            torch._dynamo.reset()
            layer.compile(dynamic=True)
        return _run(layer, x.to(dtype), grad.to(dtype))

    # compiled grouped products need bf16 (the meta kernel takes CUDA's dtypes); the plain layer
    # runs compiled in the same dtype, so both sides round alike and only the ops differ
    low = torch.bfloat16 if kind == "moe" else torch.float32
    plain64, fused64 = run(False, torch.float64, False), run(True, torch.float64, False)
    plain, fused = run(False, low, kind == "moe"), run(True, low, True)
    names = ["out", "dx"] + [n for n, _ in sorted(base.named_parameters())]
    for name, a, b, p, f in zip(names, plain64, fused64, plain, fused):
        assert rel_err(b, a) < 1e-12, f"{kind} {name}: fp64 fused vs modules {rel_err(b, a):.2e}"
        e1, err = rel_err(p, a), rel_err(f, a)
        assert err <= max(1e-6, YARDSTICK_K * e1), f"{kind} {name}: compiled fused {low} {err:.2e} (modules {e1:.2e})"
