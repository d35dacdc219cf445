"""Weight import / export (timm, Hugging Face) and its error messages, in one process.

Import -> export must reproduce the source state dict exactly (keys, order, dtypes, values),
unused heads and text towers included; a checkpoint that does not fit the config names the
first mismatched tensor and both shapes.
"""

from __future__ import annotations

import json
import typing

import pytest
import torch
from safetensors.torch import save_file

from mimo.encoders.config import EncoderModuleConfig, ProjectorConfig, VitArch
from mimo.encoders.hf_import import hf_arch, import_hf, import_hf_state, load_hf_state, save_hf_checkpoint
from mimo.encoders.projector import PROJECTORS, build_projector
from mimo.encoders.timm_import import create_timm_model, import_timm, import_timm_state, timm_arch
from mimo.encoders.vit import VisionTransformer, resolve_feature_layer
from mimo.encoders.weights import LazyTensor, MappedTensor, Rule, lazy_safetensors, load_state_file
from mimo.core.errors import MimoError

SMALL = {"depth": 3, "embed_dim": 96, "num_heads": 12, "img_size": 32, "patch_size": 8}
HF_SMALL = {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3, "num_attention_heads": 12,
            "image_size": 32, "patch_size": 8}
TIMM_NAMES = ["vit_base_patch16_224", "vit_base_patch16_clip_224.openai", "vit_base_patch16_siglip_224"]


def assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def timm_model(name: str, **overrides):
    torch.manual_seed(0)
    return create_timm_model(name, **{**SMALL, **overrides}).eval()


@pytest.fixture(scope="module")
def hf_models():
    import transformers

    torch.manual_seed(0)
    clip = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**HF_SMALL))
    siglip = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**HF_SMALL))
    full = transformers.CLIPModel(transformers.CLIPConfig(
        vision_config=HF_SMALL,
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
    ))
    return {"clip": clip, "siglip": siglip, "full_clip": full}


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", TIMM_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_timm_import_export_is_exact(name, dtype):
    model = timm_model(name)
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    weights = import_timm_state(state, timm_arch(model))
    assert_same_state(weights.export(), state)
    heads = {k for k in state if k.startswith(("head.", "attn_pool."))}
    assert set(weights.extras) == heads and (heads or name == "vit_base_patch16_siglip_224")


@pytest.mark.parametrize("which", ["clip", "siglip", "full_clip"])
def test_hf_import_export_is_exact(hf_models, which):
    model = hf_models[which]
    state = model.state_dict()
    family = "siglip" if which == "siglip" else "clip"
    weights = import_hf_state(state, hf_arch(family, HF_SMALL), family)
    assert_same_state(weights.export(), state)
    if which == "siglip":
        assert set(weights.extras) == {k for k in state if k.startswith("head.")}
    if which == "full_clip":  # the text tower, projections and logit_scale ride along
        assert weights.meta["prefix"] == "vision_model."
        assert set(weights.extras) == {k for k in state if not k.startswith("vision_model.")}


def test_hf_older_layout_with_prefix_and_position_ids(hf_models):
    """transformers 4 saved CLIPVisionModel under ``vision_model.`` with a position_ids buffer."""
    state = {f"vision_model.{k}": v for k, v in hf_models["clip"].state_dict().items()}
    state["vision_model.embeddings.position_ids"] = torch.arange(17).unsqueeze(0)
    weights = import_hf_state(state, hf_arch("clip", HF_SMALL), "clip")
    assert_same_state(weights.export(), state)


def test_export_writes_trained_tensors_and_keeps_unused_ones():
    model = timm_model("vit_base_patch16_clip_224.openai")
    state = model.state_dict()
    arch = timm_arch(model)
    weights = import_timm_state(state, arch)
    tower = VisionTransformer(arch, -2)  # blocks 0-1 only; block 2, norm and head unused
    tower.load_weights_(weights)
    with torch.no_grad():
        tower.blocks[1].attn.qkv.weight.mul_(2.0)
        tower.pos_embed.add_(1.0)
    out = weights.export(tower.full_state())
    assert torch.equal(out["blocks.1.attn.qkv.weight"], 2.0 * state["blocks.1.attn.qkv.weight"])
    assert torch.equal(out["pos_embed"], state["pos_embed"] + 1.0)
    for k in ("blocks.2.attn.qkv.weight", "norm.weight", "head.weight", "blocks.0.mlp.fc1.weight"):
        assert torch.equal(out[k], state[k]), k


