"""Block-wise FP8 (``train.fp8.recipe: blockwise``, ``mimo.parallel.fp8``): DeepSeek-V3's 1x128
activation / gradient tiles and 128x128 weight blocks.

* the quantization against a plain per-tile reference (amax / 448 scales, the round trip within
  e4m3's rounding, an outlier moving only its own tile's / block's scale);
* the dense and grouped products, forward and both gradients, against the same quantization
  written out in fp64 (the CPU multiplies dequantized operands: equal to fp32 rounding) and
  against the plain product within FP8's rounding;
* the config takes the recipe, ``mimo check-config`` passes it, a tiny MoE model trains under it,
  and the products trace whole under ``torch.compile``;
* on a GPU: the products against bf16 and against the CPU's (``F.scaled_mm``'s block scaling on
  sm90), and compiled (inductor).

The TP and EP layouts against one process are ``tests/test_fp8.py``'s (``blockwise`` cases)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mimo.core.testing import rel_err
from mimo.parallel import gemm
from mimo.parallel.fp8 import E4M3, ROW_TILE, WEIGHT_BLOCK, FP8Site, quantize_blocks, straddling_blocks
from mimo.parallel.placement import sharded

TOL = 1e-5  # fp32 accumulation of identical FP8 operands, summed in another order
E4M3_MAX = 448.0
TILE, BLOCK = (1, 128), (128, 128)  # the references' own: a module constant changed must show


def _tiles_reference(x: torch.Tensor, rows: int, cols: int):
    """Per block (``rows`` x ``cols``, the last ones partial): its inverse scale amax / 448 and
    its elements quantized by 448 / amax, block by block in plain loops."""
    R, C = x.shape
    inv = torch.empty(math.ceil(R / rows), math.ceil(C / cols))
    q = torch.empty(R, C, dtype=E4M3)
    for i in range(inv.shape[0]):
        for j in range(inv.shape[1]):
            block = x[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            amax = block.abs().max().float()
            inv[i, j] = amax / E4M3_MAX
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (block.float() * (E4M3_MAX / amax)).to(E4M3)
    return q, inv


def _spread(inv: torch.Tensor, block, shape) -> torch.Tensor:
    return inv.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


@pytest.mark.parametrize("name", ["1x128", "128x128"])
def test_tiles_and_blocks_against_a_plain_reference(name):
    g_ = torch.Generator().manual_seed(1)
    block, ours = {"1x128": (TILE, ROW_TILE), "128x128": (BLOCK, WEIGHT_BLOCK)}[name]
    # 300 columns: two whole tiles and a partial one; 200 rows: a whole block and a partial one;
    # rows of very different magnitudes, so that a block's scale is its own
    x = torch.randn(200, 300, generator=g_) * torch.logspace(-3, 2, 200).unsqueeze(1)
    q, inv = quantize_blocks(x, E4M3, ours)
    want_q, want_inv = _tiles_reference(x, *block)
    assert inv.shape == (math.ceil(200 / block[0]), math.ceil(300 / 128)) and inv.dtype == torch.float32
    torch.testing.assert_close(inv, want_inv, rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # each block's largest element lands on e4m3's largest value
    big = _tiles_reference(q.float().abs(), *block)[1] * E4M3_MAX
    assert torch.equal(big, torch.full_like(big, E4M3_MAX))
    # the round trip: e4m3's half step (2^-4 relative; 2^-10 of a block's scale below its normals)
    s = _spread(inv, block, x.shape)
    err = (q.float() * s - x).abs()
    assert (err <= x.abs() * 2 ** -4 + s * 2 ** -10 + 1e-30).all()
    assert 0 < rel_err(q.float() * s, x) < 0.03
    # a transposed view quantizes as its copy; an empty tensor to empty scales
    qt, invt = quantize_blocks(x.t(), E4M3, ours)
    assert torch.equal(qt.view(torch.uint8), quantize_blocks(x.t().contiguous(), E4M3, ours)[0].view(torch.uint8))
    assert quantize_blocks(torch.zeros(0, 64), E4M3, ours)[1].shape == (0, 1)


@pytest.mark.parametrize("name", ["1x128", "128x128"])
def test_an_outlier_moves_only_its_own_tile(name):
    """The point of the recipe: one large element takes the precision of its own tile / block
    only (per tensor or per row it would coarsen everything that shares its scale)."""
    g_ = torch.Generator().manual_seed(2)
    block, ours = {"1x128": (TILE, ROW_TILE), "128x128": (BLOCK, WEIGHT_BLOCK)}[name]
    x = torch.randn(256, 384, generator=g_)
    q0, inv0 = quantize_blocks(x, E4M3, ours)
    x[130, 200] = 1e4  # tile (130, 1), block (1, 1)
    q1, inv1 = quantize_blocks(x, E4M3, ours)
    hit = (130 // block[0], 200 // 128)
    changed = (inv1 != inv0).nonzero().tolist()
    assert changed == [list(hit)], changed
    inside = torch.zeros_like(x, dtype=torch.bool)
    inside[hit[0] * block[0]:(hit[0] + 1) * block[0], hit[1] * 128:(hit[1] + 1) * 128] = True
    assert torch.equal(q1.view(torch.uint8)[~inside], q0.view(torch.uint8)[~inside])
    assert inv1[hit] == pytest.approx(1e4 / E4M3_MAX)


def _dq(t: torch.Tensor, block) -> torch.Tensor:
    """``t`` quantized in ``block``s by the plain reference, dequantized in fp64."""
    q, inv = _tiles_reference(t, *block)
    return q.double() * _spread(inv.double(), block, t.shape)


def _site(w, kind="blockwise"):
    return FP8Site(kind, None, (), None, [w])


@pytest.mark.parametrize("rows,I,O", [(37, 320, 272), (130, 256, 256)])
def test_linear_is_its_blockwise_quantization_in_fp64(rows, I, O):
    """Forward ``x @ w.T``: x in 1x128 tiles along I, w in 128x128 blocks; input gradient
    ``g @ w``: g in tiles along O, the same float8 w and blocks; weight gradient ``g.T @ x``:
    both in tiles along the tokens. Partial tiles (37 rows, 320 / 272 columns) and a square
    weight whose blocks differ in scale (a block transposed would show)."""
    g_ = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, I, generator=g_) * 3).requires_grad_(True)
    w = torch.randn(O, I, generator=g_) * 0.1
    w[:128, 128:] *= 30  # one off-diagonal block much larger than the rest
    w = torch.nn.Parameter(w)
    site = _site(w)
    assert not site.native(x)  # the CPU's _scaled_mm takes no block scales: the dequantized product
    y = gemm.linear(x, w, None, site)
    g = torch.randn(rows, O, generator=g_)
    y.backward(g)
    xd, wd = x.detach(), w.detach()
    want = {"y": _dq(xd, TILE) @ _dq(wd, BLOCK).T,
            "dx": _dq(g, TILE) @ _dq(wd, BLOCK),
            "dw": _dq(g.T, TILE) @ _dq(xd.T, TILE).T}
    for name, got in (("y", y), ("dx", x.grad), ("dw", w.grad)):
        assert rel_err(got.double(), want[name]) <= TOL, (name, rel_err(got.double(), want[name]))
    plain = {"y": xd @ wd.T, "dx": g @ wd, "dw": g.T @ xd}
    for name, got in (("y", y), ("dx", x.grad), ("dw", w.grad)):
        assert 1e-3 < rel_err(got.detach(), plain[name]) < 0.06, name  # quantized: near, not equal


def test_blockwise_beats_rowwise_on_an_outlier():
    """A hot activation channel (as LLM activations have; its weight column zero, so that only
    the other channels' precision shows): its row-wise scales push every row's other elements
    down into e4m3's subnormals, block-wise ones only those of its own tile."""
    g_ = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 512, generator=g_), torch.randn(256, 512, generator=g_) * 0.05
    x[:, 7], w[:, 7] = 1e5, 0
    plain = x @ w.T
    errs = {k: rel_err(gemm.linear(x, w, None, _site(w, k)), plain) for k in ("rowwise", "blockwise")}
    assert errs["blockwise"] < 0.08 and errs["rowwise"] > 0.1, errs


