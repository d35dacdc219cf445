"""mimo.parallel.swiglu: the routed experts' weighted SwiGLU and its one-pass backward.

The Triton kernel runs here on the CPU under ``TRITON_INTERPRET=1`` (in a subprocess: the
interpreter is chosen when the kernel is defined), against the fp64 gradients of the plain
expression, with the fp64 yardstick (docs/design.md §9): its error may be at most
``YARDSTICK_K`` times the fp32 torch backward's own. Ragged row counts, an F that is no power
of two and one longer than the kernel's block (the loop over F blocks)."""

from __future__ import annotations

import json

import pytest
import torch

from mimo.core.testing import YARDSTICK_K, rel_err
from mimo.parallel import swiglu
from tests.kernel_checks import run_interpreted

SHAPES = [(37, 100), (6, 768), (9, 1500)]  # (rows, ffn): 1500 > the kernel's 1024-column block


def _inputs(rows: int, ffn: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, 2 * ffn, generator=gen).to(dtype)
    w = torch.rand(rows, generator=gen)
    w[rows // 2] = 0.0  # a row of zero gate (padding routes nowhere)
    da = torch.randn(rows, ffn, generator=gen).to(dtype)
    return h, w, da


def _autograd64(h, w, da):
    """The fp64 gradients of ``silu(gate) * up * w`` by autograd: the yardstick's reference."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up * w64[:, None]).backward(da.double())
    return h64.grad, w64.grad


def _kernel_in_interpreter(cases: list[tuple[int, int, str]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``backward_fused`` of each case's inputs, run by Triton's interpreter on the CPU."""
    code = """
import json, sys, torch
from tests.test_swiglu import _inputs
from mimo.parallel import swiglu
out = []
for rows, ffn, dtype in json.loads(sys.argv[1]):
    dh, dw = swiglu.backward_fused(*_inputs(rows, ffn, getattr(torch, dtype)))
    out.append((dh.double().tolist(), dw.double().tolist()))
print(json.dumps(out))
"""
    return [(torch.tensor(dh, dtype=torch.float64), torch.tensor(dw, dtype=torch.float64))
            for dh, dw in run_interpreted(code, json.dumps(cases))]


pytestmark = pytest.mark.skipif(swiglu.triton is None, reason="this torch has no Triton")


def test_fused_backward_meets_the_fp64_yardstick_in_the_interpreter():
    """fp32 inputs: the kernel's gradients against fp64, within ``YARDSTICK_K`` times the torch
    backward's own error (a dropped factor, a wrong half or a missing term of the sum fails)."""
    got = _kernel_in_interpreter([(r, f, "float32") for r, f in SHAPES])
    for (rows, ffn), (dh, dw) in zip(SHAPES, got):
        h, w, da = _inputs(rows, ffn)
        ref_dh, ref_dw = swiglu.backward_reference(h, w, da)
        want_dh, want_dw = _autograd64(h, w, da)
        for name, g, r, want in (("dh", dh, ref_dh, want_dh), ("dw", dw, ref_dw, want_dw)):
            e1 = rel_err(r, want)
            assert e1 < 1e-6, f"{name}: torch backward's own error {e1:.2e}"
            err = rel_err(g, want)
            print(f"rows {rows} ffn {ffn} {name}: kernel {err:.2e}, torch fp32 {e1:.2e}")
            assert err <= max(1e-7, YARDSTICK_K * e1), f"rows {rows} ffn {ffn} {name}: rel err {err:.2e} (torch fp32 {e1:.2e})"


def test_fused_backward_in_bf16_rounds_once():
    """bf16 inputs: the kernel and the torch backward both compute in fp32 and round once, so
    they differ by at most one bf16 step (the sigmoid's last bits), far below a real error."""
    got = _kernel_in_interpreter([(r, f, "bfloat16") for r, f in SHAPES[:2]])
    for (rows, ffn), (dh, dw) in zip(SHAPES, got):
        h, w, da = _inputs(rows, ffn, torch.bfloat16)
        ref_dh, ref_dw = swiglu.backward_reference(h, w, da)
        step = ref_dh.double().abs() * 2.0 ** -7 + 1e-30
        assert ((dh - ref_dh.double()).abs() <= step).all()
        assert rel_err(dw, ref_dw) < 1e-6


def test_autograd_of_the_function_is_the_expressions():
    """On the CPU ``weighted_swiglu`` runs the torch backward; its gradients are the plain
    expression's (fp64: equal to rounding), and its output is too."""
    h, w, da = (t.double() for t in _inputs(23, 300))
    h.requires_grad_(), w.requires_grad_()
    out = swiglu.weighted_swiglu(h, w)
    out.backward(da)
    gate, up = h.detach().chunk(2, dim=-1)
    assert rel_err(out, torch.nn.functional.silu(gate) * up * w.detach()[:, None]) < 1e-15
    want_dh, want_dw = _autograd64(h.detach(), w.detach(), da)
    assert rel_err(h.grad, want_dh) < 1e-14 and rel_err(w.grad, want_dw) < 1e-14


def test_compiled_caller_treats_the_backward_as_one_op():
    """Under torch.compile the backward stays one op (``mimo::weighted_swiglu_backward``) and
    gives the eager gradients."""
    h, w, da = _inputs(19, 96)

    def grads(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        fn(hh, ww).backward(da)
        return hh.grad, ww.grad

    eager = grads(swiglu.weighted_swiglu)
    compiled = grads(torch.compile(swiglu.weighted_swiglu, fullgraph=True, backend="aot_eager"))
    for a, b in zip(compiled, eager):
        assert rel_err(a, b) < 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU kernel needs CUDA (this machine has none)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_backward_on_cuda(dtype):
    """The kernel on the GPU against the fp64 gradients, compiled caller included, at the
    experts' shapes (ffn 768) and ragged ones."""
    for rows, ffn in SHAPES + [(4099, 768)]:
        h, w, da = _inputs(rows, ffn, dtype)
        want_dh, want_dw = _autograd64(h, w, da)
        ref_dh, ref_dw = swiglu.backward_reference(h, w, da)
        hh, ww = h.cuda().requires_grad_(), w.cuda().requires_grad_()
        torch.compile(swiglu.weighted_swiglu)(hh, ww).backward(da.cuda())
        for name, g, r, want in (("dh", hh.grad, ref_dh, want_dh), ("dw", ww.grad, ref_dw, want_dw)):
            err, e1 = rel_err(g.cpu(), want), rel_err(r, want)
            print(f"cuda {dtype} rows {rows} ffn {ffn} {name}: kernel {err:.2e}, torch {e1:.2e}")
            assert err <= max(1e-7, YARDSTICK_K * e1, 2e-3 if dtype == torch.bfloat16 else 0.0)


def test_kernel_compiles_for_hopper():
    """The backward kernel lowers to an sm_90 cubin (bf16 rows, the experts' F of 768)."""
    from tests.kernel_checks import compile_for_hopper

    sig = {"h_ptr": "*bf16", "da_ptr": "*bf16", "w_ptr": "*fp32", "dh_ptr": "*bf16", "dw_ptr": "*fp32", "rows": "i32",
           "ffn": "i32", "h_stride": "i32", "da_stride": "i32", "ROWS": "constexpr", "BLOCK_F": "constexpr"}
    assert compile_for_hopper(swiglu._backward_kernel, sig, {"ROWS": 4, "BLOCK_F": 1024}).asm["cubin"]
