"""The TP vision tower and projectors against the originals, on a 4-rank gloo pool.

Parity (fp32, <= 1e-5): timm models shaped like vit_base_patch16_224, a CLIP tower
(vit_base_patch16_clip_quickgelu_224.openai: pre-norm, QuickGELU, projection head) and a SigLIP
tower (no [CLS], attention-pool head), and Hugging Face CLIP / SigLIP vision checkpoints, at
tp 1-4 (12 heads, so tp=3 too) and feature layers -1, -2 and post_norm; weight gradients at
tp=2, mapped back to the original's names. Small models: D=96, 3 blocks, 32 px, patch 8.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mimo.encoders.config import EncoderModuleConfig, ProjectorConfig, VitArch, VitInit
from mimo.encoders.projector import build_projector
from mimo.encoders.tp_state import full_grads
from mimo.parallel.params import param_table, reduce_partial_grads
from mimo.encoders.verify import EncoderSource, summarise, verify_case
from mimo.encoders.vit import VisionTransformer
from mimo.parallel.context import ParallelContext
from mimo.parallel.grid import ParallelConfig, ParallelGrid
from mimo.core.testing import rel_err

WORLD = 4
TOL = 1e-5
SMALL = {"depth": 3, "embed_dim": 96, "num_heads": 12, "img_size": 32, "patch_size": 8}
HF_SMALL = {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3, "num_attention_heads": 12,
            "image_size": 32, "patch_size": 8}
FEATURES = [-1, -2, "post_norm"]
ARCH = VitArch(image_size=32, patch=8, hidden=96, layers=3, heads=12, mlp=384, pre_norm=True, act="quick_gelu")

TIMM = {
    "timm_vit": EncoderSource("timm", "vit_base_patch16_224", SMALL),
    "timm_clip": EncoderSource("timm", "vit_base_patch16_clip_quickgelu_224.openai", SMALL),
    "timm_siglip": EncoderSource("timm", "vit_base_patch16_siglip_224", SMALL),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Small HF checkpoints: CLIP (vision only) and SigLIP (with its attention-pool head)."""
    import transformers

    out = {}
    for family, model_cls, cfg_cls in (
        ("clip", transformers.CLIPVisionModel, transformers.CLIPVisionConfig),
        ("siglip", transformers.SiglipVisionModel, transformers.SiglipVisionConfig),
    ):
        torch.manual_seed(1)
        path = tmp_path_factory.mktemp(f"hf_{family}")
        model_cls(cfg_cls(**HF_SMALL)).save_pretrained(path)
        out[family] = str(path)
    return out


def source_of(name: str, hf_dirs) -> EncoderSource:
    if name in TIMM:
        return TIMM[name]
    if name == "hf_clip_config":  # random init from config.json (must agree across ranks)
        return EncoderSource("hf", hf_dirs["clip"], hf_weights=False)
    return EncoderSource("hf", hf_dirs[name.removeprefix("hf_")], hf_weights=True)


def check(results, tol: float = TOL) -> dict:
    report = summarise(results, tol)
    assert report["ok"], report["yardstick"]  # the tightest tensors: error vs fp64, the original's fp32 error, bound
    return report


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["timm_vit", "timm_clip", "timm_siglip", "hf_clip", "hf_siglip"])
def test_parity_with_original(pools, hf_dirs, name, tp):
    """Features at -1, -2, post_norm (and weight gradients at tp=2) equal the original's."""
    source = source_of(name, hf_dirs)
    results = pools(WORLD).run(verify_case, source, tp, FEATURES, None, tp, 2, tp == 2, False, tp % 2 == 0)
    report = check(results)
    per_image = 16 + (1 if "siglip" not in name and tp % 2 else 0)  # [CLS] kept at odd tp
    assert report["rows"] == 2 * per_image
    keys = {k for r in results if r for k in r["errors"]}
    assert {f"features[{fl}]" for fl in FEATURES} <= keys
    if tp == 2:  # every weight of the tower had its gradient compared
        assert sum(k.startswith("grad[post_norm]") for k in keys) >= 12 * 3 + 4


@pytest.mark.parametrize("name,tp", [("timm_clip", 2), ("hf_siglip", 4), ("timm_vit", 3), ("hf_clip_config", 2)])
def test_sequence_parallel(pools, hf_dirs, name, tp):
    """SP: 3 images x 17 or 16 rows, padded to a multiple of tp; features and gradients."""
    results = pools(WORLD).run(verify_case, source_of(name, hf_dirs), tp, [-2, "post_norm"], None, 5, 3, True, True)
    check(results)


