"""Hugging Face LLaVA (``LlavaForConditionalGeneration``) <-> mimo's modules.

A LLaVA checkpoint is three models side by side, and each part is mapped by the module that
owns its mapping; this file only splits the keys and composes them:

    part        current names                              legacy names
    vision      model.vision_tower.[vision_model.]*         vision_tower.[vision_model.]*
    projector   model.multi_modal_projector.*              multi_modal_projector.*
    LLM body    model.language_model.*                     language_model.model.*
    LM head     lm_head.weight                             language_model.lm_head.weight

Current names are the model's own (``state_dict()`` since transformers 4.52); published
llava-1.5 checkpoints use the legacy ones (``vision_tower.vision_model.*``), and so does what
transformers 5's ``save_pretrained`` writes (``vision_tower.*``, converted back on load).

    vision    -> ``mimo.encoders.hf_import`` (CLIP / SigLIP tower rules, prefix found from the keys)
    projector -> ``mimo.encoders.hf_import.import_llava_projector`` (mlp2x_gelu, same names)
    LLM       -> ``mimo.llm.hf`` (its family's names), renamed into the LLaVA prefixes; a MoE text
                 model's per-expert tensors (``save_pretrained``'s) are stacked into its fused ones

Import accepts either naming (not a mix); export writes the checkpoint's own naming, key
order and dtypes, so import -> export reproduces the source exactly. (A source with per-expert
tensors exports the model's fused ones, its LLM in ``state_dict()`` order.) ``llava_arch`` reads an
HF ``LlavaConfig`` (``config.json``; HF's defaults filled in) into the mimo architecture, and
``llava_modules`` into the ``modules:`` section of a mimo config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Mapping

import torch

from mimo.encoders.config import VitArch
from mimo.encoders.hf_import import FAMILIES, hf_arch, import_hf_state, import_llava_projector, load_hf_state, read_config_json
from mimo.encoders.weights import ImportedWeights, replace_named
from mimo.core.errors import MimoError
from mimo.llm.config import HybridArch
from mimo.llm.hf import (
    LLAVA_LM,
    arch_from_hf_config,
    check_hf_tensors,
    export_hf_state,
    family,
    from_hf_state,
    full_shapes,
    hf_tensor_map,
    llava_lm_key,
    llava_text_config,
    normalised_llava_config,
    write_safetensors,
)

log = logging.getLogger(__name__)

__all__ = [
    "Naming", "NAMINGS", "LlavaArch", "LlavaWeights", "llava_arch", "llava_modules", "import_llava_state",
    "load_llava", "export_llava_state", "export_llava_grads", "save_llava", "check_fits", "load_llava_", "describe_llava",
    "import_to_checkpoint",
]


@dataclass(frozen=True)
class Naming:
    """Where LLaVA's parts sit in a state dict."""

    name: str
    vision: str  # prefix of the vision tower
    projector: str  # prefix of multi_modal_projector
    llm: str  # prefix that replaces a causal LM's "model."
    head: str  # the LM head's key

    def llm_key(self, causal_lm_key: str) -> str:
        """A Llama/Qwen ``*ForCausalLM`` key -> its key in this LLaVA naming."""
        return llava_lm_key(causal_lm_key, self.llm, self.head)

    def part(self, key: str) -> str | None:
        """'vision', 'projector', 'llm' or None (a key of no LLaVA part)."""
        if key.startswith(self.vision):
            return "vision"
        if key.startswith(self.projector):
            return "projector"
        if key.startswith(self.llm) or key == self.head:
            return "llm"
        return None


NAMINGS = {
    "current": Naming("current", "model.vision_tower.", "model.multi_modal_projector.", *LLAVA_LM["current"]),
    "legacy": Naming("legacy", "vision_tower.", "multi_modal_projector.", *LLAVA_LM["legacy"]),
}


