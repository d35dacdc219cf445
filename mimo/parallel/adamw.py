"""AdamW's update as one Triton kernel per tensor (CUDA), the arithmetic of torch's fused AdamW.

torch's ``_fused_adamw_`` moved issue 55's MoE model (5.27B parameters, bf16 weights, gradients
and moments: 14 bytes a parameter) at about 2.3 TB/s, 32 ms a step, where the GPU copies at
about 3 TB/s. ``_update_kernel`` reads and writes each tensor once in wide contiguous blocks.
Per element, torch's fused formula, all in fp32 (torch's kernel takes the hyperparameters in
double and does part of the arithmetic in it, so a weight may differ from torch's in its last
bit; the tests hold both to the fp64 yardstick)::

    p *= 1 - lr * wd                              (decoupled weight decay; 0: skipped)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

with ``t`` the tensor's step count, on the device, which ``adamw_`` advances by one first (as
``torch.optim.adamw`` does before its fused call). The weights may be wider than the gradients
(a master copy) and the moments of either width; each is rounded once when stored.
"""

from __future__ import annotations

import torch

from mimo.parallel.kernels import tl, triton

BLOCK = 2048  # elements a program updates


if triton is not None:
    @triton.jit
    def _update_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, n, lr, beta1, beta2, eps, weight_decay,
                       BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        t = tl.load(step_ptr).to(tl.float32)
        bc1 = 1.0 - tl.exp2(t * tl.log2(beta1))
        bc2_sqrt = tl.sqrt(1.0 - tl.exp2(t * tl.log2(beta2)))
        p = tl.load(p_ptr + offs, mask=ok).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=ok).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=ok).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=ok).to(tl.float32)
        if weight_decay != 0.0:
            p = p - lr * weight_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=ok)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=ok)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=ok)


def takes(*lists: list[torch.Tensor]) -> bool:
    """Whether ``adamw_`` runs these lists: contiguous CUDA tensors (Triton present)."""
    return triton is not None and all(t.is_cuda and t.is_contiguous() for ts in lists for t in ts)


def adamw_(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr: float, beta1: float, beta2: float, eps: float,
           weight_decay: float) -> None:
    """One AdamW update of every tensor in place (module doc); ``steps``: each tensor's count, a
    0-d fp32 tensor on its device, advanced by one. Every tensor contiguous."""
    torch._foreach_add_(steps, 1.0)
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        n = p.numel()
        if n:
            _update_kernel[(triton.cdiv(n, BLOCK),)](p, g, m, v, t, n, float(lr), float(beta1), float(beta2), float(eps),
                                                     float(weight_decay), BLOCK=BLOCK)
