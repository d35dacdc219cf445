"""Compiling a Triton kernel for Hopper (sm_90) on a machine without a GPU: Triton's compiler
and its bundled ptxas lower the kernel to a cubin, which catches what the CPU interpreter cannot
(types and layouts the GPU backend rejects) before a GPU session runs it."""

from __future__ import annotations


def compile_for_hopper(kernel, signature: dict[str, str], constexprs: dict[str, object]):
    """The compiled kernel (its ``asm`` holds ``ptx`` and ``cubin``); ``signature`` maps each
    argument to a Triton type (``*bf16``, ``i32``, ``fp32``) or ``constexpr``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    consts = {(names.index(k),): v for k, v in constexprs.items()}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))