def test_a_product_of_no_rows():
    w = torch.nn.Parameter(torch.randn(48, 64))
    x = torch.zeros(0, 64, requires_grad=True)
    y = gemm.linear(x, w, None, _site(w))
    y.backward(torch.zeros(0, 48))
    assert y.shape == (0, 48) and x.grad.shape == (0, 64) and not w.grad.any()
    experts = torch.nn.Parameter(torch.randn(3, 48, 64))
    y = gemm.grouped_linear(x, experts, torch.tensor([0, 0, 0]), _site(experts))
    y.backward(torch.zeros(0, 48))
    assert y.shape == (0, 48) and not experts.grad.any()


def test_grouped_is_its_blockwise_quantization_in_fp64():
    """Experts: rows in 1x128 tiles, each expert's weight in 128x128 blocks; the weight
    gradient's tiles run along each expert's own rows, from its first (160 rows: a tile and a
    partial one; none straddles two experts); an empty expert, one at the end."""
    g_ = torch.Generator().manual_seed(5)
    ends = torch.tensor([10, 10, 170, 300, 300])
    x = (torch.randn(300, 160, generator=g_) * 2).requires_grad_(True)
    w = torch.randn(5, 144, 160, generator=g_) * 0.1
    w[2, :, 128:] *= 20
    w = torch.nn.Parameter(w)
    assert gemm.grouped_row_align(_site(w)) == 1  # the dequantized products take any rows
    y = gemm.grouped_linear(x, w, ends, _site(w))
    g = torch.randn(300, 144, generator=g_)
    y.backward(g)
    xd, wd = x.detach(), w.detach()
    start, ry, rdx, rdw = 0, [], [], []
    for e, end in enumerate(ends.tolist()):
        xe, ge, we = xd[start:end], g[start:end], _dq(wd[e], BLOCK)
        ry.append(_dq(xe, TILE) @ we.T)
        rdx.append(_dq(ge, TILE) @ we)
        rdw.append(_dq(ge.T, TILE) @ _dq(xe.T, TILE).T if end > start else torch.zeros(144, 160, dtype=torch.float64))
        start = end
    for name, got, want in (("y", y, torch.cat(ry)), ("dx", x.grad, torch.cat(rdx)), ("dw", w.grad, torch.stack(rdw))):
        assert rel_err(got.double(), want) <= TOL, (name, rel_err(got.double(), want))
    plain = torch.cat([xd[a:b] @ wd[e].T for e, (a, b) in enumerate(zip([0] + ends.tolist(), ends.tolist()))])
    assert 1e-3 < rel_err(y.detach(), plain) < 0.06


