"""``train.fp8.backend: torchao`` (issue 50 item 5): the experts' grouped FP8 products through
torchao's row-wise grouped GEMM.

On the CPU: the config's rules (row-wise only; not with the experts split over TP, which torchao
would quantize per slice), a clear error where torchao cannot run (not installed, or no GPU), and
mimo's glue around torchao's function: with a stand-in for it that checks what torchao requires
(groups starting at multiples of 16, the weight column-major per expert, no padding asked of
torchao) and multiplies exactly, the rows laid out by the dispatcher or copied into a padded
buffer give the plain grouped product and its gradients. On a GPU with torchao installed: its
products against mimo's row-wise ones and bf16."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mimo.core.errors import ConfigError
from mimo.core.testing import rel_err
from mimo.parallel import gemm
from mimo.parallel.fp8 import FP8Site, torchao_problem
from mimo.parallel.grouped import grouped_rows
from tests.test_fp8_blockwise import TINY_MOE

TORCHAO = ["train.fp8={recipe: rowwise, backend: torchao}"]  # on test_fp8_blockwise's tiny MoE VLM


def test_config_rules(tmp_path):
    from mimo.compose.config import load_config

    (tmp_path / "tiny.yaml").write_text(TINY_MOE)
    assert load_config(str(tmp_path / "tiny.yaml"), TORCHAO).train.fp8.backend == "torchao"
    with pytest.raises(ConfigError, match="scale row-wise"):
        load_config(str(tmp_path / "tiny.yaml"), [*TORCHAO, "train.fp8.recipe=blockwise"])
    with pytest.raises(ConfigError, match="etp 1"):
        load_config(str(tmp_path / "tiny.yaml"), [*TORCHAO, "world_size=2", "modules.vision.parallel.dp=2",
                                                  "modules.language.parallel.tp=2"])
    with pytest.raises(ConfigError, match="backend"):
        load_config(str(tmp_path / "tiny.yaml"), [*TORCHAO, "train.fp8.backend=te"])


def test_a_run_where_torchao_cannot_run_is_told_why(tmp_path):
    """On this machine (no GPU; torchao perhaps not installed) building the run fails with the
    reason, before any step."""
    from mimo.compose.config import load_config
    from mimo.core.errors import MimoError
    from mimo.training.run import build_run

    assert torchao_problem(torch.device("cpu"))
    (tmp_path / "tiny.yaml").write_text(TINY_MOE)
    with pytest.raises(MimoError, match="train.fp8.backend: torchao: .*(not installed|CUDA)"):
        build_run(load_config(str(tmp_path / "tiny.yaml"), TORCHAO), 0)


def _stand_in(calls: list):
    """A stand-in for torchao's function: checks its input rules and multiplies exactly."""

    def grouped(A, B_t, offs, out_dtype=torch.bfloat16, float8_dtype=None, pad_token_groups_for_grouped_mm=True):
        assert not pad_token_groups_for_grouped_mm and offs.dtype == torch.int32
        starts = [0] + offs.tolist()[:-1]
        assert all(s % 16 == 0 for s in starts), starts
        assert B_t.stride(-2) == 1, B_t.stride()  # column-major per expert
        calls.append((A.shape[0], offs.tolist()))
        return grouped_rows(A, B_t.transpose(-2, -1), offs).to(out_dtype)

    return grouped


@pytest.mark.parametrize("aligned", [True, False], ids=["laid-out", "padded-copy"])
def test_glue_around_torchao_gives_the_grouped_product(monkeypatch, aligned):
    calls: list = []
    module = types.ModuleType("torchao.prototype.moe_training")
    module._to_fp8_rowwise_then_scaled_grouped_mm = _stand_in(calls)
    for name in ("torchao", "torchao.prototype"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torchao.prototype.moe_training", module)
    g_ = torch.Generator().manual_seed(1)
    ends = torch.tensor([16, 16, 48, 80]) if aligned else torch.tensor([5, 5, 37, 50])
    rows = int(ends[-1])
    x0, w0, g0 = torch.randn(rows, 32, generator=g_), torch.randn(4, 48, 32, generator=g_), torch.randn(rows, 48, generator=g_)
    got = []
    for recipe in (FP8Site("rowwise", backend="torchao"), gemm.DEFAULT_RECIPE):
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        w.fp8_row, w.fp8_split = 0, False
        y = gemm.grouped_linear(x, w, ends, recipe, aligned=aligned)
        y.backward(g0)
        got.append([y.detach(), x.grad, w.grad])
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert len(calls) == 1 and (calls[0][0] == rows) == aligned, calls


@pytest.mark.skipif(not torch.cuda.is_available() or torchao_problem(torch.device("cuda")) is not None,
                    reason="needs a CUDA GPU with torchao")
def test_gpu_torchao_products_against_mimo_and_bf16():
    """torchao's row-wise grouped products (power-of-two scales) against bf16 within FP8's
    rounding and against mimo's row-wise ones within 2%, forward and both gradients."""
    dev = torch.device("cuda")
    g_ = torch.Generator().manual_seed(7)
    x0, g0, we0 = torch.randn(333, 256, generator=g_), torch.randn(333, 512, generator=g_), torch.randn(4, 512, 256, generator=g_) * 0.05
    ends = torch.tensor([40, 40, 200, 333], device=dev)

    def grouped(recipe):
        x = x0.to(dev, torch.bfloat16).requires_grad_(True)
        w = torch.nn.Parameter(we0.to(dev, torch.bfloat16))
        site = FP8Site("rowwise", None, (), None, [w], backend=recipe) if recipe else gemm.DEFAULT_RECIPE
        y = gemm.grouped_linear(x, w, ends, site)
        y.backward(g0.to(dev, torch.bfloat16))
        return [t.detach().float().cpu() for t in (y, x.grad, w.grad)]

    ao, ours, bf16 = grouped("torchao"), grouped("mimo"), grouped(None)
    for part, a, b, c in zip(("y", "dx", "dw"), ao, ours, bf16):
        assert rel_err(a, c) <= 0.08, (part, rel_err(a, c))
        assert rel_err(a, b) <= 0.02, (part, rel_err(a, b))
