"""The Qwen3-VL vision tower (``encoders.qwen3_vl``) against transformers' ``Qwen3VLVisionModel``,
and its TP / SP layouts against the one-process tower, judged by the fp64 yardstick (docs/design.md §9.7).

A tiny model with odd sizes: 3 heads of 16 (hidden 48; 6 heads of 8 where tp=2 splits them), depth 5, deepstack after blocks 1 and 3
(not the default), out_hidden 40, patch 4, a 6 x 6 position table. One pack holds images whose
grids are not squares, smaller and larger than the table (interpolated both ways), one of them
cut by ``mimo.data.native_images.preprocess``, and a two-frame video (two attention segments).
Weights are random everywhere (biases and LayerNorms too), set through the HF name mapping.
Each bug planted by hand (a dropped merger all-reduce, align_corners=False, deepstack one block
late, rotary h / w halves swapped, rotate_half's sign, one attention segment per video, raster
position order, tanh GELU in the mergers, SP padding without whole merge blocks, the patch
weight's (C, t) order) fails one of these tests, the numeric ones by 77x to 1.8e5x their bound.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mimo.core.errors import ConfigError, DataError, LayoutError, MimoError
from mimo.core.testing import Yardstick
from mimo.encoders.hf_qwen3_vl import hf_rules, tower_state_from_hf, tower_state_to_hf
from mimo.encoders.qwen3_vl import Qwen3VisionArch, Qwen3VisionTower
from mimo.encoders.tp_state import full_grads
from mimo.parallel.params import param_table, reduce_partial_grads

TOL = 1e-5
HF_CFG = {"depth": 5, "hidden_size": 48, "num_heads": 3, "intermediate_size": 96, "patch_size": 4,
          "out_hidden_size": 40, "num_position_embeddings": 36, "deepstack_visual_indexes": [1, 3]}
ARCH = Qwen3VisionArch.from_hf_config(HF_CFG)
ARCH6 = Qwen3VisionArch.from_hf_config({**HF_CFG, "num_heads": 6})  # head size 8: for tp=2 (3 heads per rank)
# (t, h, w): the first comes from native_images (a 13 x 23 px image -> 16 x 24 px), then images of
# other shapes (table 6 x 6: 2, 4, 6 and 8 x 10 patches), a two-frame video
GRIDS = [(1, 4, 6), (1, 6, 2), (1, 2, 2), (2, 2, 4), (1, 8, 10)]
LEVELS = ["merger", "deepstack[1]", "deepstack[3]"]


def _random_hf_state(seed: int = 0, arch: Qwen3VisionArch = ARCH) -> dict[str, torch.Tensor]:
    """Random weights of the tiny ``Qwen3VLVisionModel`` by HF name (no prefix), the same in
    every process: unit-scale products, nonzero biases, LayerNorms away from 1 / 0."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for rule in hf_rules(arch, prefix=""):
        (name,), shape = rule.theirs, rule.their_shape
        t = torch.randn(shape, generator=g)
        if ".norm" in name or "norm1" in name or "norm2" in name:
            t = (1.0 if name.endswith("weight") else 0.0) + 0.1 * t
        elif name.endswith("bias"):
            t = 0.1 * t
        elif name == "pos_embed.weight":
            t = 0.5 * t
        else:
            t = t / (torch.tensor(shape[1:]).prod().item() ** 0.5)
        out[name] = t
    return out


