"""mimo.parallel.norm_rope: per-head QK-norm then RoPE, one op each way.

The torch functions equal the modules they replace (``RMSNorm`` then ``apply_rope``, in fp64);
the Triton kernels run here on the CPU under ``TRITON_INTERPRET=1`` (in a subprocess: the
interpreter is chosen when a kernel is defined) against fp64 autograd of those modules, with the
fp64 yardstick (docs/design.md §9): at most ``YARDSTICK_K`` times the fp32 torch functions' own
error. Ragged token counts, head dims 128 / 64 / 16, GQA-like head counts, zero-centred norms,
M-RoPE's tables (a different table per half) and a strided view of a fused projection."""

from __future__ import annotations

import pytest
import torch

from mimo.core.testing import YARDSTICK_K, rel_err
from mimo.llm.mrope import mrope_axes, mrope_tables
from mimo.llm.norm import RMSNorm
from mimo.llm.rope import apply_rope, rope_tables
from mimo.parallel import norm_rope
from tests.kernel_checks import run_interpreted

# (tokens, heads, head_dim, zero_centred, mrope)
CASES = [(37, 3, 128, False, False), (5, 4, 64, True, False), (50, 2, 16, False, True), (300, 5, 128, False, True)]
EPS = 1e-6


def _inputs(t: int, h: int, d: int, mrope: bool, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(t, (h + 2) * d, generator=gen).to(dtype)  # a q | k projection: x is a strided view
    x = fused[:, :h * d].view(t, h, d)
    w = 1.0 + 0.3 * torch.randn(d, generator=gen).to(dtype)
    g = torch.randn(t, h, d, generator=gen).to(dtype)
    freq = 1.0 / (1e4 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if mrope:
        pos3 = torch.randint(0, 60, (3, t), generator=gen)
        sec = [d // 2 - 2 * (d // 8), d // 8, d // 8]
        cos, sin = mrope_tables(pos3, freq.float(), mrope_axes(d, sec))
    else:
        cos, sin = rope_tables(torch.randint(0, 4000, (t,), generator=gen), freq.float())
    return x, w, cos, sin, g


def _modules64(x, w, cos, sin, g, zero_centred: bool):
    """Output and fp64 gradients of the modules the op replaces: RMSNorm then apply_rope."""
    norm = RMSNorm(x.shape[-1], EPS, zero_centred=zero_centred).double()
    with torch.no_grad():
        norm.weight.copy_(w)  # the stored weight (zero-centred: the offset from 1)
    xx = x.detach().double().requires_grad_()
    out = apply_rope(norm(xx), cos.double(), sin.double())
    out.backward(g.double())
    return out.detach(), xx.grad, norm.weight.grad


def _kernels_in_interpreter(dtype: str) -> list:
    code = """
import json, sys, torch
from tests.test_norm_rope import CASES, EPS, _inputs
from mimo.parallel import norm_rope
norm_rope.PROGRAMS = 3  # several blocks a backward program, the last one short
out = []
for t, h, d, zc, mrope in CASES:
    x, w, cos, sin, g = _inputs(t, h, d, mrope, getattr(torch, sys.argv[1]))
    y = norm_rope.forward_fused(x, w, cos, sin, EPS, zc)
    dx, dw = norm_rope.backward_fused(x, w, cos, sin, g, EPS, zc)
    out.append([a.double().tolist() for a in (y, dx, dw)])
print(json.dumps(out))
"""
    return [[torch.tensor(a, dtype=torch.float64) for a in case] for case in run_interpreted(code, dtype)]


def test_torch_functions_equal_the_modules_in_fp64():
    for t, h, d, zc, mrope in CASES:
        x, w, cos, sin, g = _inputs(t, h, d, mrope)
        out, dx, dw = _modules64(x, w, cos, sin, g, zc)
        assert rel_err(norm_rope.forward_reference(x, w, cos.double(), sin.double(), EPS, zc), out) < 1e-14
        got_dx, got_dw = norm_rope.backward_reference(x, w, cos.double(), sin.double(), g, EPS, zc)
        assert rel_err(got_dx, dx) < 1e-13 and rel_err(got_dw, dw) < 1e-13


def test_autograd_of_the_op_is_the_modules():
    """``norm_rope`` on the CPU (the torch functions inside the custom op), fp64: output and
    gradients equal the modules'; compiled (the op stays whole) the same."""
    t, h, d, zc, mrope = CASES[3]
    x, w, cos, sin, g = _inputs(t, h, d, mrope)
    out, dx, dw = _modules64(x, w, cos, sin, g, zc)
    for fn in (norm_rope.norm_rope, torch.compile(norm_rope.norm_rope, fullgraph=True, backend="aot_eager")):
        xx, ww = x.detach().clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww, cos.double(), sin.double(), EPS, zc)
        y.backward(g)
        assert rel_err(y, out) < 1e-14 and rel_err(xx.grad, dx) < 1e-13 and rel_err(ww.grad, dw) < 1e-13


@pytest.mark.skipif(norm_rope.triton is None, reason="this torch has no Triton")
def test_kernels_meet_the_fp64_yardstick_in_the_interpreter():
    """fp32 inputs: the kernels' output, dx and dw against fp64 autograd of the modules, within
    ``YARDSTICK_K`` times the fp32 torch functions' error (a wrong sign of the rotation's
    transpose, a dropped term of the normaliser's gradient, a lost program's partial sum fail)."""
    got = _kernels_in_interpreter("float32")
    for (t, h, d, zc, mrope), (y, dx, dw) in zip(CASES, got):
        x, w, cos, sin, g = _inputs(t, h, d, mrope, torch.float32)
        want = _modules64(x, w, cos, sin, g, zc)
        ref = (norm_rope.forward_reference(x, w, cos, sin, EPS, zc),) + norm_rope.backward_reference(x, w, cos, sin, g, EPS, zc)
        for name, a, r, b in zip(("out", "dx", "dw"), (y, dx, dw), ref, want):
            e1, err = rel_err(r, b), rel_err(a, b)
            print(f"T {t} H {h} D {d} zc {zc} mrope {mrope} {name}: kernel {err:.2e}, torch fp32 {e1:.2e}")
            assert e1 < 1e-5, f"{name}: the fp32 torch function's own error {e1:.2e}"
            assert err <= max(2e-7, YARDSTICK_K * e1), f"T {t} D {d} {name}: rel err {err:.2e} (torch fp32 {e1:.2e})"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU kernels need CUDA (this machine has none)")
def test_attention_layer_with_fused_norm_rope_on_cuda(monkeypatch):
    """A Qwen3-style attention layer (per-head QK-norm, GQA) on the GPU in bf16, compiled, takes
    the fused op and matches the fp32 CPU layer (the modules' path) on a ragged pack, within
    bf16's error of the same layer computed eagerly on the GPU with the fused op off."""
    from mimo.llm.blocks import LayerSpec, build_layer
    from mimo.llm.config import HybridArch
    from mimo.llm.context import SeqContext

    monkeypatch.setattr(norm_rope, "ON_CUDA", True)  # (layers take the op on CUDA once this test passes there)
    arch = HybridArch(pattern="*", hidden=512, heads=8, kv_heads=2, head_dim=128, qk_norm=True, vocab=100, norm_eps=1e-6)
    ref = build_layer(arch, LayerSpec(0, "attention"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.05 + (1.0 if p.ndim == 1 else 0.0)).bfloat16().float())
    ref.impl = "exact"
    fast = build_layer(arch, LayerSpec(0, "attention")).cuda().bfloat16()
    fast.load_state_dict({k: v.bfloat16() for k, v in ref.state_dict().items()})
    fast.compile(dynamic=True)
    lens = [300, 1, 77, 513]
    x = torch.randn(sum(lens), arch.hidden, generator=gen)
    grad = torch.randn(sum(lens), arch.hidden, generator=gen)
    out = {}
    for name, m, dev, dt in (("ref", ref, "cpu", torch.float32), ("fast", fast, "cuda", torch.bfloat16)):
        xx = x.to(dev, dt).requires_grad_()
        y = m(xx, SeqContext.from_seqlens(lens, device=dev))
        y.backward(grad.to(dev, dt))
        out[name] = [y.float().cpu(), xx.grad.float().cpu()] + [p.grad.float().cpu() for p in m.parameters()]
    errs = [rel_err(a, b) for a, b in zip(out["fast"], out["ref"])]
    print("fused norm_rope layer on cuda: rel errs " + " ".join(f"{e:.2e}" for e in errs))
    assert max(errs) < 2e-2


@pytest.mark.skipif(norm_rope.triton is None, reason="this torch has no Triton")
@pytest.mark.parametrize("zero_centred", [False, True])
def test_kernels_compile_for_hopper(zero_centred):
    """Both kernels lower to sm_90 cubins (bf16 rows of head dim 128, fp32 tables)."""
    from tests.kernel_checks import compile_for_hopper

    common = {"x_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    tail = {"ZERO_CENTRED": "constexpr", "HALF": "constexpr", "ROWS": "constexpr"}
    consts = {"ZERO_CENTRED": zero_centred, "HALF": 64, "ROWS": norm_rope.ROWS}
    fwd = {**common, "out_ptr": "*bf16", "rows": "i32", "heads": "i32", "x_stride_t": "i32", "tab_stride_t": "i32",
           "eps": "fp32", **tail}
    bwd = {**common, "g_ptr": "*bf16", "dx_ptr": "*bf16", "dw_ptr": "*fp32", "rows": "i32", "heads": "i32",
           "x_stride_t": "i32", "tab_stride_t": "i32", "eps": "fp32", "blocks_per_program": "i32", **tail}
    assert compile_for_hopper(norm_rope._forward_kernel, fwd, consts).asm["cubin"]
    assert compile_for_hopper(norm_rope._backward_kernel, bwd, consts).asm["cubin"]