def test_shards_that_split_a_block_are_named():
    """TP keeps whole 128-blocks on each rank only where every shard (of every fused part) is a
    multiple of 128; elsewhere ``apply_fp8`` warns (the layout quantizes its own blocks)."""
    assert not straddling_blocks(sharded((512, 64), 0), "tp", 4)
    assert straddling_blocks(sharded((96, 64), 0), "tp", 2)
    assert straddling_blocks(sharded((64, 96), 1), "tp", 2)
    assert not straddling_blocks(sharded((64, 96), 1), "etp", 2)
    assert not straddling_blocks(sharded((512, 64), 0, parts=(256, 256)), "tp", 2)
    assert straddling_blocks(sharded((512, 64), 0, parts=(128, 384)), "tp", 2)  # gate | up: 64 + 192


# ---- config, training, compile ---------------------------------------------------------------

TINY_MOE = """\
world_size: 1
modules:
  vision:
    kind: vit
    arch: {image_size: 16, patch: 8, hidden: 32, layers: 1, heads: 2, mlp: 64}
    feature_layer: -1
  language:
    kind: hybrid
    arch: {pattern: "*E*-", hidden: 32, heads: 2, vocab: 64, max_seq_len: 64, ffn: 64,
           moe: {experts: 4, topk: 2, ffn: 32}}
data:
  source: synthetic
  tokens_per_microbatch: 64
  max_sample_tokens: 32
train:
  steps: 3
  lr: 3.0e-3
  fp8: {recipe: blockwise, bf16_layers: [last]}
"""


def test_check_config_takes_blockwise(capsys, tmp_path, monkeypatch):
    from mimo.commands.cli import main
    from mimo.compose.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY_MOE)
    assert load_config("tiny.yaml").train.fp8.recipe == "blockwise"
    assert main(["check-config", "tiny.yaml"]) == 0, capsys.readouterr()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not result.get("errors"), result