@pytest.mark.parametrize("name", ["timm_vit", "hf_clip"])
def test_resampled_position_embeddings(pools, hf_dirs, name):
    """At 48 px (weights for 32 px): timm's resample_abs_pos_embed / HF's interpolate_pos_encoding."""
    results = pools(WORLD).run(verify_case, source_of(name, hf_dirs), 2, [-2, "post_norm"], 48, 7, 2, True)
    check(results)
    assert all(r["resampled"] for r in results if r)


# --------------------------------------------------------------------------- TP-invariant init


def _tp_ctx(tp: int, sequence_parallel: bool = False) -> ParallelContext | None:
    """A standalone tower's context over ranks 0..tp-1 (collective on the pool); None outside it."""
    grid = ParallelGrid({"tp": tp})
    group = grid.group("tp")
    return ParallelContext.for_tp(group, sequence_parallel) if dist.get_rank() in grid else None


def _init_case(tp: int, seed: int):
    ctx = _tp_ctx(tp)
    if ctx is None:
        return None
    tower = VisionTransformer(ARCH, "post_norm", ctx=ctx)
    tower.init_weights(seed)
    ref = VisionTransformer(ARCH, "post_norm")
    ref.init_weights(seed)
    out = {}
    for kind in ("mlp2x_gelu", "linear"):
        proj, proj_ref = build_projector(kind, 96, 24, ctx), build_projector(kind, 96, 24)
        proj.init_weights(seed)
        proj_ref.init_weights(seed)
        out[kind] = all(torch.equal(a, b) for a, b in zip(proj.full_state().values(), proj_ref.full_state().values()))
    got, want = tower.full_state(), ref.full_state()
    out["tower"] = list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    out["differs_by_seed"] = not torch.equal(want["blocks.0.attn.qkv.weight"], _seeded(seed + 1)["blocks.0.attn.qkv.weight"])
    return out


def _seeded(seed):
    t = VisionTransformer(ARCH, "post_norm")
    t.init_weights(seed)
    return t.full_state()


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_init_is_tp_invariant(pools, tp):
    results = [r for r in pools(WORLD).run(_init_case, tp, 11) if r]
    assert len(results) == tp
    assert all(all(r.values()) for r in results), results


# --------------------------------------------------------------------------- projectors


def _projector_case(tp: int, seed: int):
    ctx = _tp_ctx(tp)
    if ctx is None:
        return None
    g = torch.Generator().manual_seed(seed)
    Din, Dout, T = 12, 16, 7
    errs = {}
    for kind in ("mlp2x_gelu", "linear"):
        x_full = torch.randn(T, Din, generator=g)
        dy = torch.randn(T, Dout, generator=g)
        ref = {"linear_1.weight": torch.randn(Dout, Din, generator=g), "linear_1.bias": torch.randn(Dout, generator=g),
               "linear_2.weight": torch.randn(Dout, Dout, generator=g), "linear_2.bias": torch.randn(Dout, generator=g)}
        if kind == "linear":
            ref = {"linear.weight": ref["linear_1.weight"], "linear.bias": ref["linear_1.bias"]}
        ref = {k: v.requires_grad_(True) for k, v in ref.items()}
        xr = x_full.clone().requires_grad_(True)
        if kind == "linear":
            yr = F.linear(xr, ref["linear.weight"], ref["linear.bias"])
        else:  # plain torch LLaVA-1.5 projector
            h = F.gelu(F.linear(xr, ref["linear_1.weight"], ref["linear_1.bias"]))
            yr = F.linear(h, ref["linear_2.weight"], ref["linear_2.bias"])
        yr.backward(dy)

        proj = build_projector(kind, Din, Dout, ctx)
        proj.load_full_({k: v.detach() for k, v in ref.items()})
        x = x_full.clone().requires_grad_(True)
        y = proj(x)
        errs[f"{kind}:out"] = rel_err(y, yr)
        y.backward(dy)
        errs[f"{kind}:dx"] = rel_err(x.grad, xr.grad)
        for k, v in full_grads(proj).items():
            errs[f"{kind}:d{k}"] = rel_err(v, ref[k].grad)
    return errs