def test_hf_checkpoint_directory_round_trip(hf_models, tmp_path):
    hf_models["siglip"].save_pretrained(tmp_path / "orig")
    weights = import_hf(str(tmp_path / "orig"))
    save_hf_checkpoint(str(tmp_path / "copy"), weights)
    assert_same_state(load_hf_state(str(tmp_path / "copy")), load_hf_state(str(tmp_path / "orig")))
    # resampled on import: the written config follows the new image size
    arch48 = VitArch(**{**vars(weights.arch), "image_size": 48})
    resized = import_hf(str(tmp_path / "orig"), arch48)
    assert resized.resampled and resized.tower["pos_embed"].shape == (36, 96)
    save_hf_checkpoint(str(tmp_path / "r48"), resized)
    assert json.loads((tmp_path / "r48" / "config.json").read_text())["image_size"] == 48
    assert import_hf(str(tmp_path / "r48")).arch == arch48


def test_timm_weights_file_with_name(tmp_path):
    model = timm_model("vit_base_patch16_siglip_224")
    path = str(tmp_path / "w.safetensors")
    save_file(model.state_dict(), path)
    weights = import_timm("vit_base_patch16_siglip_224", timm_arch(model), path, **SMALL)
    assert_same_state(weights.export(), load_state_file(path))  # safetensors stores keys sorted
    torch.save({"state_dict": model.state_dict()}, tmp_path / "w.pth")  # a wrapped torch file
    assert_same_state(load_state_file(str(tmp_path / "w.pth")), model.state_dict())


# --------------------------------------------------------------------------- errors


def test_missing_checkpoints(tmp_path):
    with pytest.raises(MimoError, match="checkpoint .*nope.safetensors' not found"):
        load_state_file(str(tmp_path / "nope.safetensors"))
    with pytest.raises(MimoError, match="directory .* not found"):
        import_hf(str(tmp_path / "missing"))
    (tmp_path / "cfg").mkdir()
    with pytest.raises(MimoError, match="no config.json"):
        import_hf(str(tmp_path / "cfg"))
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({"model_type": "clip_vision_model", **HF_SMALL}))
    with pytest.raises(MimoError, match="no model.safetensors"):
        import_hf(str(tmp_path / "cfg"))
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(MimoError, match="model_type 'llama' is not a supported vision tower"):
        import_hf(str(tmp_path / "cfg"))


def test_shape_mismatch_names_the_first_tensor_and_both_shapes(hf_models):
    state = hf_models["clip"].state_dict()
    arch = hf_arch("clip", HF_SMALL)
    narrow = VitArch(**{**vars(arch), "hidden": 64, "heads": 8})
    with pytest.raises(MimoError) as e:
        import_hf_state(state, narrow, "clip", "checkpoint 'x'")
    assert str(e.value).startswith(
        "checkpoint 'x' does not fit the config: tensor 'embeddings.patch_embedding.weight' has shape (96, 3, 8, 8), "
        "the config expects (64, 3, 8, 8); also ")
    assert str(e.value).endswith("more problems)")
    model = timm_model("vit_base_patch16_224")
    wide_mlp = VitArch(**{**vars(timm_arch(model)), "mlp": 192})
    with pytest.raises(MimoError, match=r"tensor 'blocks.0.mlp.fc1.weight' has shape \(384, 96\), the config expects \(192, 96\)"):
        import_timm_state(model.state_dict(), wide_mlp)