def _blockwise_steps(config_path: str) -> dict:
    """Three steps of the tiny MoE model under blockwise FP8 and three with plain products (the
    same seed): the losses, and which modules took which recipe."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    out = {}
    for name, overrides in (("fp8", []), ("plain", ["train.fp8=null"])):
        run = build_run(load_config(config_path, overrides), dist.get_rank())
        try:
            kinds = {}
            for part in run.model.parts:
                for mn, m in part.module.named_modules():
                    if isinstance(getattr(m, "recipe", None), FP8Site):
                        kinds[f"{part.name}.{mn}"] = m.recipe.kind
            out[name] = {"losses": [train_step(run.model, run.pipeline, s, run.optimizers, run.policy).loss for s in (1, 2, 3)],
                         "kinds": kinds}
        finally:
            run.close()
    return out


def test_a_tiny_moe_model_trains_under_blockwise(pools, tmp_path):
    """A few steps of a tiny MoE VLM with ``train.fp8: {recipe: blockwise}``: every LLM layer's
    GEMMs but the kept last one's (experts among them) and every vision block's take the recipe,
    the losses are finite and near the plain run's, and not equal to them (FP8 in effect)."""
    (tmp_path / "tiny.yaml").write_text(TINY_MOE)
    got = pools(1).run(_blockwise_steps, str(tmp_path / "tiny.yaml"))[0]
    kinds = got["fp8"]["kinds"]
    assert set(kinds.values()) == {"blockwise"} and not got["plain"]["kinds"]
    assert any("experts" in n for n in kinds) and any(n.startswith("vision.") for n in kinds), sorted(kinds)
    assert not any(".layers.3." in n for n in kinds), sorted(kinds)  # bf16_layers: [last]
    fp8, plain = got["fp8"]["losses"], got["plain"]["losses"]
    assert all(math.isfinite(v) for v in fp8) and fp8 != plain, (fp8, plain)
    assert all(abs(a - b) < 0.05 * b for a, b in zip(fp8, plain)), (fp8, plain)