@pytest.mark.parametrize("tp", [1, 2])
def test_projectors_match_plain_torch(pools, tp):
    results = [r for r in pools(WORLD).run(_projector_case, tp, 3) if r]
    worst = max((e, k) for r in results for k, e in r.items())
    assert worst[0] <= TOL, worst
    assert len(results[0]) == 2 * 2 + 4 + 2


# --------------------------------------------------------------------------- empty batch


def _empty_case(tp: int, sp: bool):
    ctx = _tp_ctx(tp, sp)
    if ctx is None:
        return None
    tower = VisionTransformer(ARCH, -2, ctx=ctx)
    tower.init_weights(0)
    y = tower(torch.zeros(0, 3, 32, 32))
    y.sum().backward()
    reduce_partial_grads(param_table(tower))  # every collective, this one too
    grads = full_grads(tower)
    return {"shape": tuple(y.shape), "zero_grads": all(float(g.abs().sum()) == 0.0 for g in grads.values())}


@pytest.mark.parametrize("sp", [False, True])
def test_empty_batch_runs_a_defined_step(pools, sp):
    """No images: rows [0, D], every collective still runs, zero gradients."""
    results = [r for r in pools(WORLD).run(_empty_case, 2, sp) if r]
    assert results == [{"shape": (0, 96), "zero_grads": True}] * 2


# --------------------------------------------------------------------------- the encoder module


def _encoder_case(path: str, tp: int):
    from mimo.encoders.hf_import import build_hf_model, hf_features, load_hf_state, read_hf_config
    from mimo.encoders.model import VisionEncoder
    from mimo.encoders.weights import LazyTensor
    from mimo.parallel.params import param_table

    ctx = _tp_ctx(tp)
    if ctx is None:
        return None
    family, vision, _ = read_hf_config(path)
    arch = VitArch(image_size=32, patch=8, hidden=96, layers=3, heads=12, mlp=192, pre_norm=True, act="quick_gelu")
    cfg = EncoderModuleConfig(kind="vit", arch=arch, init=VitInit(hf=path), projector=ProjectorConfig("mlp2x_gelu"),
                              feature_layer=-2, freeze=["tower"], parallel=ParallelConfig(tp=tp))
    enc = VisionEncoder(cfg, llm_hidden=24, ctx=ctx)
    read, lazy_read = [], LazyTensor.__getitem__

    def counting(t, index):
        out = lazy_read(t, index)
        read.append(out.numel())
        return out

    LazyTensor.__getitem__ = counting
    try:
        enc.init_weights(seed=5)  # imports the checkpoint: each rank reads its own slices only
    finally:
        LazyTensor.__getitem__ = lazy_read
    local = sum(p.numel() for p in enc.tower.parameters())
    full = sum(math.prod(i.placement.full_shape) for i in param_table(enc.tower).values())
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    out = enc(pixels)
    out.sum().backward()
    original = build_hf_model(family, vision, path)
    with torch.no_grad():
        feats = hf_features(original, family, pixels, -2)[:, 1:].reshape(-1, 96)
        ref = enc.projector(feats)
    exported, saved = enc.export_tower(), load_hf_state(path)
    return {
        "rows": out.shape[0] == 2 * cfg.rows_per_image == 32,
        "reads_only_local_slices": sum(read) == local < full,
        "out": rel_err(out, ref) <= TOL,
        "tower_frozen": all(p.grad is None and not p.requires_grad for p in enc.tower.parameters()),
        "projector_trained": all(p.grad is not None for p in enc.projector.parameters()),
        "export_exact": list(exported) == list(saved) and all(torch.equal(exported[k], saved[k]) for k in saved),
    }


def test_encoder_module_frozen_tower_from_hf(pools, hf_dirs):
    results = [r for r in pools(WORLD).run(_encoder_case, hf_dirs["clip"], 2) if r]
    assert len(results) == 2 and all(all(r.values()) for r in results), results


@pytest.mark.parametrize("change", [{"heads": 6}, {"act": "quick_gelu"}])
def test_parity_check_catches_a_wrong_tower(pools, change):
    """The comparison can fail: a tower with the wrong head split or activation is caught."""
    results = [r for r in pools(WORLD).run(_mismatch_case, TIMM["timm_vit"], 2, change) if r is not None]
    assert len(results) == 2 and all(r > 1e-3 for r in results), results


