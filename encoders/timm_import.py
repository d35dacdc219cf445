"""timm ``VisionTransformer`` weights (ViT, CLIP and SigLIP towers as timm names them) <-> the tower.

Mapping (timm -> mimo):

    patch_embed.proj.{weight,bias}      -> patch_embed.{weight,bias}      (bias: not with pre-norm)
    cls_token [1, 1, D]                 -> cls_token [D]
    pos_embed [1, L, D]                 -> pos_embed [L, D]               (resampled if the grid differs)
    norm_pre.*                          -> norm_pre.*                     (CLIP)
    blocks.i.norm1/norm2.*              -> blocks.i.norm1/norm2.*
    blocks.i.attn.qkv.* [3D, ...]       -> same names and shapes        (q | k | v, fused as mimo stores it)
    blocks.i.attn.proj.*, mlp.fc1.*, mlp.fc2.*  -> same names
    norm.*                              -> norm.*                         (the post_norm features)
    head.*, attn_pool.*, fc_norm.*      -> extras, exported unchanged     (CLIP projection, SigLIP MAP head)

``timm`` is imported inside the functions that need it.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from mimo.encoders.config import VitArch
from mimo.encoders.vit import patch_bias
from mimo.encoders.weights import ImportedWeights, Rule, check_arch, load_state_file, map_state
from mimo.core.errors import MimoError

__all__ = ["create_timm_model", "timm_arch", "timm_rules", "import_timm_state", "import_timm", "timm_features"]

# timm parameters the tower does not compute: heads, kept as extras
_HEAD_PREFIXES = ("head.", "attn_pool.", "fc_norm.")


def create_timm_model(name: str, *, pretrained: bool = False, **kwargs):
    """``timm.create_model`` with user errors as MimoError (no network unless ``pretrained``)."""
    import timm

    try:
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    except RuntimeError as e:
        if "Unknown model" in str(e):
            raise MimoError(f"unknown timm model {name!r} (see timm.list_models())") from None
        if pretrained:
            raise MimoError(f"could not load pretrained weights for timm model {name!r}: {e}") from None
        raise
    except TypeError as e:
        raise MimoError(f"timm model {name!r} does not accept {kwargs}: {e}") from None
    except OSError as e:  # pretrained weights not cached and no network
        raise MimoError(f"could not load pretrained weights for timm model {name!r}: {e}") from None


def _act_name(act) -> str:
    kind = type(act).__name__
    if kind == "GELU":
        return "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    if kind == "GELUTanh":
        return "gelu_tanh"
    if kind == "QuickGELU":
        return "quick_gelu"
    raise MimoError(f"activation {kind} is not supported by the mimo ViT (gelu, gelu_tanh, quick_gelu)")


def timm_arch(model) -> VitArch:
    """The ``VitArch`` of a timm ``VisionTransformer``; MimoError naming what the tower lacks."""
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise MimoError(f"timm model {type(model).__name__} is not a VisionTransformer; mimo imports ViT, CLIP and SigLIP towers")
    block = model.blocks[0]
    unsupported = {
        "register tokens": getattr(model, "num_reg_tokens", 0) > 0,
        "position embeddings without the class token (no_embed_class)": getattr(model, "no_embed_class", False),
        "no position embedding": model.pos_embed is None,
        "dynamic image size": getattr(model, "dynamic_img_size", False),
        "a norm inside the patch embedding": not isinstance(model.patch_embed.norm, torch.nn.Identity),
        "qk-norm": not isinstance(block.attn.q_norm, torch.nn.Identity),
        "layer scale": not isinstance(block.ls1, torch.nn.Identity),
        "a norm inside attention / MLP": not isinstance(getattr(block.attn, "norm", torch.nn.Identity()), torch.nn.Identity)
        or not isinstance(getattr(block.mlp, "norm", torch.nn.Identity()), torch.nn.Identity),
        "a gated MLP": not hasattr(block.mlp, "fc1"),
        "attention without qkv bias": block.attn.qkv.bias is None,
    }
    found = [what for what, present in unsupported.items() if present]
    if found:
        raise MimoError(f"timm model uses {', '.join(found)}, which the mimo ViT does not support")
    patch = model.patch_embed.patch_size
    img = model.patch_embed.img_size
    if patch[0] != patch[1] or img[0] != img[1]:
        raise MimoError(f"timm model has a non-square patch {patch} or image size {img}; the mimo ViT needs square ones")
    norm = model.norm if not isinstance(model.norm, torch.nn.Identity) else block.norm1
    arch = VitArch(
        image_size=img[0],
        patch=patch[0],
        hidden=model.embed_dim,
        layers=len(model.blocks),
        heads=block.attn.num_heads,
        mlp=block.mlp.fc1.out_features,
        channels=model.patch_embed.proj.in_channels,
        class_token=model.cls_token is not None,
        pre_norm=not isinstance(model.norm_pre, torch.nn.Identity),
        act=_act_name(block.mlp.act),
        norm_eps=float(norm.eps),
    )
    if (model.patch_embed.proj.bias is not None) != patch_bias(arch):
        raise MimoError("timm model's patch embedding bias does not follow the pre-norm convention (bias iff no pre-norm)")
    return arch


def timm_rules(arch: VitArch) -> list[Rule]:
    D, F, C, p = arch.hidden, arch.mlp, arch.channels, arch.patch
    L = (arch.image_size // p) ** 2 + (1 if arch.class_token else 0)

    def same(name, *shape, optional=False):
        return Rule(name, (name,), tuple(shape), tuple(shape), optional)

    rules = [Rule("patch_embed.weight", ("patch_embed.proj.weight",), (D, C, p, p), (D, C, p, p))]
    if patch_bias(arch):
        rules.append(Rule("patch_embed.bias", ("patch_embed.proj.bias",), (D,), (D,)))
    if arch.class_token:
        rules.append(Rule("cls_token", ("cls_token",), (D,), (1, 1, D)))
    rules.append(Rule("pos_embed", ("pos_embed",), (L, D), (1, L, D)))
    if arch.pre_norm:
        rules += [same("norm_pre.weight", D), same("norm_pre.bias", D)]
    for i in range(arch.layers):
        b = f"blocks.{i}."
        rules += [
            same(b + "norm1.weight", D), same(b + "norm1.bias", D),
            same(b + "attn.qkv.weight", 3 * D, D), same(b + "attn.qkv.bias", 3 * D),
            same(b + "attn.proj.weight", D, D), same(b + "attn.proj.bias", D),
            same(b + "norm2.weight", D), same(b + "norm2.bias", D),
            same(b + "mlp.fc1.weight", F, D), same(b + "mlp.fc1.bias", F),
            same(b + "mlp.fc2.weight", D, F), same(b + "mlp.fc2.bias", D),
        ]  # fmt: skip
    rules += [same("norm.weight", D, optional=True), same("norm.bias", D, optional=True)]
    return rules


def _unmapped(arch: VitArch):
    def decide(key: str) -> str | None:
        if key.startswith(_HEAD_PREFIXES):
            return None
        parts = key.split(".")
        if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) >= arch.layers:
            return f"tensor {key!r} belongs to block {parts[1]}, but arch.layers is {arch.layers}"
        return f"tensor {key!r} has no place in the mimo ViT (an unsupported timm feature?)"

    return decide


def _resample_pos_embed(arch: VitArch):
    """timm's own resize (``resample_abs_pos_embed``: bicubic, antialias, prefix tokens kept),
    as timm applies it when loading weights into a model of another image size."""
    prefix = 1 if arch.class_token else 0
    grid = arch.image_size // arch.patch

    def resample(t: torch.Tensor):
        from timm.layers import resample_abs_pos_embed

        if t.dim() != 3 or t.shape[0] != 1 or t.shape[2] != arch.hidden:
            return None
        old = math.isqrt(t.shape[1] - prefix) if t.shape[1] > prefix else 0
        if old * old != t.shape[1] - prefix or old == 0:
            return None
        return resample_abs_pos_embed(t, new_size=[grid, grid], old_size=[old, old], num_prefix_tokens=prefix,
                                      interpolation="bicubic", antialias=True)

    return resample


def import_timm_state(state: Mapping[str, torch.Tensor], arch: VitArch, where: str = "timm state dict") -> ImportedWeights:
    """Map a timm ViT state dict onto ``arch`` (position embeddings resampled to its image size)."""
    if "patch_embed.proj.weight" not in state and any(k.startswith(("visual.", "module.visual.")) for k in state):
        raise MimoError(f"{where} is in OpenAI / OpenCLIP layout, not timm's: load it into the timm model "
                        f"(timm converts it on load) and save that model's state_dict()")
    return map_state(
        state, timm_rules(arch), source="timm", where=where, arch=arch,
        unmapped=_unmapped(arch), resamplers={"pos_embed": _resample_pos_embed(arch)},
    )


def import_timm(name: str, arch: VitArch, path: str | None = None, **kwargs) -> ImportedWeights:
    """``init: {timm: NAME, path: FILE}``: the file's tensors (else timm's own pretrained
    source, which needs its cache or the network), checked against ``arch`` and the model
    ``NAME`` describes."""
    source_arch = timm_arch(create_timm_model(name, device="meta", **kwargs))
    if path is not None:
        state = load_state_file(path, lazy=True)  # a safetensors file is read slice by slice on load
        where = f"checkpoint {path!r}"
    else:
        state = create_timm_model(name, pretrained=True, **kwargs).state_dict()
        where = f"timm pretrained {name!r}"
    weights = import_timm_state(state, arch, where)
    check_arch(arch, source_arch, f"timm model {name!r}")
    return weights


def timm_features(model, pixels_NCHW: torch.Tensor, feature_layer: int | str) -> torch.Tensor:
    """The reference features ``[N, L, D]`` through timm's own API (prefix tokens included)."""
    from mimo.encoders.vit import resolve_feature_layer

    n_blocks, post_norm = resolve_feature_layer(len(model.blocks), feature_layer)
    if post_norm:
        return model.forward_features(pixels_NCHW)
    if n_blocks == 0:  # hidden_states[0]: the embeddings after the pre-norm
        return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(pixels_NCHW))))
    out = model.forward_intermediates(pixels_NCHW, indices=[n_blocks - 1], norm=False, output_fmt="NLC",
                                      intermediates_only=True, return_prefix_tokens=True)
    spatial, prefix = out[0] if isinstance(out[0], tuple) else (out[0], None)
    return spatial if prefix is None else torch.cat([prefix, spatial], dim=1)