def _pixels(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels_PJ, grids_N3) of the test pack; image 0 through the real preprocessing."""
    from mimo.data.native_images import NativeImageSpec, preprocess

    spec = NativeImageSpec(patch=4, temporal_patch=2, merge=2, min_pixels=64, max_pixels=4096)
    img = np.random.default_rng(seed).integers(0, 256, (13, 23, 3), dtype=np.uint8)
    first_PJ, grid = preprocess(img, spec)
    assert grid == GRIDS[0]
    g = torch.Generator().manual_seed(seed)
    rest = sum(t * h * w for t, h, w in GRIDS[1:])
    pixels_PJ = torch.cat([first_PJ, torch.randn(rest, ARCH.row_numel, generator=g)])
    return pixels_PJ, torch.tensor(GRIDS)


def _levels(rows_RX: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(zip(LEVELS, rows_RX.split(ARCH.out_hidden, dim=-1)))


def _hf_models(arch: Qwen3VisionArch):
    import transformers

    model = transformers.Qwen3VLVisionModel(transformers.Qwen3VLVisionConfig(**arch.to_hf_config())).eval()
    model.load_state_dict(_random_hf_state(0, arch), strict=True)
    return model, copy.deepcopy(model).double()


def _hf_run(model, arch, pixels_PJ, grids_N3, dY_RX):
    """(levels, pixel grad, grads by mimo name) of the HF model for the loss sum(out * dY)."""
    dtype = next(model.parameters()).dtype
    px = pixels_PJ.detach().to(dtype).clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    out = model(px, grids_N3)
    rows_RX = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
    (rows_RX * dY_RX.to(dtype)).sum().backward()
    grads = tower_state_from_hf({n: p.grad for n, p in model.named_parameters()}, arch, prefix="")
    return _levels(rows_RX.detach()), px.grad, grads


# --------------------------------------------------------------------------- (a) against transformers


@pytest.mark.parametrize("heads", [3, 6])
def test_matches_transformers_outputs_and_gradients(heads):
    """Main merger and every deepstack level, d/dpixels and every weight's gradient: the mimo
    tower (fp32, weights through the HF mapping) against HF in fp64, HF fp32 giving the bound."""
    arch = ARCH if heads == 3 else ARCH6
    hf32, hf64 = _hf_models(arch)
    pixels_PJ, grids_N3 = _pixels()
    tower = Qwen3VisionTower(arch)
    tower.load_full_(tower_state_from_hf(hf32.state_dict(), arch, prefix=""))
    R = pixels_PJ.shape[0] // 4
    dY_RX = torch.randn(R, ARCH.out_width, generator=torch.Generator().manual_seed(2))

    px = pixels_PJ.clone().requires_grad_(True)
    rows_RX = tower(px, grids_N3)
    assert rows_RX.shape == (R, 3 * 40)
    (rows_RX * dY_RX).sum().backward()
    ours = {"out": _levels(rows_RX.detach()), "dpixels": px.grad, "grad": full_grads(tower)}
    refs = []
    for model in (hf32, hf64):
        levels, dpx, grads = _hf_run(model, arch, pixels_PJ, grids_N3, dY_RX)
        refs.append({"out": levels, "dpixels": dpx, "grad": grads})
    ys = Yardstick(TOL)
    ys.check_all(ours, refs[0], refs[1])
    ys.assert_ok("mimo tower vs transformers")
    assert len(ys.measures) == 3 + 1 + len(param_table(tower))


def test_recompute_modes_and_the_gemm_seam():
    """Full and selective recompute give the none-mode gradients; every matrix product (patch
    embedding, 4 per block, 2 per merger) goes through ``gemm.linear``."""
    from mimo.parallel import gemm

    pixels_PJ, grids_N3 = _pixels()
    state = tower_state_from_hf(_random_hf_state(), ARCH, prefix="")
    results = {}
    real_linear, real_F_linear, forbidden_hits, calls = gemm.linear, F.linear, [], []

    def counting(x, w, b=None, recipe=None):
        calls.append(1)
        return real_F_linear(x, w, b)

    def forbidden(*args, **kwargs):
        forbidden_hits.append(1)
        raise AssertionError("a matrix product outside mimo.parallel.gemm.linear")

    for mode in ("none", "full", "selective"):
        tower = Qwen3VisionTower(ARCH)
        tower.load_full_(state)
        tower.set_recompute(mode, None if mode == "full" else 3)
        px = pixels_PJ.clone().requires_grad_(True)
        calls.clear()
        saved = (F.linear, F.conv3d, torch.matmul, torch.mm, torch.einsum)
        gemm.linear, F.linear, F.conv3d, torch.matmul, torch.mm, torch.einsum = counting, *[forbidden] * 5
        try:
            tower(px, grids_N3).square().sum().backward()
        finally:
            gemm.linear, (F.linear, F.conv3d, torch.matmul, torch.mm, torch.einsum) = real_linear, saved
        results[mode] = (px.grad, full_grads(tower), len(calls))
    assert not forbidden_hits
    assert results["none"][2] == 1 + 4 * ARCH.depth + 2 * ARCH.levels
    for mode in ("full", "selective"):
        assert torch.allclose(results[mode][0], results["none"][0], rtol=0, atol=0)
        assert all(torch.equal(results[mode][1][k], v) for k, v in results["none"][1].items())


# --------------------------------------------------------------------------- (b) TP / SP against one process


def _tp_ctx(tp: int, sequence_parallel: bool):
    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import ParallelGrid

    grid = ParallelGrid({"tp": tp})
    group = grid.group("tp")  # collective on the whole world
    return ParallelContext.for_tp(group, sequence_parallel) if dist.get_rank() in grid else None


def _run(tower, pixels_PJ, grids_N3, dY_RX):
    px = pixels_PJ.detach().to(tower.pos_embed.dtype).clone().requires_grad_(True)
    rows_RX = tower(px, grids_N3)
    (rows_RX * dY_RX.to(rows_RX.dtype)).sum().backward()
    reduce_partial_grads(param_table(tower))  # SP: LayerNorm / row-parallel bias grads are partial over TP
    return {"out": _levels(rows_RX.detach()), "dpixels": px.grad, "grad": full_grads(tower)}


def _tp_case(tp: int, sp: bool, heads: int):
    ctx = _tp_ctx(tp, sp)
    if ctx is None:
        return None
    arch = ARCH if heads == 3 else ARCH6
    out: dict = {}
    # TP-invariant init: the layout's shards of the one-process weights
    tower = Qwen3VisionTower(arch, ctx)
    tower.init_weights(7)
    one = Qwen3VisionTower(arch)
    one.init_weights(7)
    got, want = tower.full_state(), one.full_state()
    out["init_invariant"] = list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)

    state = tower_state_from_hf(_random_hf_state(0, arch), arch, prefix="")
    pixels_PJ, grids_N3 = _pixels()
    dY_RX = torch.randn(pixels_PJ.shape[0] // 4, ARCH.out_width, generator=torch.Generator().manual_seed(2))
    runs = []
    for layout, dtype in ((ctx, torch.float32), (None, torch.float32), (None, torch.float64)):
        t = Qwen3VisionTower(arch, layout, dtype=dtype)
        t.load_full_(state)
        runs.append(_run(t, pixels_PJ, grids_N3, dY_RX))
    ys = Yardstick(TOL)
    ys.check_all(*runs)
    out["measures"] = [m.as_dict() for m in ys.measures]

    # an empty pack: rows [0, X], every collective still runs, zero gradients
    tower.zero_grad(set_to_none=True)
    empty = _run(tower, torch.zeros(0, ARCH.row_numel), torch.zeros(0, 3, dtype=torch.long),
                 torch.zeros(0, ARCH.out_width))
    out["empty"] = (tuple(empty["out"]["merger"].shape), all(float(g.abs().sum()) == 0 for g in empty["grad"].values()))
    if tp == 3:
        try:
            Qwen3VisionTower(Qwen3VisionArch(**{**vars(arch), "heads": 4}), ctx)
            out["layout_error"] = ""
        except LayoutError as e:
            out["layout_error"] = str(e)
    return out


@pytest.mark.parametrize("tp,sp,heads", [(2, False, 6), (3, False, 3), (2, True, 6), (3, True, 6)])
def test_tensor_parallel_matches_one_process(pools, tp, sp, heads):
    """TP 2 (6 heads: 3 per rank) and 3 (3 or 6 heads; merge width 192), with and without sequence parallel (136 rows;
    at tp=3 padded to 144, whole merge blocks per rank): outputs, d/dpixels and every full weight gradient
    equal the one-process tower's (yardstick vs its fp64 run); init is TP-invariant."""
    results = [r for r in pools(3).run(_tp_case, tp, sp, heads) if r]
    assert len(results) == tp
    ys = Yardstick(TOL)
    for rank, r in enumerate(results):
        ys.extend(r["measures"], prefix=f"rank {rank}: ")
        assert r["init_invariant"]
        assert r["empty"] == ((0, ARCH.out_hidden), True)
        if tp == 3:
            assert "tp=3 does not divide" in r["layout_error"] and "heads (4)" in r["layout_error"]
    ys.assert_ok(f"tp={tp} sp={sp}")
    assert len(ys.measures) == tp * (3 + 1 + len(param_table(Qwen3VisionTower(ARCH))))


