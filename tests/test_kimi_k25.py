"""Kimi-K2.5 (issue 56): the MoonViT tower and its projector (``kind: kimi_k25``), its weights under
every naming, ``mimo import-hf`` / ``export-hf`` / ``verify-hf`` of ``Kimi_K25ForConditionalGeneration``,
and training ``configs/examples/kimi-k2.5.yaml`` (fp64 yardstick, docs/design.md §9.7).

* Preprocessing: ``mimo.data.native_images`` under Kimi's rule (``resize: navit``) gives
  transformers' ``Kimi_K25ImageProcessor`` pixels bit for bit (images scaled down, padded to whole
  merge windows, neither), listed window by window (the processor's raster order, permuted here by
  the test's own reshape).
* The tower (3 heads of 16, depth 3, patch 4, a 6 x 6 position table: grids smaller and larger, so
  the bicubic resampling works both ways) against transformers' ``Kimi_K25VisionModel`` +
  ``mm_projector`` on images of four sizes through both preprocessings: outputs, d/dpixels and every
  weight gradient; at tp 2 (6 heads of 8) with and without sequence parallelism against one process.
* Weights: transformers' ``state_dict`` names, Moonshot's published names (fused ``wqkv`` with q / k
  rows in rotary pairs) and ``save_pretrained``'s give the same tower; export is exact.
* ``import-hf`` -> ``export-hf`` at tp 2: transformers loads the export with every tensor of the source
  (a ``save_pretrained`` directory: its tied head not stored, as there); a directory in
  ``state_dict`` names comes back file for file; the published naming imports too.
* ``verify-hf`` of a tiny Kimi-K2.5 (DeepSeek-V3 text: q_lora_rank set, 6 routed experts + 1 shared,
  first layer dense, n_group 2 / topk_group 1, a tied head) at tp 1, tp 2 and ep 2.
* ``check-config`` and ``verify-train`` of the example on the demo data's native split (images of
  six sizes, scaled down and padded; its videos skipped) at the example's layout: tower dp 2 on
  ranks 0-1, LLM tp 2 (SP) with ep 2 on ranks 2-3.
* Clear errors: a video grid, a ``video`` section, config fields the tower cannot express.

Bugs planted by hand in the tower (h / w swapped in the rotary, bilinear for bicubic, align_corners
True, the merge window read column-major, the projector's norm dropped, the final norm dropped) each
fail ``test_tower_matches_transformers`` and verify-hf.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml

from mimo.commands.cli import main
from mimo.core.errors import ConfigError, DataError, LayoutError, MimoError
from mimo.core.testing import Yardstick
from mimo.encoders.config import MoonViTArch
from mimo.encoders.hf_kimi_k25 import checkpoint_naming, hf_rules, import_hf_state, tower_state_from_hf, tower_state_to_hf
from mimo.encoders.moonvit import MoonViTTower
from mimo.encoders.tp_state import full_grads
from mimo.parallel.params import param_table, reduce_partial_grads

TOL = 1e-5
WORLD = 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "configs", "examples", "kimi-k2.5.yaml")
IDS = dict(image_token_id=93, video_token_id=94, vision_start_token_id=95, vision_end_token_id=96)
TEXT = dict(model_type="deepseek_v3", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=12,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=6, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            max_position_embeddings=512)
VISION = dict(patch_size=14, pos_emb_height=6, pos_emb_width=6, num_attention_heads=2, num_hidden_layers=2,
              hidden_size=24, intermediate_size=40)
# the tower test's: patch 4, 3 heads of 16 (6 heads of 8 for tp 2), out 40
TOWER = dict(patch_size=4, pos_emb_height=6, pos_emb_width=6, num_attention_heads=3, num_hidden_layers=3, hidden_size=48,
             intermediate_size=64)
SIZES = [(13, 23), (37, 50), (9, 30), (8, 8)]  # (h, w) pixels: padded, scaled down and padded, padded, neither
MAX_PATCHES = 64


def kimi_config(vision=VISION, text=TEXT, **top):
    import transformers

    return transformers.Kimi_K25Config(text_config=dict(text), vision_config=dict(vision),
                                       projection_hidden_size=vision["hidden_size"], **{**IDS, **top})


def tower_arch(heads: int = 3) -> MoonViTArch:
    return MoonViTArch.from_hf_config(kimi_config(dict(TOWER, num_attention_heads=heads), dict(TEXT, hidden_size=40)).to_dict())


def image_spec(arch: MoonViTArch):
    from mimo.data.native_images import NativeImageSpec

    return NativeImageSpec(patch=arch.patch, temporal_patch=1, merge=arch.spatial_merge, resize="navit",
                           max_patches=MAX_PATCHES, max_side=512)


def pictures():
    from PIL import Image

    return [Image.fromarray(np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
            for h, w in SIZES]


def to_blocks(raster_PJ: torch.Tensor, grids_N3: torch.Tensor, m: int) -> torch.Tensor:
    """The test's own permutation: each image's raster-order rows, window by window."""
    out, first = [], 0
    for t, h, w in grids_N3.tolist():
        rows = raster_PJ[first:first + h * w].reshape(h // m, m, w // m, m, -1)
        out.append(rows.permute(0, 2, 1, 3, 4).reshape(h * w, -1))
        first += h * w
    return torch.cat(out)


def hf_processed(arch: MoonViTArch):
    """transformers' processor on ``pictures()``: (pixel_values ``[P, 3, p, p]``, grids)."""
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    proc = Kimi_K25ImageProcessor(patch_size=arch.patch, merge_size=arch.spatial_merge, max_patches=MAX_PATCHES,
                                  size={"max_height": 512, "max_width": 512})
    out = proc(images=pictures(), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def test_preprocessing_is_the_processors():
    from mimo.data.native_images import image_grid, preprocess

    arch = tower_arch()
    spec = image_spec(arch)
    hf_px, hf_grids = hf_processed(arch)
    ours = [preprocess(img, spec) for img in pictures()]
    assert [list(g) for _, g in ours] == hf_grids.tolist() == [[1, 4, 6], [1, 8, 10], [1, 4, 8], [1, 2, 2]]
    assert [list(image_grid(h, w, spec)) for h, w in SIZES] == hf_grids.tolist()  # from the size alone
    rows = torch.cat([r for r, _ in ours])
    assert torch.equal(rows, to_blocks(hf_px.flatten(1), hf_grids, 2))
    assert torch.equal(MoonViTTower.hf_pixels(arch, rows, hf_grids), hf_px)


# --------------------------------------------------------------------------- the tower


def random_hf_tower(arch_heads: int = 3, seed: int = 0):
    """transformers' (vision model, projector) of the test tower, random weights (biases and norms too)."""
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel

    cfg = kimi_config(dict(TOWER, num_attention_heads=arch_heads), dict(TEXT, hidden_size=40))
    vision, projector = Kimi_K25VisionModel(cfg.vision_config).eval(), Kimi_K25MultimodalProjection(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*vision.named_parameters(), *projector.named_parameters()]:
            t = torch.randn(p.shape, generator=g)
            if "norm" in name:
                t = (1.0 if name.endswith("weight") else 0.0) + 0.1 * t
            elif name.endswith("bias"):
                t = 0.1 * t
            elif "position_embeddings" in name:
                t = 0.5 * t
            else:
                t = t / p[0].numel() ** 0.5
            p.copy_(t)
    return vision, projector


def hf_tower_state(vision, projector, prefix: str = "model.") -> dict[str, torch.Tensor]:
    return {**{f"{prefix}vision_tower.{k}": v for k, v in vision.state_dict().items()},
            **{f"{prefix}mm_projector.{k}": v for k, v in projector.state_dict().items()}}


def test_tower_matches_transformers():
    """MoonViT + projector on the four images (mimo's rows from mimo's preprocessing, transformers'
    from its processor): rows, d/dpixels and every weight gradient within the yardstick of the
    fp64 run; the weights mapped by the rules from transformers' names."""
    arch = tower_arch()
    vision, projector = random_hf_tower()
    tower = MoonViTTower(arch)
    tower.load_full_(tower_state_from_hf(hf_tower_state(vision, projector), arch))
    from mimo.data.native_images import preprocess

    spec = image_spec(arch)
    ours_px = torch.cat([preprocess(img, spec)[0] for img in pictures()])
    hf_px, grids = hf_processed(arch)
    R = ours_px.shape[0] // 4
    dY = torch.randn(R, arch.out_hidden, generator=torch.Generator().manual_seed(2))

    px = ours_px.clone().requires_grad_(True)
    rows = tower(px, grids)
    assert rows.shape == (R, 40)
    (rows * dY).sum().backward()
    ours = {"out": rows.detach(), "dpixels": px.grad, "grad": full_grads(tower)}
    refs = []
    for dtype in (torch.float32, torch.float64):
        v, p = copy.deepcopy(vision).to(dtype), copy.deepcopy(projector).to(dtype)
        x = hf_px.to(dtype).clone().requires_grad_(True)
        out = p(v(x, grids).pooler_output).squeeze(1)
        (out * dY.to(dtype)).sum().backward()
        grads = {f"model.vision_tower.{n}": q.grad for n, q in v.named_parameters()}
        grads.update({f"model.mm_projector.{n}": q.grad for n, q in p.named_parameters()})
        refs.append({"out": out.detach(), "dpixels": to_blocks(x.grad.flatten(1), grids, 2),
                     "grad": tower_state_from_hf(grads, arch)})
    ys = Yardstick(TOL)
    ys.check_all(ours, refs[0], refs[1])
    ys.assert_ok("MoonViT vs transformers")
    assert len(ys.measures) == 2 + len(param_table(tower))


def _tp_case(sp: bool):
    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import ParallelGrid

    grid = ParallelGrid({"tp": 2})
    group = grid.group("tp")
    ctx = ParallelContext.for_tp(group, sp)
    arch = tower_arch(6)
    state = tower_state_from_hf(hf_tower_state(*random_hf_tower(6)), arch)
    g = torch.Generator().manual_seed(3)
    grids = torch.tensor([[1, 4, 6], [1, 8, 10], [1, 2, 2]])
    pixels = torch.randn(int(grids.prod(1).sum()), arch.row_numel, generator=g)
    dY = torch.randn(pixels.shape[0] // 4, arch.out_hidden, generator=g)
    runs = []
    for layout, dtype in ((ctx, torch.float32), (None, torch.float32), (None, torch.float64)):
        tower = MoonViTTower(arch, layout, dtype=dtype)
        tower.load_full_(state)
        px = pixels.to(dtype).clone().requires_grad_(True)
        rows = tower(px, grids)
        (rows * dY.to(dtype)).sum().backward()
        reduce_partial_grads(param_table(tower))
        runs.append({"out": rows.detach(), "dpixels": px.grad, "grad": full_grads(tower)})
    ys = Yardstick(TOL)
    ys.check_all(*runs)
    return [m.as_dict() for m in ys.measures] if dist.get_rank() == 0 else None


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_tower_matches_one_process(pools, sp):
    """tp 2 (6 heads: 3 per rank), with and without sequence parallelism: rows, d/dpixels and
    every full weight gradient equal the one-process tower's."""
    measures = pools(WORLD).run(_tp_case, sp)[0]
    ys = Yardstick(TOL)
    ys.extend(measures)
    ys.assert_ok(f"tp=2 sp={sp}")


# --------------------------------------------------------------------------- weights


def test_every_naming_maps_to_the_same_tower(tmp_path):
    """transformers' state_dict names, save_pretrained's (transformers' own inverse of its
    conversion: wqkv with q / k in rotary pairs) and the published ones give one tower; export
    gives transformers' names back exactly; a misfit is named."""
    import transformers
    from safetensors.torch import load_file

    model = transformers.Kimi_K25ForConditionalGeneration(kimi_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    arch = MoonViTArch.from_hf_config(model.config.to_dict())
    state = {k: v for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    published = {k.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
                 .replace("model.mm_projector.", "mm_projector.")
                 .replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in saved.items()}
    namings = {"state_dict": state, "saved": saved, "original": published}
    ours = {}
    for naming, tensors in namings.items():
        assert checkpoint_naming(tensors) == naming
        ours[naming] = tower_state_from_hf(tensors, arch)
    assert all(torch.equal(ours[n][k], v) for n in ("saved", "original") for k, v in ours["state_dict"].items())
    back = tower_state_to_hf(ours["original"], arch)
    assert set(back) == {k for k in state if k.startswith(("model.vision_tower.", "model.mm_projector."))}
    assert all(torch.equal(back[k], state[k]) for k in back)
    # the published rules' export writes the published tensors back (the rotary pairs restored)
    for rule in hf_rules(arch, naming="original"):
        for key, t in zip(rule.theirs, rule.to_theirs(ours["original"][rule.ours])):
            assert torch.equal(t, published[key]), key
    with pytest.raises(MimoError, match=r"belongs to block 2, but arch.depth is 2"):
        tower_state_from_hf({**state, "model.vision_tower.layers.2.norm1.weight": torch.zeros(24)}, arch)
    with pytest.raises(MimoError, match=r"'vision_tower.encoder.blocks.0.wqkv.weight' has shape \(48, 24\)"):
        tower_state_from_hf({**saved, "vision_tower.encoder.blocks.0.wqkv.weight": torch.zeros(48, 24)}, arch)
    # a checkpoint left in its file: each region read lazily, the tower loaded exactly
    from mimo.encoders.weights import lazy_safetensors

    tower = MoonViTTower(arch)
    tower.load_weights_(import_hf_state(lazy_safetensors(str(tmp_path / "saved" / "model.safetensors")), arch))
    assert all(torch.equal(v, ours["state_dict"][k]) for k, v in tower.full_state().items())


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{name: directory}: "saved" (random weights, save_pretrained), "state_dict" (the same tensors
    in transformers' state_dict names, as mimo exports them), "published" (Moonshot's naming),
    "config" (config.json only)."""
    import transformers
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("kimi")
    cfg = kimi_config()
    torch.manual_seed(5)
    model = transformers.Kimi_K25ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_()
    out = {name: str(root / name) for name in ("saved", "state_dict", "published", "config")}
    model.save_pretrained(out["saved"])
    with open(os.path.join(out["saved"], "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 512}')
    for name in ("state_dict", "published", "config"):
        cfg.save_pretrained(out[name])
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, os.path.join(out["state_dict"], "model.safetensors"), metadata={"format": "pt"})
    saved = load_file(os.path.join(out["saved"], "model.safetensors"))
    save_file({k.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
               .replace("model.mm_projector.", "mm_projector.")
               .replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in saved.items()},
              os.path.join(out["published"], "model.safetensors"), metadata={"format": "pt"})
    return out


def _import_export(pools, path: str, tmp_path, capsys):
    """``import-hf DIR --yaml``, then the checkpoint at tp 2 (both modules), then ``export-hf``."""
    from mimo.commands.export_hf import export_hf
    from mimo.commands.hf_qwen3_vl import import_to_checkpoint

    assert main(["import-hf", path, "--yaml", str(tmp_path / "modules.yaml")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["architecture"] == "Kimi_K25ForConditionalGeneration"
    modules = result["modules"]
    assert modules["vision"]["kind"] == "kimi_k25" and modules["language"]["arch"]["tie_embeddings"] is True
    for m in modules.values():
        m["parallel"] = {"tp": 2}
    config = tmp_path / "mimo.yaml"
    config.write_text(yaml.safe_dump({"world_size": 2, "modules": modules,
                                      "data": {"source": "synthetic", "max_sample_tokens": 256}}))
    written = import_to_checkpoint(path, str(config), [], str(tmp_path / "ckpt"), pool=pools(WORLD))
    return export_hf(written["out"], str(tmp_path / "hf"))


def test_import_export_round_trip(pools, sources, tmp_path, capsys):
    """save_pretrained's directory -> mimo at tp 2 -> export: transformers loads every tensor of
    the source (the tied head stored by neither); the token ids and tokenizer files carried."""
    import transformers
    from safetensors import safe_open

    exported = _import_export(pools, sources["saved"], tmp_path, capsys)
    assert exported["architecture"] == "Kimi_K25ForConditionalGeneration" and exported["token_ids_from"] == sources["saved"]
    out = tmp_path / "hf"
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 512}'
    written = json.loads((out / "config.json").read_text())
    assert all(written[k] == v for k, v in IDS.items()) and written["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    cls = transformers.Kimi_K25ForConditionalGeneration
    source, (back, info) = cls.from_pretrained(sources["saved"]), cls.from_pretrained(str(out), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    want, got = source.state_dict(), back.state_dict()
    assert list(got) == list(want)
    unequal = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not unequal, unequal[:5]


@pytest.mark.parametrize("name", ["state_dict", "published"])
def test_other_namings_round_trip(pools, sources, name, tmp_path, capsys):
    """transformers' state_dict naming comes back file for file; the published naming imports to
    the same tensors."""
    from safetensors.torch import load_file

    _import_export(pools, sources[name], tmp_path, capsys)
    back = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = load_file(os.path.join(sources["state_dict"], "model.safetensors"))
    assert set(back) == set(want)
    assert all(torch.equal(back[k], v) for k, v in want.items())


# --------------------------------------------------------------------------- verify-hf


@pytest.mark.parametrize("name,tp,ep", [("config", 1, 1), ("config", 2, 1), ("config", 1, 2), ("published", 1, 1)])
def test_verify_hf(pools, sources, name, tp, ep):
    """Random weights (transformers saves them for mimo's ranks: save_pretrained's naming) at tp 1,
    tp 2 and ep 2; a directory in the published naming, which both sides load."""
    from mimo.commands.verify_hf import verify_hf

    r = verify_hf(sources[name], pools(WORLD), tp=tp, ep=ep, seed=1)
    assert r["ok"], json.dumps(r["yardstick"], indent=1)
    assert r["weights"] == ("checkpoint" if name == "published" else "random (seed 1)")
    assert r["labels_agree"] and r["grads_checked"] == 72 and r["text_family"] == "deepseek_v3"
    grids = [g for s in r["samples"] for g in s["image_grids"]]
    assert not any(s["video_grids"] for s in r["samples"]) and len({tuple(g) for g in grids}) == 3
    assert max(m["err_vs_fp64"] / m["bound"] for m in r["yardstick"]["worst"]) < 0.5 and r["max_grad_rel_err"] > 0


# --------------------------------------------------------------------------- the example config


@pytest.fixture(scope="module")
def example(tmp_path_factory, write_native_example):
    """The example over fresh demo data (its native split: 80 samples), 768-token microbatches."""
    return write_native_example(EXAMPLE, tmp_path_factory.mktemp("kimi_example"), 7, 80, tokens_per_microbatch=768)


def test_example_checks_and_trains_as_one_process(pools, example, verify_layout, capsys):
    """check-config passes; the index holds each image's grid by Kimi's rule (scaled down, padded,
    rows of several counts); verify-train at the example's layout equals the one-process run."""
    from mimo.compose.config import load_config
    from mimo.compose.inputs import ensure_index

    assert main(["check-config", example]) == 0
    assert "video not taken" in capsys.readouterr().out
    index = ensure_index(load_config(example))[0]
    rows = {r for e in index.entries if e.bad is None for r in e.image_rows.get("<image>", ())}
    grids = {tuple(g) for e in index.entries if e.bad is None for g in e.image_grids.get("<image>", ())}
    assert (1, 10, 16) in grids and (1, 10, 10) in grids and len(rows) >= 4  # 70x46 scaled + padded; 36x36 padded
    report = verify_layout(pools, example, [], 2)
    assert report["ok"], report
    assert all(0 < loss < 10 for loss in report["losses"])


# --------------------------------------------------------------------------- errors


def test_bad_input_and_config_are_clear_errors(tmp_path, capsys):
    from mimo.compose.config import config_from_dict
    from mimo.parallel.context import ParallelContext
    from mimo.parallel.grid import ParallelGrid

    arch = tower_arch()
    tower = MoonViTTower(arch)
    tower.init_weights(0)
    with pytest.raises(DataError, match=r"image 1: grid \(t, h, w\) = \(2, 2, 2\): the Kimi-K2.5 \(MoonViT\) tower takes "
                                        r"still images only \(t = 1\); videos are not supported"):
        tower(torch.zeros(12, arch.row_numel), torch.tensor([[1, 2, 2], [2, 2, 2]]))
    with pytest.raises(LayoutError, match=r"tp=2 does not divide the Kimi-K2.5 \(MoonViT\) tower's heads \(3\)"):
        MoonViTTower(arch, ParallelContext.plan(ParallelGrid({"tp": 2})), device="meta")
    whole = kimi_config().to_dict()
    for change, message in [
        ({"vision_config": {**whole["vision_config"], "merge_kernel_size": [2, 1]}}, "only square merge kernels"),
        ({"vision_config": {**whole["vision_config"], "pos_emb_width": 7}}, "pos_emb_width=7 with pos_emb_height=6"),
        ({"projection_hidden_size": 32}, "projection_hidden_size=32"),
        ({"quantization_config": {"quant_method": "compressed-tensors"}}, "quantization_config"),
    ]:
        with pytest.raises(MimoError, match=message):
            MoonViTArch.from_hf_config({**whole, **change})
    # the commands say it in one line (exit 2)
    kimi_config(dict(VISION, merge_kernel_size=[2, 1])).save_pretrained(tmp_path / "bad")
    for argv in (["verify-hf", str(tmp_path / "bad")], ["import-hf", str(tmp_path / "bad")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "merge_kernel_size=[2, 1]: only square merge kernels are supported" in err and "Traceback" not in err, err
    raw = yaml.safe_load(open(EXAMPLE).read())
    raw["data"] = {"source": "synthetic", "max_sample_tokens": 256}
    raw["modules"]["vision"]["video"] = {"fps": 2}
    raw["modules"]["vision"]["image"]["max_side"] = 0
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    problems = "\n".join(e.value.problems)
    assert "modules.vision.video: the Kimi-K2.5 tower (kind kimi_k25) takes still images only" in problems
    assert "modules.vision.image.max_side: must be >= 1, got 0" in problems


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
def test_tower_on_the_gpu_equals_the_cpu():
    """MoonViT on CUDA: in fp32 (no TF32) the CPU's rows and d/dpixels; in bf16 (the attention's
    fast path) within bf16's error of them."""
    from mimo.core.testing import rel_err
    from mimo.data.native_images import preprocess

    torch.backends.cuda.matmul.allow_tf32 = False
    arch = tower_arch()
    state = tower_state_from_hf(hf_tower_state(*random_hf_tower()), arch)
    px = torch.cat([preprocess(img, image_spec(arch))[0] for img in pictures()])
    grids = hf_processed(arch)[1]
    dY = torch.randn(px.shape[0] // 4, arch.out_hidden, generator=torch.Generator().manual_seed(3))
    runs = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.float32), ("cuda", torch.bfloat16)):
        tower = MoonViTTower(arch)
        tower.load_full_(state)
        tower = tower.to(device=device, dtype=dtype)
        x = px.detach().to(device=device, dtype=dtype).clone().requires_grad_(True)
        rows = tower(x, grids)
        (rows * dY.to(device=device, dtype=dtype)).sum().backward()
        runs[(device, dtype)] = (rows.detach().float().cpu(), x.grad.float().cpu())
    cpu = runs[("cpu", torch.float32)]
    for (device, dtype), (rows, grad) in runs.items():
        bound = 1e-5 if dtype == torch.float32 else 3e-2
        assert rel_err(rows, cpu[0]) < bound and rel_err(grad, cpu[1]) < bound, (device, dtype)
