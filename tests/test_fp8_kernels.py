"""mimo.parallel.fp8_kernels: the FP8 expert weight gradient's operands, quantized per expert and
column and transposed in one kernel.

The Triton kernel runs here on the CPU under ``TRITON_INTERPRET=1`` (a subprocess), writing its
clamped scaled fp32 values (the interpreter's own float8 cast rounds otherwise than the GPU's):
cast to e4m3 by torch they must be the torch reference's bytes, and the scales its scales, bit
for bit, on ragged experts (an empty one, one of no rows at the start, rows over several of the
kernel's row steps), columns not a multiple of its block, all-zero columns, the experts' blocks
written as they are or at multiples of 16 with zeros between. The kernel compiles for sm_90;
on a GPU its float8 output is the reference's too."""

from __future__ import annotations

import json

import pytest
import torch

from mimo.parallel import fp8, fp8_kernels
from mimo.parallel.fp8 import quantize_group_columns
from mimo.parallel.grouped import padded_groups, rows_expert
from tests.kernel_checks import run_interpreted

CASES = [  # (rows, columns, expert ends, aligned)
    (150, 100, [10, 10, 90, 150], False),
    (160, 64, [16, 16, 96, 160], True),
    (300, 48, [0, 300], False),
    (7, 130, [3, 7, 7], False),
]


def _case(rows: int, cols: int, ends: list[int], aligned: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + rows)
    t = (torch.randn(rows, cols, generator=gen) * torch.rand(1, cols, generator=gen) * 10).to(torch.bfloat16)
    t[:, 5] = 0  # an all-zero column: its scale stays finite
    ends_E = torch.tensor(ends)
    pends_E, width = (ends_E, rows) if aligned else padded_groups(ends_E, rows)[1:]
    return t, ends_E, pends_E, width


def test_the_reference_is_the_grouped_quantization_transposed_into_place():
    """Each expert's rows, quantized as ``quantize_group_columns`` does, land transposed at its
    block's columns; the padding between blocks is zeros."""
    for rows, cols, ends, aligned in CASES:
        t, ends_E, pends_E, width = _case(rows, cols, ends, aligned)
        qT, inv = fp8.group_columns_t_reference(t, ends_E, pends_E, width)
        q, inv_want = quantize_group_columns(t, rows_expert(ends_E, rows), len(ends))
        assert qT.shape == (cols, width) and torch.equal(inv, inv_want)
        start = pstart = 0
        seen = torch.zeros(width, dtype=torch.bool)
        for end, pend in zip(ends, pends_E.tolist()):
            n = end - start
            assert torch.equal(qT[:, pstart:pstart + n].t().view(torch.uint8), q[start:end].view(torch.uint8))
            seen[pstart:pstart + n] = True
            start, pstart = end, pend
        assert not qT[:, ~seen].float().any()


def _kernel_in_interpreter(cases) -> list:
    code = """
import json, sys, torch
from tests.test_fp8_kernels import _case
from mimo.parallel import fp8, fp8_kernels
out = []
for case in json.loads(sys.argv[1]):
    q, inv = fp8_kernels.group_columns_t_fused(*_case(*case), dtype=torch.float32)
    out.append((q.tolist(), inv.tolist()))
print(json.dumps(out))
"""
    return run_interpreted(code, json.dumps(cases))


pytestmark = pytest.mark.skipif(fp8_kernels.triton is None, reason="this torch has no Triton")


def test_kernel_in_the_interpreter_is_the_reference_bit_for_bit():
    for case, (q32, inv) in zip(CASES, _kernel_in_interpreter(CASES)):
        qT, inv_want = fp8.group_columns_t_reference(*_case(*case))
        q8 = torch.tensor(q32, dtype=torch.float32).to(torch.float8_e4m3fn)
        assert torch.equal(q8.view(torch.uint8), qT.view(torch.uint8)), case
        assert torch.equal(torch.tensor(inv, dtype=torch.float32), inv_want), case


def test_kernel_compiles_for_hopper():
    from tests.kernel_checks import compile_for_hopper

    sig = {"t_ptr": "*bf16", "ends_ptr": "*i64", "pends_ptr": "*i64", "q_ptr": "*fp8e4nv", "inv_ptr": "*fp32",
           "cols": "i32", "width": "i32", "t_stride": "i32", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}
    consts = {"BLOCK_R": fp8_kernels.BLOCK_R, "BLOCK_C": fp8_kernels.BLOCK_C}
    assert compile_for_hopper(fp8_kernels._group_columns_t_kernel, sig, consts).asm["cubin"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_is_the_reference_bit_for_bit():
    for case in CASES + [(4096, 2048, [512, 512, 1800, 4096], False), (4096, 768, [512, 512, 1808, 4096], True)]:
        t, ends_E, pends_E, width = (v.cuda() if isinstance(v, torch.Tensor) else v for v in _case(*case))
        q, inv = fp8.group_columns_t(t, ends_E, pends_E, width)
        q_want, inv_want = fp8.group_columns_t_reference(t, ends_E, pends_E, width)
        assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)), case[:2]
        assert torch.equal(inv, inv_want), case[:2]