def detect_naming(keys, where: str) -> Naming:
    """The naming a state dict uses; MimoError for neither or a mix of both."""
    keys = list(keys)
    # legacy's LM head also starts with "language_model.", so test the current roots first
    current = [k for k in keys if k.startswith(("model.vision_tower.", "model.multi_modal_projector.", "model.language_model."))]
    legacy = [k for k in keys if k.startswith(("vision_tower.", "multi_modal_projector.", "language_model."))]
    if current and legacy:
        raise MimoError(f"{where} mixes current LLaVA names ({current[0]!r}) with legacy ones ({legacy[0]!r})")
    if not current and not legacy:
        first = repr(keys[0]) if keys else "no tensors"
        raise MimoError(f"{where} is not a LLaVA state dict: no key under model.vision_tower / model.language_model "
                        f"(or the legacy vision_tower / language_model); first key: {first}")
    return NAMINGS["current" if current else "legacy"]


# ---------------------------------------------------------------- config


@dataclass(frozen=True)
class LlavaArch:
    """What mimo needs of an HF ``LlavaConfig``."""

    family: str  # "clip" or "siglip" (the vision tower)
    vision: VitArch
    llm: HybridArch
    feature_layer: int  # vision_feature_layer: hidden_states[L]
    drop_class_token: bool  # vision_feature_select_strategy == "default"
    image_token_id: int
    vision_config: dict = dataclasses.field(repr=False)  # the normalised sub-configs
    text_config: dict = dataclasses.field(repr=False)


def llava_arch(config: Mapping) -> LlavaArch:
    """The mimo architecture of an HF LLaVA config (a ``config.json`` dict)."""
    cfg = normalised_llava_config(config)
    vision = cfg["vision_config"]
    family = FAMILIES.get(vision.get("model_type"))
    if family is None:
        raise MimoError(f"LLaVA vision tower {vision.get('model_type')!r} is not supported ({', '.join(FAMILIES)})")
    layer = cfg["vision_feature_layer"]
    if not isinstance(layer, int):
        raise MimoError(f"vision_feature_layer {layer!r}: several feature layers (concatenated) are not supported; one int is")
    if cfg["projector_hidden_act"] != "gelu" or not cfg["multimodal_projector_bias"]:
        raise MimoError(f"the projector must be Linear-GELU-Linear with biases (mlp2x_gelu); this config has "
                        f"projector_hidden_act={cfg['projector_hidden_act']!r}, multimodal_projector_bias={cfg['multimodal_projector_bias']}")
    varch = hf_arch(family, vision)
    strategy = cfg["vision_feature_select_strategy"]
    if strategy == "default" and not varch.class_token:
        raise MimoError(f"vision_feature_select_strategy 'default' drops the first row, but a {family} tower has no [CLS] "
                        f"row (it would drop a patch); use 'full'")
    text = llava_text_config(config)
    return LlavaArch(family, varch, arch_from_hf_config(text), layer, strategy == "default",
                     int(cfg["image_token_index"]), vision, text)


