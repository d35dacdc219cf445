"""Mamba-2 (``M``) over packed sequences: chunked SSD vs the naive recurrence, packing, TP.

- chunked == naive per-token recurrence (fp64, outputs and gradients), for the scan alone and
  for the whole layer (conv + scan + gated norm), with sample boundaries inside chunks,
  samples of length 1, exact chunk multiples and a ragged tail;
- packed == each sample alone (fp32, <= 1e-5: outputs, input and parameter gradients);
  perturbing one sample leaves every other sample's output bit-identical;
- tp 1 and 2, with and without sequence parallel, == the one-process layer (forward, input
  gradients, parameter gradients gathered to full), from the same TP-invariant init; both
  B/C layouts (groups split over TP, and one group replicated with its norm group spanning ranks).
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
from mimo.llm.mamba2 import Mamba2, Mamba2Config, ssd_chunked
from mimo.llm.pattern import LayerSpec
from mimo.llm.recurrence import conv1d_naive, ssd_naive
from mimo.llm.ssm import causal_conv1d, find_kernel, kernel, segments

from sequence_mixer_checks import (SEQLENS, check_chunked_equals_naive_fp64, check_kernel_matches_torch_bf16,
                                   check_packed_equals_unpacked, check_pattern_trains_a_step_at_tp2_pp2,
                                   check_perturbing_one_sample_changes_no_other, check_tp_equals_one_process, gen, leaf)


def _cfg(groups: int = 1, chunk: int = 8) -> Mamba2Config:
    return Mamba2Config(hidden=32, heads=4, head_dim=8, state=8, groups=groups, conv_kernel=4, chunk=chunk)


# --------------------------------------------------------------------------- algorithm (fp64)
@pytest.mark.parametrize("seqlens,chunk,groups", [
    (SEQLENS, 8, 1),
    (SEQLENS, 4, 2),
    ([16, 16], 8, 2),  # boundaries exactly on chunk edges
    ([1], 8, 1),
    ([1, 1, 1, 1, 1], 2, 4),
    ([23], 64, 1),  # one chunk, ragged
])
def test_ssd_chunked_equals_naive_recurrence(seqlens, chunk, groups):
    g = gen(0, *seqlens, chunk, groups)
    t, h, p, n = sum(seqlens), 4, 3, 5
    f64 = dict(dtype=torch.float64)
    x = leaf(torch.randn(t, h, p, generator=g, **f64))
    dt = leaf(torch.rand(t, h, generator=g, **f64) * 0.5 + 0.05)
    A = leaf(-torch.rand(h, generator=g, **f64) * 3 - 0.1)
    B, C = (leaf(torch.randn(t, groups, n, generator=g, **f64)) for _ in range(2))
    dy = torch.randn(t, h, p, generator=g, **f64)
    ctx = SeqContext.from_seqlens(seqlens)
    seg_T, _ = segments(ctx.cu_seqlens, t)
    results = []
    for fn in (lambda: ssd_chunked(x, dt, A, B, C, seg_T, chunk), lambda: ssd_naive(x, dt, A, B, C, ctx.cu_seqlens)):
        for v in (x, dt, A, B, C):
            v.grad = None
        y = fn()
        y.backward(dy)
        results.append([y.detach(), *(v.grad.clone() for v in (x, dt, A, B, C))])
    for name, a, b in zip(["y", "dx", "ddt", "dA", "dB", "dC"], *results):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"


def test_causal_conv_resets_at_sample_boundaries():
    g = gen(1)
    ctx = SeqContext.from_seqlens([3, 1, 6, 2])
    t = 12
    x, w, b = torch.randn(t, 5, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    _, offset_T = segments(ctx.cu_seqlens, t)
    y = causal_conv1d(x, w, b, offset_T)
    assert rel_err(y, conv1d_naive(x, w, b, ctx.cu_seqlens)) < 1e-6
    # the first token of a sample sees only itself
    for start in ctx.cu_seqlens[:-1].tolist():
        assert torch.allclose(y[start], x[start] * w[:, -1] + b)


@pytest.mark.parametrize("groups", [1, 2])
def test_layer_chunked_equals_naive_fp64(groups):
    torch.manual_seed(0)
    check_chunked_equals_naive_fp64(Mamba2(_cfg(groups, chunk=4)).double(), groups)


# --------------------------------------------------------------------------- packing
@pytest.mark.parametrize("groups", [1, 2])
def test_packed_equals_unpacked(groups):
    check_packed_equals_unpacked(Mamba2(_cfg(groups)), groups)


def test_perturbing_one_sample_changes_no_other():
    check_perturbing_one_sample_changes_no_other(Mamba2(_cfg(2)))


def test_empty_pack_and_registry():
    arch = HybridArch(pattern="M*-M*-", hidden=32, heads=4, vocab=16, mamba_head_dim=8, mamba_state=8, mamba_chunk=8)
    layer = build_layer(arch, LayerSpec(0, "mamba"))
    assert isinstance(layer, Mamba2) and layer.mixer.cfg.heads == 8 and layer.mixer.cfg.chunk == 8
    x = leaf(torch.randn(0, 32))
    y = layer(x, SeqContext.from_seqlens([]))
    y.sum().backward()
    assert y.shape == (0, 32) and x.grad.shape == (0, 32)


# --------------------------------------------------------------------------- tensor / pipeline parallel
@pytest.mark.parametrize("groups", [1, 2])
def test_tp_equals_one_process(pools, groups):
    check_tp_equals_one_process(pools, functools.partial(Mamba2, _cfg(groups)))


@pytest.mark.parametrize("sp", [False, True])
def test_pattern_trains_a_step_at_tp2_pp2(pools, sp):
    arch = HybridArch(pattern="M*-M*-", hidden=32, heads=4, vocab=37, mamba_head_dim=8, mamba_state=8, mamba_chunk=8)
    check_pattern_trains_a_step_at_tp2_pp2(pools, arch, Mamba2, sp)


# --------------------------------------------------------------------------- GPU kernels
def test_kernel_policy_on_cpu():
    x = torch.randn(4, 8)
    assert find_kernel("ssd", "auto", x) is None and find_kernel("conv", "chunked", x) is None
    with pytest.raises(ValueError):
        find_kernel("ssd", "fast", x)
    if kernel("ssd") is None:  # not installed: impl="kernel" says so instead of silently falling back
        layer = Mamba2(_cfg())
        layer.mixer.impl = "kernel"
        with pytest.raises(RuntimeError, match="mamba_ssm"):
            layer(torch.randn(6, 32), SeqContext.from_seqlens([6]))


@pytest.mark.skipif(not torch.cuda.is_available() or kernel("ssd") is None,
                    reason="needs CUDA and mamba_ssm")
def test_kernel_path_matches_torch_path_bf16():
    check_kernel_matches_torch_bf16(Mamba2(Mamba2Config(hidden=64, heads=8, head_dim=16, state=16, groups=2, chunk=64)))