def _mismatch_case(source: EncoderSource, tp: int, change: dict):
    from mimo.encoders.timm_import import create_timm_model, import_timm_state, timm_arch, timm_features

    ctx = _tp_ctx(tp)
    if ctx is None:
        return None
    torch.manual_seed(0)
    model = create_timm_model(source.name, **source.kwargs).eval()
    arch = dataclasses.replace(timm_arch(model), **change)
    tower = VisionTransformer(arch, "post_norm", drop_class_token=False, ctx=ctx)
    tower.load_weights_(import_timm_state(model.state_dict(), arch))
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return rel_err(tower(pixels), timm_features(model, pixels, "post_norm").reshape(-1, 96))


# --------------------------------------------------------------------------- the base: context, placements, GEMM seam


def _seam_case(tp: int, sp: bool):
    """Forward + backward of a tower and a projector with every other matrix product forbidden."""
    from mimo.parallel import gemm

    ctx = _tp_ctx(tp, sp)
    if ctx is None:
        return None
    tower = VisionTransformer(ARCH, "post_norm", ctx=ctx)
    proj = build_projector("mlp2x_gelu", 96, 24, ctx)
    tower.init_weights(0)
    proj.init_weights(1)
    real_linear, weights_seen = F.linear, []

    def counting(x, w, b=None, recipe=gemm.DEFAULT_RECIPE):
        weights_seen.append(w.data_ptr())  # a view of a parameter (the patch embedding's) shares its storage
        return real_linear(x, w, b)

    def forbidden(*args, **kwargs):
        raise AssertionError("a matrix product outside mimo.parallel.gemm.linear")

    patches = [(gemm, "linear", counting)] + [(obj, name, forbidden) for obj, name in (
        (F, "linear"), (F, "conv2d"), (torch, "matmul"), (torch, "mm"), (torch, "bmm"), (torch, "einsum"),
        (torch.Tensor, "__matmul__"))]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
        proj(tower(pixels)).square().sum().backward()
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    matrices = {p.data_ptr() for m in (tower, proj) for n, p in m.named_parameters() if n.endswith("weight") and p.dim() >= 2}
    return {"calls": len(weights_seen), "every_matrix": set(weights_seen) == matrices,
            "grads": all(p.grad is not None for m in (tower, proj) for p in m.parameters())}


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (3, True)])
def test_every_matrix_product_goes_through_the_gemm_seam(pools, tp, sp):
    """Patch embedding, q|k|v, attention out, fc1, fc2 per block, the projector's two linears:
    each one call of ``gemm.linear`` (F.linear / conv2d / matmul would raise)."""
    results = [r for r in pools(WORLD).run(_seam_case, tp, sp) if r]
    assert results == [{"calls": 1 + 4 * ARCH.layers + 2, "every_matrix": True, "grads": True}] * tp


def _partial_case(tp: int, sp: bool):
    from mimo.encoders.model import VisionEncoder
    from mimo.parallel.params import param_table

    ctx = _tp_ctx(tp, sp)
    if ctx is None:
        return None
    cfg = EncoderModuleConfig(kind="vit", arch=ARCH, projector=ProjectorConfig("mlp2x_gelu"), feature_layer="post_norm",
                              parallel=ParallelConfig(tp=tp, sequence_parallel=sp))
    enc = VisionEncoder(cfg, llm_hidden=24, ctx=ctx)
    table = param_table(enc)
    return {"sp": (enc.tower.sequence_parallel, enc.tower.blocks[0].mlp.fc1.sequence_parallel,
                   enc.projector.linear_1.sequence_parallel),
            "partial": {n: i.placement.partial for n, i in table.items() if i.placement.partial},
            "names": list(table)}


@pytest.mark.parametrize("tp,sp", [(2, True), (2, False), (1, True)])
def test_sequence_parallel_comes_from_the_context_and_partial_grads_are_marked(pools, tp, sp):
    """SP is the context's (on only with tp > 1), never the projector's; under SP exactly the
    LayerNorms and the row-parallel biases (each rank sees only its rows) are TP-partial."""
    results = [r for r in pools(WORLD).run(_partial_case, tp, sp) if r]
    on = sp and tp > 1
    for r in results:
        assert r["sp"] == (on, on, False)
        want = {n for n in r["names"] if n.startswith("tower.") and (".norm" in n or n.endswith(("proj.bias", "fc2.bias")))}
        assert set(r["partial"]) == (want if on else set()) and all(p == ("tp",) for p in r["partial"].values())
    if on:
        assert len(results[0]["partial"]) == 2 * (1 + 2 * ARCH.layers + 1) + 2 * ARCH.layers  # norm_pre, 2 per block, norm