# --------------------------------------------------------------------------- (c) weight mapping


def test_hf_mapping_round_trip_is_exact(tmp_path):
    hf_tower = {f"model.visual.{k}": v.to(torch.bfloat16) for k, v in _random_hf_state(3).items()}
    llm = {"model.language_model.embed_tokens.weight": torch.randn(10, 8), "lm_head.weight": torch.randn(10, 8)}
    ours = tower_state_from_hf({**llm, **hf_tower}, ARCH)  # default prefix: model.visual.
    tower = Qwen3VisionTower(ARCH)
    assert set(ours) == set(tower.full_state())  # every tensor of the tower
    assert all(ours[k].shape == v.shape for k, v in tower.full_state().items())
    back = tower_state_to_hf(ours, ARCH)
    assert list(back) == list(hf_tower)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in hf_tower.items())
    again = tower_state_from_hf(back, ARCH)
    assert all(torch.equal(again[k], v) for k, v in ours.items())
    # a bare Qwen3VLVisionModel (no prefix) maps the same tensors
    bare = tower_state_from_hf({k.removeprefix("model.visual."): v for k, v in hf_tower.items()}, ARCH, prefix="")
    assert all(torch.equal(bare[k], v) for k, v in ours.items())
    # a checkpoint left in its safetensors file: read region by region, exported back whole (LLM included)
    from safetensors.torch import save_file

    from mimo.encoders.hf_qwen3_vl import import_hf_state
    from mimo.encoders.weights import lazy_safetensors

    save_file({**llm, **hf_tower}, str(tmp_path / "model.safetensors"))
    lazy = lazy_safetensors(str(tmp_path / "model.safetensors"))
    weights = import_hf_state(lazy, ARCH)
    tower.load_weights_(weights)
    assert all(torch.equal(v, ours[k].float()) for k, v in tower.full_state().items())
    exported = weights.export()
    assert list(exported) == list(lazy)  # the file's order
    assert all(torch.equal(exported[k], v) for k, v in {**llm, **hf_tower}.items())


