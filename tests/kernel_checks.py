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


def run_interpreted(code: str, *args: str):
    """``code`` run by a fresh Python under ``TRITON_INTERPRET=1`` (the interpreter is chosen when a
    kernel is defined, so it needs a process of its own), the repository importable, with ``args``
    as ``sys.argv[1:]``: the JSON value of its last stdout line."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