def _compiled_products(device: str, backend: str, rows=(150, 272, 200), kind: str = "blockwise") -> None:
    """A dense and a grouped ``kind`` product under ``torch.compile(dynamic=True)``: no graph
    break, one graph for every row count (of two tiles or more: a tile count of 1 is a size-1
    dim, which dynamo specializes), the eager products and gradients (bit for bit on the CPU)."""
    from torch._dynamo.utils import counters

    g_ = torch.Generator().manual_seed(9)
    w = torch.nn.Parameter(torch.randn(48, 160, generator=g_).to(device, torch.bfloat16))
    experts = torch.nn.Parameter(torch.randn(3, 32, 48, generator=g_).to(device, torch.bfloat16))
    sites = _site(w, kind), _site(experts, kind)

    def layer(x, ends):
        return gemm.grouped_linear(gemm.linear(x, w, None, sites[0]), experts, ends, sites[1])

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, dynamic=True, backend=backend)
    for n in rows:
        x = torch.randn(n, 160, generator=g_).to(device, torch.bfloat16).requires_grad_(True)
        ends = torch.tensor([n // 3, n // 3, n], device=device)
        got = []
        for fn in (layer, compiled):
            w.grad = experts.grad = x.grad = None
            y = fn(x, ends)
            y.float().square().sum().backward()
            got.append([y, x.grad, w.grad, experts.grad])
        for eager_t, compiled_t in zip(*got):
            if device == "cpu":
                torch.testing.assert_close(compiled_t, eager_t, rtol=0, atol=0)
            else:  # inductor fuses the quantization: the same to bf16 rounding
                assert rel_err(compiled_t.float(), eager_t.float()) <= 1e-2
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compiled_blockwise_products_trace_whole_and_once():
    """``train.compile`` under blockwise: the products trace into the graph (``_compiled_products``)."""
    _compiled_products("cpu", "eager", rows=(150, 272))


# ---- the GPU's kernels ----------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (F.scaled_mm block scaling)")
def test_gpu_blockwise_products_against_bf16_and_the_cpu():
    """On the GPU, bf16 operands: the dense product (``F.scaled_mm`` with 1x128 x 128x128 scales
    on sm90 with CUDA 12.9+: the native path, asserted there; its dequantized product elsewhere)
    and the grouped experts (dequantized, bf16 ``torch._grouped_mm``), forward and both
    gradients, against the bf16 product within FP8's rounding (8%) and against the same
    quantization of the same operands on the CPU (1%: accumulation order, bf16 outputs); sizes
    off 128 (partial tiles and blocks) among them."""
    from mimo.parallel import fp8 as fp8_mod

    dev = torch.device("cuda")
    cuda_ver = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    site = FP8Site("blockwise", None, (), None, [torch.nn.Parameter(torch.zeros(16, 16, device=dev))])
    if torch.cuda.get_device_capability() == (9, 0) and cuda_ver >= (12, 9) and hasattr(torch.nn.functional, "scaled_mm"):
        assert site.native(torch.zeros(1, device=dev)), "sm90, CUDA 12.9+: cuBLAS block scaling should run"
    g_ = torch.Generator().manual_seed(7)
    for T, I, O in ((333, 256, 512), (200, 336, 176)):
        x0, w0, g0 = torch.randn(T, I, generator=g_), torch.randn(O, I, generator=g_) * 0.05, torch.randn(T, O, generator=g_)
        we0 = torch.randn(4, O, I, generator=g_) * 0.05
        ends = torch.tensor([40, 40, 150, T])

        def dense(device, fp8):
            x = x0.to(device, torch.bfloat16).requires_grad_(True)
            w = torch.nn.Parameter(w0.to(device, torch.bfloat16))
            y = gemm.linear(x, w, None, _site(w) if fp8 else gemm.DEFAULT_RECIPE)
            y.backward(g0.to(device, torch.bfloat16))
            return [t.detach().float().cpu() for t in (y, x.grad, w.grad)]

        def grouped(device, fp8):
            x = x0.to(device, torch.bfloat16).requires_grad_(True)
            w = torch.nn.Parameter(we0.to(device, torch.bfloat16))
            y = gemm.grouped_linear(x, w, ends.to(device), _site(w) if fp8 else gemm.DEFAULT_RECIPE)
            y.backward(g0.to(device, torch.bfloat16))
            return [t.detach().float().cpu() for t in (y, x.grad, w.grad)]

        for name, fn in (("dense", dense), ("grouped", grouped)):
            gpu8, gpu16, cpu8 = fn(dev, True), fn(dev, False), fn("cpu", True)
            for part, a, b, c in zip(("y", "dx", "dw"), gpu8, gpu16, cpu8):
                assert rel_err(a, b) <= 0.08, (T, name, part, rel_err(a, b))
                assert rel_err(a, c) <= 0.01, (T, name, part, rel_err(a, c))
    # the native product and the dequantized one on the GPU: the same operands, another kernel
    a, b = torch.randn(256, 384, device=dev), torch.randn(512, 384, device=dev) * 0.05
    (aq, ai), (bq, bi) = quantize_blocks(a, E4M3, ROW_TILE), quantize_blocks(b, E4M3, WEIGHT_BLOCK)
    blocks = (ROW_TILE, WEIGHT_BLOCK)
    native = fp8_mod.scaled_mm(aq, bq.t(), ai, bi.t(), torch.float32, site.native(a), blocks=blocks)
    emulated = fp8_mod.scaled_mm(aq, bq.t(), ai, bi.t(), torch.float32, False, blocks=blocks)
    assert rel_err(native, emulated) <= 1e-3, rel_err(native, emulated)  # cuBLAS: ~1.3e-4 on an H100


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.xfail(strict=False, reason="on an H100 (torch 2.11) compiled FP8 products gave zero input and weight gradients, "
                   "row-wise too, even with backend='eager'; unexplained, under investigation (issue 50)")
@pytest.mark.parametrize("kind", ["rowwise", "blockwise"])
def test_gpu_compiled_products_trace_whole_and_once(kind):
    """Under inductor on the GPU (block-wise: ``F.scaled_mm``'s block scaling inside the graph,
    as the ``mimo::scaled_mm_blocks`` op, on sm90). Row-wise beside it: on an H100 with torch
    2.11 both gave the eager forward but zero input and weight gradients when compiled, even
    with ``backend="eager"`` (the CPU's are bit for bit), not yet explained."""
    _compiled_products("cuda", "inductor", rows=(150, 272), kind=kind)