def test_hf_names_are_transformers_names():
    """The rules name exactly the tower tensors of ``Qwen3VLForConditionalGeneration`` (meta
    device: names and shapes only)."""
    import transformers

    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 64, "vocab_size": 64, "head_dim": 16,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]}}
    cfg = transformers.Qwen3VLConfig(vision_config=HF_CFG, text_config=text)
    with torch.device("meta"):
        model = transformers.Qwen3VLForConditionalGeneration(cfg)
    state = model.state_dict()
    visual = {k: tuple(v.shape) for k, v in state.items() if k.startswith("model.visual.")}
    rules = {r.theirs[0]: r.their_shape for r in hf_rules(ARCH)}
    assert visual == rules


def test_hf_mapping_reports_what_does_not_fit():
    hf = _random_hf_state()
    missing = {k: v for k, v in hf.items() if k != "blocks.2.attn.qkv.bias"}
    with pytest.raises(MimoError, match=r"missing tensor 'blocks.2.attn.qkv.bias'"):
        tower_state_from_hf(missing, ARCH, prefix="")
    with pytest.raises(MimoError, match=r"'merger.linear_fc2.weight' has shape \(41, 192\)"):
        tower_state_from_hf({**hf, "merger.linear_fc2.weight": torch.zeros(41, 192)}, ARCH, prefix="")
    with pytest.raises(MimoError, match=r"belongs to block 5, but arch.depth is 5"):
        tower_state_from_hf({**hf, "blocks.5.norm1.weight": torch.zeros(48)}, ARCH, prefix="")
    with pytest.raises(MimoError, match=r"missing tensor 'model.visual.patch_embed.proj.weight'"):
        tower_state_from_hf(hf, ARCH)  # a bare vision model's names under the default prefix
    ours = tower_state_from_hf(hf, ARCH, prefix="")
    with pytest.raises(MimoError, match=r"missing tensor 'deepstack_mergers.1.fc1.bias'"):
        tower_state_to_hf({k: v for k, v in ours.items() if k != "deepstack_mergers.1.fc1.bias"}, ARCH)