def test_structural_mismatches():
    model = timm_model("vit_base_patch16_224")
    arch = timm_arch(model)
    state = model.state_dict()
    with pytest.raises(MimoError, match="'blocks.2.norm1.weight' belongs to block 2, but arch.layers is 2"):
        import_timm_state(state, VitArch(**{**vars(arch), "layers": 2}))
    with pytest.raises(MimoError, match="missing tensor 'blocks.3.norm1.weight'"):
        import_timm_state(state, VitArch(**{**vars(arch), "layers": 4}))
    with pytest.raises(MimoError, match="missing tensor 'norm_pre.weight'.*'patch_embed.proj.bias' has no place"):
        import_timm_state(state, VitArch(**{**vars(arch), "pre_norm": True}))
    # no final norm in the checkpoint: fine for -2, an error for post_norm
    weights = import_timm_state({k: v for k, v in state.items() if not k.startswith("norm.")}, arch)
    VisionTransformer(arch, -2).load_weights_(weights)
    with pytest.raises(MimoError, match="missing tensor 'norm.weight'"):
        VisionTransformer(arch, "post_norm").load_weights_(weights)


def test_arch_fields_shapes_cannot_show(hf_models, tmp_path):
    hf_models["clip"].save_pretrained(tmp_path)
    arch = hf_arch("clip", HF_SMALL)
    with pytest.raises(MimoError, match="arch.heads is 6 in the config but 12 in checkpoint"):
        import_hf(str(tmp_path), VitArch(**{**vars(arch), "heads": 6}))
    with pytest.raises(MimoError, match="arch.act is 'gelu' in the config but 'quick_gelu'"):
        import_hf(str(tmp_path), VitArch(**{**vars(arch), "act": "gelu"}))


def test_unsupported_timm_models():
    with pytest.raises(MimoError, match="unknown timm model 'vit_nope'"):
        create_timm_model("vit_nope")
    with pytest.raises(MimoError, match="layer scale"):
        timm_arch(timm_model("vit_base_patch16_224", init_values=1e-5))
    with pytest.raises(MimoError, match="qk-norm"):
        timm_arch(timm_model("vit_base_patch16_224", qk_norm=True))
    with pytest.raises(MimoError, match="register tokens"):
        timm_arch(timm_model("vit_base_patch16_224", reg_tokens=4))


def test_openai_layout_gets_a_hint():
    with pytest.raises(MimoError, match="OpenAI / OpenCLIP layout"):
        import_timm_state({"visual.class_embedding": torch.zeros(96)}, timm_arch(timm_model("vit_base_patch16_224")))


def test_layer_scale_tensors_are_not_silently_dropped():
    model = timm_model("vit_base_patch16_224", init_values=1e-5)
    arch = VitArch(**{**vars(timm_arch(timm_model("vit_base_patch16_224")))})
    with pytest.raises(MimoError, match="'blocks.0.ls1.gamma' has no place in the mimo ViT"):
        import_timm_state(model.state_dict(), arch)


def test_tower_rejects_wrong_pixels():
    arch = VitArch(image_size=32, patch=8, hidden=96, layers=1, heads=12, mlp=384)
    with pytest.raises(MimoError, match=r"pixels \[N, 3, 32, 32\], got \(2, 3, 48, 48\)"):
        VisionTransformer(arch, -1)(torch.zeros(2, 3, 48, 48))


# --------------------------------------------------------------------------- small pieces


def test_feature_layer_resolution():
    assert resolve_feature_layer(24, -2) == (23, False)  # LLaVA
    assert resolve_feature_layer(24, -1) == (24, False)
    assert resolve_feature_layer(24, 0) == (0, False)
    assert resolve_feature_layer(24, 5) == (5, False)
    assert resolve_feature_layer(24, -25) == (0, False)
    assert resolve_feature_layer(24, "post_norm") == (24, True)
    with pytest.raises(MimoError, match="outside -24..24"):
        resolve_feature_layer(24, 25)


def test_only_needed_blocks_are_built():
    arch = VitArch(image_size=32, patch=8, hidden=96, layers=3, heads=12, mlp=384)
    assert len(VisionTransformer(arch, -2).blocks) == 2 and VisionTransformer(arch, -2).norm is None
    assert len(VisionTransformer(arch, "post_norm").blocks) == 3 and VisionTransformer(arch, "post_norm").norm is not None


