"""Hugging Face ``CLIPVisionModel`` / ``SiglipVisionModel`` checkpoints <-> the tower.

A checkpoint is a directory with ``config.json`` and ``model.safetensors`` (or a sharded
``model.safetensors.index.json``). The vision tower may sit under a prefix: none for a
vision model saved by transformers 5, ``vision_model.`` for older saves and for full
``CLIPModel`` / ``SiglipModel`` checkpoints, ``vision_tower.vision_model.`` inside LLaVA; it
is found from the patch embedding's key. Everything outside the prefix (a text tower,
projections, ``logit_scale``) and SigLIP's attention-pooling ``head.*`` are extras.

Mapping (HF, under the prefix -> mimo):

    embeddings.patch_embedding.{weight,bias}   -> patch_embed.{weight,bias}   (bias: SigLIP)
    embeddings.class_embedding [D]             -> cls_token [D]               (CLIP)
    embeddings.position_embedding.weight [L, D]-> pos_embed [L, D]            (interpolated if the grid differs)
    pre_layrnorm.*                             -> norm_pre.*                  (CLIP)
    encoder.layers.i.layer_norm1/2.*           -> blocks.i.norm1/2.*
    encoder.layers.i.self_attn.{q,k,v}_proj.W  -> blocks.i.attn.qkv.W [3D, ...] (q | k | v)
    encoder.layers.i.self_attn.out_proj.*      -> blocks.i.attn.proj.*
    encoder.layers.i.mlp.fc1/fc2.*             -> blocks.i.mlp.fc1/fc2.*
    post_layernorm.*                           -> norm.*

Feature conventions: ``hidden_states[L]`` is the same in both families (index 0: the encoder's
input, i.e. the embeddings after CLIP's pre-norm). ``post_norm`` is ``post_layernorm`` applied
to every token: SigLIP's ``last_hidden_state``, but CLIP's ``last_hidden_state`` is *not*
normed (HF norms only the pooled [CLS] row), so for CLIP it is ``post_layernorm(last_hidden_state)``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Mapping

import torch
import torch.nn.functional as F

from mimo.encoders.config import VitArch
from mimo.encoders.vit import patch_bias
from mimo.encoders.weights import ImportedWeights, LazyTensor, Rule, check_arch, lazy_safetensors, map_state
from mimo.core.errors import MimoError
from mimo.core.weights import load_exactly_

__all__ = [
    "read_config_json", "read_hf_config", "hf_arch", "hf_rules", "load_hf_state", "import_hf_state", "import_hf",
    "save_hf_checkpoint", "build_hf_model", "hf_features", "import_llava_projector", "check_hf_tower", "check_hf",
]

FAMILIES = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
_ACTS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_PATCH_KEY = "embeddings.patch_embedding.weight"


def read_config_json(path: str) -> dict:
    """The ``config.json`` of a Hugging Face checkpoint directory."""
    if not os.path.isdir(path):
        raise MimoError(f"Hugging Face checkpoint directory {path!r} not found")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise MimoError(f"{path!r} has no config.json (a Hugging Face checkpoint directory holds config.json and model.safetensors)")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise MimoError(f"{cfg_path!r} is not readable JSON: {e}") from None


def read_hf_config(path: str) -> tuple[str, dict, dict]:
    """(family, vision config dict, the whole config.json) of a checkpoint directory."""
    whole = read_config_json(path)
    cfg_path = os.path.join(path, "config.json")
    vision = whole if whole.get("model_type") in FAMILIES else whole.get("vision_config")
    kind = vision.get("model_type") if isinstance(vision, dict) else None
    if kind is None and isinstance(vision, dict) and whole.get("model_type") in ("clip", "siglip"):
        kind = f"{whole['model_type']}_vision_model"  # an older full-model config without the sub-type
    if kind not in FAMILIES:
        raise MimoError(
            f"{cfg_path!r}: model_type {whole.get('model_type')!r} is not a supported vision tower "
            f"({', '.join(FAMILIES)}, or a config whose vision_config is one)"
        )
    return FAMILIES[kind], vision, whole


def _config_class(family: str):
    import transformers

    return transformers.CLIPVisionConfig if family == "clip" else transformers.SiglipVisionConfig


def hf_arch(family: str, vision_config: dict) -> VitArch:
    """The ``VitArch`` of a CLIP / SigLIP vision config (HF's defaults filled in)."""
    cfg = _config_class(family)(**{k: v for k, v in vision_config.items() if k != "model_type"})
    if cfg.hidden_act not in _ACTS:
        raise MimoError(f"hidden_act {cfg.hidden_act!r} is not supported by the mimo ViT ({', '.join(_ACTS)})")
    clip = family == "clip"
    return VitArch(
        image_size=cfg.image_size,
        patch=cfg.patch_size,
        hidden=cfg.hidden_size,
        layers=cfg.num_hidden_layers,
        heads=cfg.num_attention_heads,
        mlp=cfg.intermediate_size,
        channels=cfg.num_channels,
        class_token=clip,
        pre_norm=clip,
        act=_ACTS[cfg.hidden_act],
        norm_eps=float(cfg.layer_norm_eps),
    )


def hf_rules(arch: VitArch, prefix: str = "") -> list[Rule]:
    D, F_, C, p = arch.hidden, arch.mlp, arch.channels, arch.patch
    L = (arch.image_size // p) ** 2 + (1 if arch.class_token else 0)

    def same(ours, theirs, *shape, optional=False):
        return Rule(ours, (prefix + theirs,), tuple(shape), tuple(shape), optional)

    def qkv(i, what, *shape):  # q | k | v concatenated along dim 0
        a = f"{prefix}encoder.layers.{i}.self_attn."
        return Rule(f"blocks.{i}.attn.qkv.{what}", tuple(f"{a}{x}_proj.{what}" for x in "qkv"),
                    (3 * shape[0], *shape[1:]), tuple(shape))

    rules = [same("patch_embed.weight", "embeddings.patch_embedding.weight", D, C, p, p)]
    if patch_bias(arch):
        rules.append(same("patch_embed.bias", "embeddings.patch_embedding.bias", D))
    if arch.class_token:
        rules.append(same("cls_token", "embeddings.class_embedding", D))
    rules.append(same("pos_embed", "embeddings.position_embedding.weight", L, D))
    if arch.pre_norm:
        rules += [same("norm_pre.weight", "pre_layrnorm.weight", D), same("norm_pre.bias", "pre_layrnorm.bias", D)]
    for i in range(arch.layers):
        b, h = f"blocks.{i}.", f"encoder.layers.{i}."
        rules += [
            same(b + "norm1.weight", h + "layer_norm1.weight", D), same(b + "norm1.bias", h + "layer_norm1.bias", D),
            qkv(i, "weight", D, D), qkv(i, "bias", D),
            same(b + "attn.proj.weight", h + "self_attn.out_proj.weight", D, D),
            same(b + "attn.proj.bias", h + "self_attn.out_proj.bias", D),
            same(b + "norm2.weight", h + "layer_norm2.weight", D), same(b + "norm2.bias", h + "layer_norm2.bias", D),
            same(b + "mlp.fc1.weight", h + "mlp.fc1.weight", F_, D), same(b + "mlp.fc1.bias", h + "mlp.fc1.bias", F_),
            same(b + "mlp.fc2.weight", h + "mlp.fc2.weight", D, F_), same(b + "mlp.fc2.bias", h + "mlp.fc2.bias", D),
        ]  # fmt: skip
    rules += [same("norm.weight", "post_layernorm.weight", D, optional=True),
              same("norm.bias", "post_layernorm.bias", D, optional=True)]
    return rules


def import_llava_projector(state: Mapping[str, torch.Tensor], arch: VitArch, llm_hidden: int, prefix: str,
                           where: str = "Hugging Face LLaVA state dict") -> ImportedWeights:
    """LLaVA's ``multi_modal_projector.*`` (under ``prefix``) as mimo's ``mlp2x_gelu`` projector:
    the names are the same (``linear_1``, ``linear_2``, HF's ``[out, in]`` weights), so every
    rule is an identity; what it adds is the shape check and an exact export."""
    D, E = arch.hidden, llm_hidden
    shapes = {"linear_1.weight": (E, D), "linear_1.bias": (E,), "linear_2.weight": (E, E), "linear_2.bias": (E,)}
    rules = [Rule(name, (prefix + name,), shape, shape) for name, shape in shapes.items()]
    return map_state(
        state, rules, source="hf-llava-projector", where=where, arch=arch,
        unmapped=lambda key: f"tensor {key!r} has no place in the mlp2x_gelu projector", meta={"prefix": prefix},
    )


def find_prefix(state: Mapping[str, torch.Tensor], where: str) -> str:
    found = [k[: -len(_PATCH_KEY)] for k in state if k.endswith(_PATCH_KEY)]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise MimoError(f"{where}: found {what} vision patch embedding ('...{_PATCH_KEY}'); expected exactly one")
    return found[0]


def _unmapped(arch: VitArch, prefix: str):
    def decide(key: str) -> str | None:
        if not key.startswith(prefix):
            return None  # another part of a full model (text tower, projections)
        rest = key[len(prefix):]
        if rest.startswith("head.") or rest == "embeddings.position_ids":
            return None  # SigLIP's attention-pool head; a buffer older checkpoints saved
        parts = rest.split(".")
        if rest.startswith("encoder.layers.") and parts[2].isdigit() and int(parts[2]) >= arch.layers:
            return f"tensor {key!r} belongs to layer {parts[2]}, but arch.layers is {arch.layers}"
        return f"tensor {key!r} has no place in the mimo ViT"

    return decide


def _interpolate_pos_embed(arch: VitArch):
    """Hugging Face's ``interpolate_pos_encoding`` (CLIP / SigLIP embeddings), done once at
    import: the patch positions as a square grid, bicubic, ``align_corners=False``, no
    antialias; the [CLS] position kept."""
    prefix = 1 if arch.class_token else 0
    grid = arch.image_size // arch.patch

    def resample(t: torch.Tensor):
        if t.dim() != 2 or t.shape[1] != arch.hidden or t.shape[0] <= prefix:
            return None
        old = math.isqrt(t.shape[0] - prefix)
        if old * old != t.shape[0] - prefix:
            return None
        pos_1LD = t.unsqueeze(0).float()
        cls_1PD, patch_1LD = pos_1LD[:, :prefix], pos_1LD[:, prefix:]
        patch_1Dhw = patch_1LD.reshape(1, old, old, arch.hidden).permute(0, 3, 1, 2)
        patch_1Dhw = F.interpolate(patch_1Dhw, size=(grid, grid), mode="bicubic", align_corners=False)
        patch_1LD = patch_1Dhw.permute(0, 2, 3, 1).reshape(1, -1, arch.hidden)
        return torch.cat([cls_1PD, patch_1LD], dim=1)[0]

    return resample


def import_hf_state(state: Mapping[str, torch.Tensor], arch: VitArch, family: str, where: str = "Hugging Face state dict",
                    config: dict | None = None) -> ImportedWeights:
    prefix = find_prefix(state, where)
    return map_state(
        state, hf_rules(arch, prefix), source=f"hf-{family}", where=where, arch=arch,
        unmapped=_unmapped(arch, prefix), resamplers={"pos_embed": _interpolate_pos_embed(arch)},
        meta={"prefix": prefix, "family": family, "config": config},
    )


def _shapes_only(file: str) -> dict[str, torch.Tensor]:
    """The file's tensors as meta tensors: shapes and dtypes from the header, nothing read."""
    return {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in lazy_safetensors(file).items()}


def load_hf_state(path: str, shapes_only: bool = False, lazy: bool = False) -> dict[str, "torch.Tensor | LazyTensor"]:
    """The tensors of ``model.safetensors`` or of every shard its index lists (``shapes_only``:
    meta tensors from the headers, for checking a checkpoint before any process starts;
    ``lazy``: ``LazyTensor``s, read region by region when loaded)."""
    from safetensors.torch import load_file

    load = _shapes_only if shapes_only else lazy_safetensors if lazy else load_file
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    try:
        if os.path.isfile(single):
            return load(single)
        if os.path.isfile(index):
            with open(index) as f:
                files = list(dict.fromkeys(json.load(f)["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for name in files:
                state.update(load(os.path.join(path, name)))
            return state
    except (OSError, ValueError, KeyError) as e:
        raise MimoError(f"{path!r}: could not read the safetensors weights: {e}") from None
    except Exception as e:  # safetensors raises its own error type on a corrupt file
        raise MimoError(f"{path!r}: could not read the safetensors weights: {e}") from None
    raise MimoError(f"{path!r} has no model.safetensors (or model.safetensors.index.json)")


def import_hf(path: str, arch: VitArch | None = None, shapes_only: bool = False) -> ImportedWeights:
    """``init: {hf: DIR}``: the checkpoint mapped onto ``arch`` (default: the checkpoint's own).
    ``shapes_only``: every check, nothing read (meta tensors from the safetensors headers): what
    ``mimo check-config`` runs before any process starts (``check_hf``)."""
    family, vision, whole = read_hf_config(path)
    source_arch = hf_arch(family, vision)
    arch = source_arch if arch is None else arch
    # the files stay where they are: each rank reads its own slices when the tower loads them
    state = load_hf_state(path, shapes_only=shapes_only, lazy=not shapes_only)
    weights = import_hf_state(state, arch, family, f"checkpoint {path!r}", whole)
    check_arch(arch, source_arch, f"checkpoint {path!r}")
    return weights


def check_hf(path: str, arch: VitArch) -> ImportedWeights:
    """MimoError unless the checkpoint directory fits ``arch`` (``import_hf``'s checks, on the
    safetensors headers only); the mapping of meta tensors (``meta``: prefix, family, config)."""
    return import_hf(path, arch, shapes_only=True)


def save_hf_checkpoint(path: str, weights: ImportedWeights, tower_state: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write ``weights`` (updated by ``tower_state``) as a checkpoint directory; the config's
    image size follows a resampled position embedding."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = json.loads(json.dumps(weights.meta.get("config") or {}))
    vision = config if config.get("model_type") in FAMILIES else config.get("vision_config", {})
    if weights.resampled:
        vision["image_size"] = weights.arch.image_size
    save_file({k: v.contiguous() for k, v in weights.export(tower_state).items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _hf_vision_class(family: str):
    import transformers

    return transformers.CLIPVisionModel if family == "clip" else transformers.SiglipVisionModel


def hf_tower_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str) -> tuple[dict, object]:
    """The checkpoint's vision-tower tensors (under the prefix of its patch embedding: a vision
    model, a full CLIP / SigLIP model, or the tower inside LLaVA) by the keys of the Hugging
    Face vision ``model``, and a function naming a model key as the checkpoint spells it."""
    prefix = find_prefix(state, where)
    model_prefix = find_prefix(model.state_dict(), f"the {type(model).__name__}")
    ignored = "embeddings.position_ids"  # a buffer older checkpoints saved
    tower = {model_prefix + k[len(prefix):]: t for k, t in state.items() if k.startswith(prefix) and not k.endswith(ignored)}
    return tower, lambda key: prefix + key[len(model_prefix):] if key.startswith(model_prefix) else key


def check_hf_tower(family: str, vision_config: dict, state: Mapping[str, torch.Tensor], where: str) -> None:
    """MimoError unless the checkpoint's tower tensors are exactly the Hugging Face vision
    model's (names and shapes; a meta-device model, nothing loaded or allocated)."""
    cfg = _config_class(family)(**{k: v for k, v in vision_config.items() if k != "model_type"})
    with torch.device("meta"):
        model = _hf_vision_class(family)(cfg)
    tower, name = hf_tower_state(model, state, where)
    load_exactly_(model, tower, where, name)  # meta into meta: only the check


def build_hf_model(family: str, vision_config: dict, path: str | None = None):
    """The original Hugging Face vision model: randomly initialised from the config (seed
    torch's global RNG first for a reproducible one), then, with ``path``, every weight loaded
    from the checkpoint's tower (``load_exactly_``: a vision model, a full CLIP / SigLIP model
    or a LLaVA checkpoint's tower; nothing left at random, nothing of the tower unused)."""
    cfg = _config_class(family)(**{k: v for k, v in vision_config.items() if k != "model_type"})
    model = _hf_vision_class(family)(cfg).float().eval()
    if path is not None:
        tower, name = hf_tower_state(model, load_hf_state(path), f"checkpoint {path!r}")
        load_exactly_(model, {k: t.float() for k, t in tower.items()}, f"checkpoint {path!r}", name)
    return model


def hf_features(model, family: str, pixels_NCHW: torch.Tensor, feature_layer: int | str, interpolate: bool = False) -> torch.Tensor:
    """The reference features ``[N, L, D]`` from the HF model's own forward."""
    out = model(pixel_values=pixels_NCHW, output_hidden_states=feature_layer != "post_norm",
                interpolate_pos_encoding=interpolate)
    if feature_layer == "post_norm":
        last = out.last_hidden_state
        return model.post_layernorm(last) if family == "clip" else last
    return out.hidden_states[feature_layer]
