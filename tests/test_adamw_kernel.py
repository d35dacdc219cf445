"""mimo.parallel.adamw: AdamW's update as a Triton kernel, against torch's fused AdamW.

The kernel runs here on the CPU under ``TRITON_INTERPRET=1`` (a subprocess: the interpreter is
chosen when the kernel is defined) beside ``torch._fused_adamw_`` on the CPU, for several steps,
with and without weight decay: fp32 weights and moments (the yardstick against an fp64 run of the
same update: at most ``YARDSTICK_K`` times torch's own error), and bf16 weights, gradients and
moments (issue 55's bench) after one update: at most one bf16 step from torch's (Triton's
interpreter rounds float-to-bf16 casts toward zero where the GPU rounds to nearest, so more
steps would drift apart here by a step each; the GPU test compares several updates).
Tensor sizes are ragged, one below and one above the kernel's block."""

from __future__ import annotations

import pytest
import torch

from mimo.core.testing import YARDSTICK_K, rel_err
from mimo.parallel import adamw as adamw_kernel
from tests.kernel_checks import run_interpreted

SIZES = [3, 2047, 5000]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
STEPS = 4


def _tensors(dtype, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
    grads = [[(torch.randn(n, generator=gen) * 0.1).to(dtype) for n in SIZES] for _ in range(steps)]
    return params, grads


def _run(update, dtype, wd: float, steps: int = STEPS):
    """The weights and moments after ``steps`` updates by ``update`` (torch's or the kernel's)."""
    params, grads = _tensors(dtype, steps)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), dtype=torch.float32) for _ in params]
    for gs in grads:
        update(params, gs, m, v, steps, wd)
    return params + m + v


def _torch(params, grads, m, v, steps, wd):
    torch._foreach_add_(steps, 1.0)
    torch._fused_adamw_(params, grads, m, v, [], steps, amsgrad=False, maximize=False, weight_decay=wd, **HYPER)


def _kernel(params, grads, m, v, steps, wd):
    adamw_kernel.adamw_(params, grads, m, v, steps, weight_decay=wd, **HYPER)


def _reference64(params, grads, m, v, steps, wd):
    """The update in fp64, written out (torch's fused formula)."""
    torch._foreach_add_(steps, 1.0)
    b1, b2, lr, eps = HYPER["beta1"], HYPER["beta2"], HYPER["lr"], HYPER["eps"]
    for p, g, mm, vv, t in zip(params, grads, m, v, steps):
        p.mul_(1 - lr * wd)
        mm.mul_(b1).add_((1 - b1) * g)
        vv.mul_(b2).add_((1 - b2) * g * g)
        bc1, bc2 = 1 - b1 ** float(t), 1 - b2 ** float(t)
        p.sub_((lr / bc1) * mm / (vv.sqrt() / bc2 ** 0.5 + eps))


def _kernel_in_interpreter(dtype: str, wd: float, steps: int = STEPS) -> list[torch.Tensor]:
    code = """
import json, sys, torch
from tests.test_adamw_kernel import _kernel, _run
out = _run(_kernel, getattr(torch, sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
print(json.dumps([t.double().tolist() for t in out]))
"""
    return [torch.tensor(t, dtype=torch.float64) for t in run_interpreted(code, dtype, str(wd), str(steps))]


pytestmark = pytest.mark.skipif(adamw_kernel.triton is None, reason="this torch has no Triton")


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fp32_update_meets_the_fp64_yardstick(wd):
    got = _kernel_in_interpreter("float32", wd)
    ref = _run(_torch, torch.float32, wd)
    want = _run(_reference64, torch.float64, wd)
    for i, (g, r, w) in enumerate(zip(got, ref, want)):
        e1, err = rel_err(r, w), rel_err(g, w)
        assert err <= max(1e-7, YARDSTICK_K * e1), f"tensor {i}: kernel {err:.2e}, torch {e1:.2e}"