def test_rows_per_image_and_projector_registry():
    arch = VitArch(image_size=32, patch=8, hidden=96, layers=3, heads=12, mlp=384)
    assert EncoderModuleConfig(kind="vit", arch=arch).rows_per_image == 16
    assert EncoderModuleConfig(kind="vit", arch=arch, drop_class_token=False).rows_per_image == 17
    no_cls = VitArch(**{**vars(arch), "class_token": False})
    assert EncoderModuleConfig(kind="vit", arch=no_cls, drop_class_token=False).rows_per_image == 16
    kinds = typing.get_args(typing.get_type_hints(ProjectorConfig)["kind"])
    assert set(kinds) == set(PROJECTORS)
    assert build_projector("mlp2x_gelu", 96, 24)(torch.zeros(5, 96)).shape == (5, 24)
    with pytest.raises(MimoError, match="unknown projector kind 'mlp3x'"):
        build_projector("mlp3x", 96, 24)


# --------------------------------------------------------------------------- reading only what a rank needs


def test_rules_read_only_the_regions_they_need(tmp_path, monkeypatch):
    """``Rule.read`` over tensors still in their safetensors file gives ``to_ours(...)[index]``,
    reading the rows of the q | k | v parts the index covers, and through a reshape that drops
    leading 1-dims only the region itself; any other reshape reads its source whole."""
    gen = torch.Generator().manual_seed(0)
    D = 5
    state = {"q": torch.randn(D, 3, generator=gen), "k": torch.randn(D, 3, generator=gen), "v": torch.randn(D, 3, generator=gen),
             "cls": torch.randn(1, 1, 4, generator=gen), "odd": torch.randn(6, 4, generator=gen).to(torch.bfloat16)}
    path = str(tmp_path / "w.safetensors")
    save_file(state, path)
    lazy = lazy_safetensors(path)
    assert {k: (t.shape, t.dtype) for k, t in lazy.items()} == {k: (tuple(t.shape), t.dtype) for k, t in state.items()}
    read = []
    lazy_read = LazyTensor.__getitem__

    def counting(t, index):
        out = lazy_read(t, index)
        read.append(out.numel())
        return out

    monkeypatch.setattr(LazyTensor, "__getitem__", counting)
    cases = [
        (Rule("qkv", ("q", "k", "v"), (3 * D, 3), (D, 3)), [(slice(6, 8), slice(1, 3)), (slice(3, 12), slice(0, 3)),
                                                             (slice(0, 15), slice(2, 3))]),
        (Rule("cls", ("cls",), (4,), (1, 1, 4)), [(slice(1, 3),), (slice(0, 4),)]),
        (Rule("odd", ("odd",), (4, 6), (6, 4)), [(slice(1, 2), slice(0, 6))]),
    ]
    for rule, indexes in cases:
        full = rule.to_ours([state[k] for k in rule.theirs])
        for index in indexes:
            read.clear()
            got = rule.read([lazy[k] for k in rule.theirs], index)
            assert got.dtype == full.dtype and torch.equal(got, full[index]), (rule.ours, index)
            assert sum(read) == (24 if rule.ours == "odd" else full[index].numel()), (rule.ours, index, read)
        mapped = MappedTensor(rule, tuple(lazy[k] for k in rule.theirs))
        assert mapped.shape == tuple(full.shape) and torch.equal(mapped.full(), full)


def test_lazy_import_loads_what_the_in_memory_one_does(hf_models, tmp_path):
    """``import_hf`` leaves the safetensors file in place (``MappedTensor``s); the tower loads
    the same weights from it as from the state dict read whole."""
    hf_models["clip"].save_pretrained(tmp_path)
    arch = hf_arch("clip", HF_SMALL)
    lazy, eager = import_hf(str(tmp_path)), import_hf_state(load_hf_state(str(tmp_path)), arch, "clip")
    assert isinstance(lazy.tower["blocks.0.attn.qkv.weight"], MappedTensor)
    assert isinstance(eager.tower["blocks.0.attn.qkv.weight"], torch.Tensor)
    towers = []
    for weights in (lazy, eager):
        tower = VisionTransformer(arch, "post_norm")
        tower.load_weights_(weights)
        towers.append(tower.full_state())
    assert list(towers[0]) == list(towers[1]) and all(torch.equal(towers[0][k], towers[1][k]) for k in towers[1])
    assert_same_state(lazy.export(), eager.export())
