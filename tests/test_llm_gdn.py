"""Gated DeltaNet (``G``) over packed sequences: chunked rule vs the naive recurrence, packing, TP.

- chunked == naive per-token recurrence (fp64, outputs and gradients), for the rule alone and
  for the whole layer (convs + rule + gated norm), with sample boundaries inside chunks,
  samples of length 1, exact chunk multiples and a ragged tail;
- packed == each sample alone (fp32, <= 1e-5: outputs, input and parameter gradients);
  perturbing one sample leaves every other sample's output bit-identical;
- tp 1 and 2, with and without sequence parallel, == the one-process layer (forward, input
  gradients, parameter gradients gathered to full), from the same TP-invariant init; with as
  many value heads as q/k heads and with twice as many.
The layer-independent checks are written once in tests/sequence_mixer_checks.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mimo.core.testing import rel_err
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch
from mimo.llm.context import SeqContext
from mimo.llm.gdn import GatedDeltaNet, GDNConfig, gated_delta_chunked, l2norm
from mimo.llm.pattern import LayerSpec
from mimo.llm.recurrence import gated_delta_naive
from mimo.llm.ssm import kernel, segments

from sequence_mixer_checks import (SEQLENS, check_chunked_equals_naive_fp64, check_kernel_matches_torch_bf16,
                                   check_packed_equals_unpacked, check_pattern_trains_a_step_at_tp2_pp2,
                                   check_perturbing_one_sample_changes_no_other, check_tp_equals_one_process, gen, leaf)


def _cfg(v_heads: int = 4, chunk: int = 8) -> GDNConfig:
    return GDNConfig(hidden=32, heads=2, v_heads=v_heads, head_dim=8, v_head_dim=8, conv_kernel=4, chunk=chunk)


# --------------------------------------------------------------------------- algorithm (fp64)
@pytest.mark.parametrize("seqlens,chunk", [
    (SEQLENS, 8),
    (SEQLENS, 4),
    ([16, 16], 8),  # boundaries exactly on chunk edges
    ([1], 8),
    ([1, 1, 1, 1, 1], 2),
    ([23], 64),  # one chunk, ragged
])
def test_gated_delta_chunked_equals_naive_recurrence(seqlens, chunk):
    g = gen(0, *seqlens, chunk)
    t, h, dk, dv = sum(seqlens), 3, 4, 5
    f64 = dict(dtype=torch.float64)
    q0, k0 = torch.randn(t, h, dk, generator=g, **f64), torch.randn(t, h, dk, generator=g, **f64)
    v = leaf(torch.randn(t, h, dv, generator=g, **f64))
    gate = leaf(-torch.rand(t, h, generator=g, **f64) * 2)
    beta = leaf(torch.rand(t, h, generator=g, **f64))
    q, k = leaf(q0), leaf(k0)
    do = torch.randn(t, h, dv, generator=g, **f64)
    ctx = SeqContext.from_seqlens(seqlens)
    seg_T, _ = segments(ctx.cu_seqlens, t)
    qn = lambda: l2norm(q) * dk ** -0.5  # noqa: E731
    results = []
    for fn in (lambda: gated_delta_chunked(qn(), l2norm(k), v, gate, beta, seg_T, chunk),
               lambda: gated_delta_naive(qn(), l2norm(k), v, gate, beta, ctx.cu_seqlens)):
        for x in (q, k, v, gate, beta):
            x.grad = None
        o = fn()
        o.backward(do)
        results.append([o.detach(), *(x.grad.clone() for x in (q, k, v, gate, beta))])
    for name, a, b in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], *results):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("v_heads", [2, 4])
def test_layer_chunked_equals_naive_fp64(v_heads):
    check_chunked_equals_naive_fp64(GatedDeltaNet(_cfg(v_heads, chunk=4)).double(), v_heads)


# --------------------------------------------------------------------------- packing
@pytest.mark.parametrize("v_heads", [2, 4])
def test_packed_equals_unpacked(v_heads):
    check_packed_equals_unpacked(GatedDeltaNet(_cfg(v_heads)), v_heads)


def test_perturbing_one_sample_changes_no_other():
    check_perturbing_one_sample_changes_no_other(GatedDeltaNet(_cfg(4)))


def test_empty_pack_and_registry():
    arch = HybridArch(pattern="G*G*-", hidden=32, heads=4, vocab=16, gdn_heads=2, gdn_v_heads=4, gdn_chunk=8)
    layer = build_layer(arch, LayerSpec(0, "gdn"))
    assert isinstance(layer, GatedDeltaNet)
    assert (layer.mixer.cfg.heads, layer.mixer.cfg.v_heads, layer.mixer.cfg.head_dim, layer.mixer.cfg.chunk) == (2, 4, 8, 8)
    x = leaf(torch.randn(0, 32))
    y = layer(x, SeqContext.from_seqlens([]))
    y.sum().backward()
    assert y.shape == (0, 32) and x.grad.shape == (0, 32)


# --------------------------------------------------------------------------- tensor / pipeline parallel
@pytest.mark.parametrize("v_heads", [2, 4])
def test_tp_equals_one_process(pools, v_heads):
    check_tp_equals_one_process(pools, functools.partial(GatedDeltaNet, _cfg(v_heads)))


@pytest.mark.parametrize("sp", [False, True])
def test_pattern_trains_a_step_at_tp2_pp2(pools, sp):
    arch = HybridArch(pattern="G*G*-", hidden=32, heads=4, vocab=37, gdn_heads=2, gdn_v_heads=4, gdn_head_dim=8,
                      gdn_v_head_dim=8, gdn_chunk=8)
    check_pattern_trains_a_step_at_tp2_pp2(pools, arch, GatedDeltaNet, sp)


# --------------------------------------------------------------------------- GPU kernels
@pytest.mark.skipif(not torch.cuda.is_available() or kernel("gated_delta") is None,
                    reason="needs CUDA and flash-linear-attention (fla)")
def test_kernel_path_matches_torch_path_bf16():
    check_kernel_matches_torch_bf16(GatedDeltaNet(GDNConfig(hidden=64, heads=2, v_heads=4, head_dim=32, v_head_dim=32, chunk=64)))