def test_bf16_update_is_torchs_to_a_bf16_step():
    got = _kernel_in_interpreter("bfloat16", 0.1, steps=1)
    ref = [t.double() for t in _run(_torch, torch.bfloat16, 0.1, steps=1)]
    for g, r in zip(got, ref):
        assert ((g - r).abs() <= r.abs() * 2.0 ** -7 + 1e-30).all()


def test_kernel_compiles_for_hopper():
    from tests.kernel_checks import compile_for_hopper

    for p, m in (("*bf16", "*bf16"), ("*fp32", "*fp32")):
        sig = {"p_ptr": p, "g_ptr": "*bf16" if p == "*bf16" else "*fp32", "m_ptr": m, "v_ptr": m, "step_ptr": "*fp32",
               "n": "i32", "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32", "weight_decay": "fp32",
               "BLOCK": "constexpr"}
        assert compile_for_hopper(adamw_kernel._update_kernel, sig, {"BLOCK": adamw_kernel.BLOCK}).asm["cubin"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on CUDA (this machine has none)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_as_torchs_fused_adamw(dtype):
    def on_cuda(update):
        def run(params, grads, m, v, steps, wd):
            ts = [[t.cuda() for t in x] for x in (params, grads, m, v, steps)]
            update(*ts, wd)
            for dst, src in zip((params, m, v, steps), (ts[0], ts[2], ts[3], ts[4])):
                for d, s in zip(dst, src):
                    d.copy_(s.cpu())
        return run

    got = _run(on_cuda(_kernel), dtype, 0.1)
    ref = _run(on_cuda(_torch), dtype, 0.1)
    for g, r in zip(got, ref):
        assert rel_err(g, r) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_run_optimizer_steps_through_the_kernel(precision):
    """The run's optimizer (several buckets mixing decayed and undecayed runs, fp32 masters under
    bf16) with the kernel switched on, in the interpreter: four steps meet the fp64 yardstick
    against an fp64 AdamW, within ``YARDSTICK_K`` times torch's fused AdamW's error."""
    code = """
import json, sys, torch
from mimo.parallel import adamw as kernel
from tests.test_optim import _optimizer, _params, _state, _steps_of
from mimo.training.precision import PrecisionPolicy
calls = []
kernel.takes = lambda *lists: True
run = kernel.adamw_
kernel.adamw_ = lambda *a, **k: (calls.append(1), run(*a, **k))
precision = sys.argv[1]
b = [torch.nn.Parameter(p.detach()) for p in _params(PrecisionPolicy.named(precision).params)]
opt = _optimizer(b, precision)
for s in opt.states:
    s.fused = True
_steps_of(opt, b, 4, "cpu")
state = _state(opt)
out = [state[f"{i}.master"] if precision == "bf16" else p.detach().reshape(-1) for i, p in enumerate(b)]
print(json.dumps([len(calls)] + [t.double().tolist() for t in out]))
"""
    from tests.test_optim import _params, _steps_of, _torch_adamw

    calls, *got = run_interpreted(code, precision)
    assert calls == 8  # four steps, each one call over the decayed runs and one over the others
    a = [torch.nn.Parameter(p.detach().float()) for p in _params(torch.float32 if precision == "fp32" else torch.bfloat16)]
    r = [torch.nn.Parameter(p.detach().double()) for p in a]
    _steps_of(_torch_adamw(a, fused=True), a, 4, "cpu")
    _steps_of(_torch_adamw(r, foreach=False), r, 4, "cpu")
    for i, (g, x, z) in enumerate(zip(got, a, r)):
        e1, err = rel_err(x.detach().reshape(-1), z.detach().reshape(-1)), rel_err(torch.tensor(g), z.detach().reshape(-1))
        assert err <= max(1e-7, YARDSTICK_K * e1), f"{precision} param {i}: {err:.2e} (torch fused {e1:.2e})"