def _plain(arch) -> dict:
    """An arch dataclass as YAML-ready data: its required fields and those that differ from
    what the dataclass would fill in by itself."""
    values = {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)}
    kept = {f.name for f in dataclasses.fields(arch)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    while True:  # until it rebuilds the arch: a fill-in may follow a kept field (gdn_head_dim: head_dim)
        rebuilt = type(arch)(**{k: values[k] for k in kept})
        differ = {k for k, v in values.items() if k not in kept and getattr(rebuilt, k) != v}
        if not differ:
            return {k: v for k, v in dataclasses.asdict(arch).items() if k in kept}
        kept |= differ


def llava_modules(config: Mapping, placeholder: str = "<image>", vision: str = "vision", language: str = "language") -> dict:
    """The ``modules:`` section of a mimo config for an HF LLaVA config (layouts left at their
    defaults: add ``parallel`` per module)."""
    arch = llava_arch(config)
    return {
        vision: {"kind": "vit", "arch": _plain(arch.vision), "projector": {"kind": "mlp2x_gelu"}, "placeholder": placeholder,
                 "feature_layer": arch.feature_layer, "drop_class_token": arch.drop_class_token},
        language: {"kind": "hybrid", "arch": _plain(arch.llm)},
    }


# ---------------------------------------------------------------- weights


@dataclass
class LlavaWeights:
    """A LLaVA checkpoint mapped onto mimo's modules, and what export needs to write it back."""

    where: str
    naming: Naming
    arch: LlavaArch
    config: dict  # config.json as read
    vision: ImportedWeights  # the tower by mimo name (every block), its extras
    projector: ImportedWeights  # linear_1 / linear_2 by mimo name
    llm: dict[str, torch.Tensor]  # canonical LLM names (``LLMStage.full_state``'s)
    llm_extras: dict[str, torch.Tensor]  # LLM keys mimo does not use (rotary buffers, a tied head)
    key_order: tuple[str, ...]
    dtypes: dict[str, torch.dtype]


def import_llava_state(state: Mapping[str, torch.Tensor], config: Mapping, where: str = "LLaVA state dict") -> LlavaWeights:
    """Map a LLaVA state dict (either naming) with its ``config.json``; MimoError naming the
    first tensor that does not fit, with both shapes."""
    arch = llava_arch(config)
    naming = detect_naming(state, where)
    parts: dict[str | None, dict[str, torch.Tensor]] = {"vision": {}, "projector": {}, "llm": {}, None: {}}
    for key, t in state.items():
        parts[naming.part(key)][key] = t
    if parts[None]:
        key = next(iter(parts[None]))
        raise MimoError(f"{where}: tensor {key!r} belongs to no LLaVA part (with {naming.name} names: "
                        f"{naming.vision}*, {naming.projector}*, {naming.llm}*, {naming.head})")
    vision = import_hf_state(parts["vision"], arch.vision, arch.family, where, arch.vision_config)
    for key, (got, need) in vision.resampled.items():  # the config's own image size: nothing to resample
        raise MimoError(f"{where}: tensor {key!r} has shape {got}, the config expects {need}")
    projector = import_llava_projector(parts["projector"], arch.vision, arch.llm.hidden, naming.projector, where)
    llm_state, renamed = _llm_state_dict_names(parts["llm"], arch)
    check_hf_tensors(arch.llm, {k: tuple(t.shape) for k, t in llm_state.items()}, where, naming.llm_key)
    llm = from_hf_state(llm_state, arch.llm, naming.llm_key)
    hf_order = list(hf_tensor_map(arch.llm, naming.llm_key))
    used = set(hf_order) | {naming.head}  # a tied head follows the embedding on export
    key_order = tuple(state)
    if renamed:  # the source's LLM names are not the model's: its LLM is written in the model's state_dict order
        llm_order = [k for k in hf_order if k in llm_state] + [k for k in llm_state if k not in used]
        first = next(i for i, k in enumerate(key_order) if naming.part(k) == "llm")
        others = [k for k in key_order if naming.part(k) != "llm"]
        before = sum(naming.part(k) != "llm" for k in key_order[:first])
        key_order = (*others[:before], *llm_order, *others[before:])
    return LlavaWeights(
        where, naming, arch, dict(config), vision, projector, llm,
        llm_extras={k: t for k, t in llm_state.items() if k not in used},
        key_order=key_order,
        dtypes={k: t.dtype for k, t in state.items() if naming.part(k) != "llm"} | {k: t.dtype for k, t in llm_state.items()},
    )


def _llm_state_dict_names(llm_state: Mapping[str, torch.Tensor], arch: LlavaArch) -> tuple[dict[str, torch.Tensor], bool]:
    """The language model's tensors under its ``model.state_dict()`` names (its family's
    ``checkpoint_view``: per-expert MoE tensors, as ``save_pretrained`` and older checkpoints
    store them, stacked into the fused ``mlp.experts.*``), and whether any name changed."""
    shapes = {k: tuple(t.shape) for k, t in llm_state.items()}
    view_shapes, get = family(arch.text_config.get("model_type")).checkpoint_view(arch.llm, list(llm_state), shapes,
                                                                                  llm_state.__getitem__)
    if list(view_shapes) == list(shapes):
        return dict(llm_state), False
    return {n: get(n)[tuple(slice(0, d) for d in shape)] for n, shape in view_shapes.items()}, True


def load_llava(path: str) -> LlavaWeights:
    """A LLaVA checkpoint directory: ``config.json`` and ``model.safetensors`` (or shards)."""
    return import_llava_state(load_hf_state(path), read_config_json(path), f"checkpoint {path!r}")


def export_llava_state(w: LlavaWeights, tower: Mapping[str, torch.Tensor] | None = None,
                       projector: Mapping[str, torch.Tensor] | None = None,
                       llm: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The LLaVA state dict in the checkpoint's naming, key order and dtypes; ``tower`` /
    ``projector`` / ``llm`` (mimo names: e.g. trained full states) replace what they name."""
    out = w.vision.export(tower)
    out.update(w.projector.export(projector))
    for key, t in export_hf_state(replace_named(w.llm, llm, "the LLM"), w.arch.llm, w.naming.llm_key).items():
        if key in w.dtypes:  # a tied head is written back only if the checkpoint had it
            out[key] = t.detach().cpu().to(w.dtypes[key])
    out.update(w.llm_extras)
    ordered = {k: out.pop(k) for k in w.key_order if k in out}
    ordered.update(out)
    return ordered


def export_llava_grads(w: LlavaWeights, encoder_grads: Mapping[str, torch.Tensor],
                       llm_grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full gradients of a mimo model in the checkpoint's names (for parity checks):
    ``encoder_grads`` by the encoder module's names (``tower.*``, ``projector.*``), ``llm_grads``
    canonical. What mimo never computes (blocks after the feature layer, a final norm or
    pooling head it does not run) gets zeros, as Hugging Face's unused parameters have none."""
    tower = {n: encoder_grads.get(f"tower.{n}", torch.zeros_like(t)) for n, t in w.vision.tower.items()}
    projector = {n: encoder_grads[f"projector.{n}"] for n in w.projector.tower}
    out = export_llava_state(w, tower, projector, llm_grads)
    for key in [*w.vision.extras, *w.llm_extras]:
        out[key] = torch.zeros_like(out[key])
    return out


def save_llava(path: str, state: Mapping[str, torch.Tensor], config: Mapping, max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the safetensors weights (``model.safetensors``, or shards
    above ``max_shard_bytes``; tied tensors stored once, as HF does)."""
    os.makedirs(path, exist_ok=True)
    skip = {detect_naming(state, path).head} if llava_arch(config).llm.tie_embeddings else set()
    write_safetensors(path, {k: v for k, v in state.items() if k not in skip}, max_shard_bytes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config), f, indent=2)


# ---------------------------------------------------------------- into a model


def check_fits(config, w: LlavaWeights, encoder: str | None = None) -> str:
    """MimoError unless the weights fit the ``MimoConfig``'s modules; returns the encoder that
    takes the vision tower (default: the only encoder)."""
    names = list(config.encoders)
    if encoder is None:
        if len(names) != 1:
            raise MimoError(f"the config has encoders {names}; name the one the LLaVA vision tower goes into")
        encoder = names[0]
    if encoder not in config.encoders:
        raise MimoError(f"no encoder module {encoder!r} (encoders: {names})")
    enc_cfg, llm = config.encoders[encoder], config.llm_name
    if enc_cfg.native:
        raise MimoError(f"modules.{encoder} is kind {enc_cfg.kind}; LLaVA's vision tower goes into a kind: vit encoder")
    if enc_cfg.projector.kind != "mlp2x_gelu":
        raise MimoError(f"modules.{encoder}.projector.kind is {enc_cfg.projector.kind!r}; LLaVA's projector is mlp2x_gelu")
    if enc_cfg.arch != w.arch.vision:
        raise MimoError(f"modules.{encoder}.arch {enc_cfg.arch} is not {w.where}'s vision tower {w.arch.vision}")
    want = full_shapes(config.llm.arch)
    for name, t in w.llm.items():
        if name not in want or tuple(t.shape) != want[name]:
            need = want.get(name, "no such parameter")
            raise MimoError(f"{w.where}: the LLM's {name!r} has shape {tuple(t.shape)}; modules.{llm}.arch needs {need}")
    for field in ("rope_theta", "rope_scaling", "norm_eps", "qk_norm", "mlp_act", "head_dim"):
        ours, theirs = getattr(config.llm.arch, field), getattr(w.arch.llm, field)
        if ours != theirs:
            raise MimoError(f"modules.{llm}.arch.{field} is {ours!r}, {w.where} has {theirs!r}")
    if (enc_cfg.feature_layer, enc_cfg.drop_class_token) != (w.arch.feature_layer, w.arch.drop_class_token):
        log.warning("%s: feature_layer=%r, drop_class_token=%r differ from the checkpoint's (%r, %r)", w.where,
                    enc_cfg.feature_layer, enc_cfg.drop_class_token, w.arch.feature_layer, w.arch.drop_class_token)
    return encoder


def load_llava_(model, w: LlavaWeights, encoder: str | None = None) -> None:
    """Load the weights into a built ``MimoModel`` on this rank: the tower and projector of
    ``encoder`` (default: the only encoder) and this rank's LLM stage."""
    encoder = check_fits(model.config, w, encoder)
    module = model.part(encoder).module
    if module is not None:
        module.tower.load_weights_(w.vision)
        module.imported = w.vision
        module.projector.load_full_(w.projector.tower)
    if model.llm.module is not None:
        model.llm.module.load_full_(w.llm)


# ---------------------------------------------------------------- `mimo import-hf-llava`


def emit_modules(text: str, out: str | None) -> None:
    """An import's modules section (YAML and its comments): printed, or written to ``out``."""
    if out is None:
        print(text, end="")
        return
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}")


def describe_llava(path: str, out: str | None = None) -> dict:
    """Check that every tensor of a LLaVA checkpoint fits its config (shapes from the file
    headers, nothing loaded) and give the ``modules:`` section of a mimo config whose vision
    tower and LLM load from it (``init.hf``); printed, or written to ``out``."""
    import yaml

    config = read_config_json(path)
    w = import_llava_state(load_hf_state(path, shapes_only=True), config, f"checkpoint {path!r}")
    modules = llava_modules(config)
    modules["vision"]["init"] = {"hf": path}
    modules["language"]["init"] = {"hf": path}
    text = (f"# modules of the LLaVA checkpoint {path} ({w.naming.name} key names); add parallel: per module,\n"
            f"# and the data and train sections. init.hf loads the tower and the LLM, not the projector (it starts random,\n"
            f"# as in LLaVA's stage 1); for all three: mimo import-hf-llava {path} --config CONFIG --out DIR, then train.init_from: DIR\n"
            + yaml.safe_dump({"modules": modules}, sort_keys=False))
    emit_modules(text, out)
    return {"ok": True, "command": "import-hf-llava", "checkpoint": path, "naming": w.naming.name,
            "tensors": len(w.key_order), "modules": modules, "projector_loaded": False, "out": out}


def _convert_rank(checkpoint: str, config_path: str, overrides: list[str], out: str) -> str:
    """One rank of ``import_to_checkpoint``: its part of the model, loaded and saved."""
    import torch.distributed as dist

    from mimo.training.checkpoint import save_checkpoint
    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel

    model = MimoModel(load_config(config_path, overrides).without_adapters(), dist.get_rank())  # (the base)
    load_llava_(model, load_llava(checkpoint))
    return save_checkpoint(model, {}, 0, out, extra_meta={"imported_from": checkpoint})


def import_to_checkpoint(checkpoint: str, config_path: str, overrides: list[str], out: str, timeout_s: float = 900.0) -> dict:
    """The LLaVA checkpoint as a mimo checkpoint (step 0, weights only) at the config's layout,
    written by the config's ranks on local processes: ``train.init_from`` starts a run from it,
    projector included. Every rank reads the whole checkpoint file(s)."""
    from mimo.training.checkpoint import layout_of
    from mimo.compose.config import load_config
    from mimo.training.launch import WorkerPool

    config = load_config(config_path, overrides)
    check_fits(config, import_llava_state(load_hf_state(checkpoint, shapes_only=True), read_config_json(checkpoint),
                                          f"checkpoint {checkpoint!r}"))  # before any process starts
    with WorkerPool(config.world_size, timeout_s=timeout_s) as pool:
        path = pool.run(_convert_rank, checkpoint, config_path, list(overrides), out)[0]
    print(f"wrote {path} (layout {layout_of(config)}); start a run from it with train.init_from: {out}")
    return {"ok": True, "command": "import-hf-llava", "checkpoint": checkpoint, "out": path, "layout": layout_of(config)}