# --------------------------------------------------------------------------- (d) bad input, config


def test_bad_input_is_a_clear_data_error():
    tower = Qwen3VisionTower(ARCH)
    tower.init_weights(0)
    J = ARCH.row_numel
    with pytest.raises(DataError, match=r"19 pixel rows, but the grids \[\[1, 4, 6\]\] hold 24 patches"):
        tower(torch.zeros(19, J), torch.tensor([[1, 4, 6]]))
    with pytest.raises(DataError, match=r"image 1: grid \(t, h, w\) = \(1, 3, 4\): h and w must be multiples of the spatial merge size 2"):
        tower(torch.zeros(16, J), torch.tensor([[1, 2, 2], [1, 3, 4]]))
    with pytest.raises(DataError, match=r"pixel rows \[P, 96\]"):
        tower(torch.zeros(24, 48), torch.tensor([[1, 4, 6]]))
    with pytest.raises(DataError, match=r"\[N, 3\] integer tensor"):
        tower(torch.zeros(24, J), torch.tensor([4, 6]))
    with pytest.raises(DataError, match=r"must be integers"):
        tower(torch.zeros(24, J), torch.tensor([[1.0, 4.0, 6.0]]))
    with pytest.raises(DataError, match=r"image 0: grid \(t, h, w\) = \(0, 4, 6\) has an empty side"):
        tower(torch.zeros(0, J), torch.tensor([[0, 4, 6]]))


def test_arch_from_hf_config_and_validation():
    whole = {"model_type": "qwen3_vl", "vision_config": {**HF_CFG, "hidden_act": "gelu_pytorch_tanh",
                                                          "rope_parameters": {"rope_type": "axial", "rope_theta": 500.0}}}
    arch = Qwen3VisionArch.from_hf_config(whole)
    assert (arch.depth, arch.hidden, arch.heads, arch.mlp, arch.out_hidden, arch.deepstack_layers, arch.rope_theta,
            arch.patch, arch.temporal_patch, arch.spatial_merge) == (5, 48, 3, 96, 40, [1, 3], 500.0, 4, 2, 2)
    assert Qwen3VisionArch.from_hf_config(arch.to_hf_config()) == arch
    bad = Qwen3VisionArch(depth=4, hidden=36, heads=2, mlp=8, out_hidden=8, num_position_embeddings=30,
                          deepstack_layers=[3, 1], act="relu")
    problems = bad.validate("arch")
    assert any("arch.act: 'relu'" in p for p in problems)
    assert any("arch.deepstack_layers: [3, 1] must be increasing" in p for p in problems)
    fixed = Qwen3VisionArch(**{**vars(bad), "act": "gelu", "deepstack_layers": [1, 4]})
    assert any("in 0..3 (depth=4)" in p for p in fixed.validate("arch"))
    fixed.deepstack_layers = [1]
    problems = fixed.validate("arch")
    assert any("head size 18" in p for p in problems) and any("30 is not a square" in p for p in problems)
    with pytest.raises(ConfigError, match="not a square"):
        Qwen3VisionTower(fixed)
