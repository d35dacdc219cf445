"""Hugging Face native-resolution VLMs <-> mimo's modules: Qwen3-VL (``Qwen3VLForConditionalGeneration``,
``Qwen3VLMoeForConditionalGeneration``), Qwen3.5 (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``) and Kimi-K2.5 (``Kimi_K25ForConditionalGeneration``):
``mimo import-hf`` (its native-VLM branch) and ``mimo export-hf`` of such a run.

A checkpoint is two models side by side, each mapped by the module that owns its mapping:

    part        names                                       mimo
    vision      model.visual.*                              a ``kind: qwen3_vl`` encoder (``mimo.encoders.hf_qwen3_vl``)
    LLM         model.language_model.*, lm_head.weight      the ``kind: hybrid`` LLM (``mimo.llm.hf``: qwen3_vl_text,
                                                            qwen3_vl_moe_text; deepstack after decoder layers 0, 1, ...)

Qwen3.5 is laid out alike: Qwen3-VL's tower without deepstack, and a Gated DeltaNet language model
(``mimo.llm.hf``: qwen3_5_text, qwen3_5_moe_text; M-RoPE, no deepstack). Kimi-K2.5: the MoonViT
tower and its projector (``model.vision_tower.*``, ``model.mm_projector.*``: a ``kind: kimi_k25``
encoder, ``mimo.encoders.hf_kimi_k25``) beside a DeepSeek-V3 language model (1-D RoPE, no
deepstack); its checkpoints also come in Moonshot's published naming and in the one transformers'
``save_pretrained`` writes (both read; export writes transformers' ``state_dict`` names).
The encoder kind of a model type is ``mimo.encoders.config.NATIVE_TOWERS``'.

``qwen3_vl_modules`` reads a ``config.json`` into the ``modules:`` section of a mimo config (the
tower's arch, the LLM's ``qwen3_vl_arch``), ``describe_qwen3_vl`` checks every
tensor of a directory against it (safetensors headers only), and ``import_to_checkpoint`` writes a
mimo checkpoint (step 0, weights only) at a config's layout: the config's ranks build the model
with both modules' ``init.hf`` set to the directory (each rank reading its own slices) and save it.

``export_qwen3_vl`` writes a run back: ``config.json`` as transformers' ``Qwen3VLConfig`` /
``Qwen3VLMoeConfig`` / ``Qwen3_5Config`` / ``Qwen3_5MoeConfig`` / ``Kimi_K25Config``, by the tower's
kind and the LLM's family (vision config from the tower's arch, text config from the LLM's), the
weights under Hugging Face's names (``model.state_dict()``'s, a tied head stored once), and the
tokenizer / processor files of the directory the run imported from. mimo does not record
the image / video / vision start / end token ids: they come from that directory's ``config.json``
(``modules.<name>.init.hf`` of either module, an ``import-hf`` checkpoint's ``imported_from``,
or ``convert-checkpoint`` / ``train.init_from`` back to one), and without one export stops with
an error.
"""

from __future__ import annotations

import logging
import json
import os
import shutil
from typing import Mapping

import torch

from mimo.core.errors import CheckpointError, MimoError

log = logging.getLogger(__name__)

__all__ = ["ARCHITECTURES", "TOKEN_IDS", "qwen3_vl_modules", "describe_qwen3_vl", "check_fits", "import_to_checkpoint",
           "qwen3_vl_hf_config", "qwen3_vl_state", "export_qwen3_vl"]

# config.json model_type -> (architecture, transformers config class)
ARCHITECTURES = {"qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig"),
                 "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig"),
                 "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config"),
                 "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig"),
                 "kimi_k25": ("Kimi_K25ForConditionalGeneration", "Kimi_K25Config")}
# the LLM's family -> model_type (whose tower kind must be the run's: NATIVE_TOWERS)
TEXT_FAMILIES = {"qwen3_vl_text": "qwen3_vl", "qwen3_vl_moe_text": "qwen3_vl_moe", "qwen3_5_text": "qwen3_5",
                 "qwen3_5_moe_text": "qwen3_5_moe", "deepseek_v3": "kimi_k25"}
TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# files of a Hugging Face directory that belong to its tokenizer / processor (copied on export)
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.json", "chat_template.jinja",
                   "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "generation_config.json")


def tower_of(config: Mapping):
    """The ``NATIVE_TOWERS`` kind of a whole ``config.json`` dict's vision tower."""
    from mimo.encoders.config import native_tower_of

    return native_tower_of(config.get("model_type"))


# ---------------------------------------------------------------- config


def _vision_arch(config: Mapping):
    """The tower's arch of a whole config.json dict (its kind's arch class)."""
    return tower_of(config).arch.from_hf_config(config)


def qwen3_vl_modules(config: Mapping, path: str | None = None, vision: str = "vision", language: str = "language") -> dict:
    """The ``modules:`` section of a mimo config for a native VLM's ``config.json`` dict (layouts
    left at their defaults: add ``parallel`` per module); ``path``: both modules' ``init.hf``."""
    from mimo.commands.hf_llava import _plain

    tower = tower_of(config)
    modules = {vision: {"kind": tower.kind, "arch": _plain(_vision_arch(config))},
               language: {"kind": "hybrid", "arch": _plain(_llm_arch(config, path))}}
    if path is not None:
        for m in modules.values():
            m["init"] = {"hf": path}
        image = processor_image_settings(path, tower.kind)
        if image:
            modules[vision]["image"] = image
        video = processor_video_settings(path) if tower.videos else {}
        if video:
            modules[vision]["video"] = video
    return modules


def _llm_arch(config: Mapping, path: str | None):
    """The LLM's arch of a config.json dict; with the checkpoint ``path``, MTP as its language
    model's tensors say (``with_checkpoint_mtp``)."""
    from mimo.llm.hf import HFCheckpoint, language_model_of, qwen3_vl_arch, with_checkpoint_mtp

    arch = qwen3_vl_arch(config)
    return arch if path is None else with_checkpoint_mtp(arch, language_model_of(HFCheckpoint(path))[2])


def _json_or_empty(file: str) -> dict:
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def processor_image_settings(path: str, kind: str = "qwen3_vl") -> dict:
    """The ``kind`` tower's ``image`` section from the directory's ``preprocessor_config.json``
    (the processor's pixel budget and normalisation; {} without one): the data path then cuts
    images as that processor does."""
    from mimo.encoders.config import NATIVE_TOWERS

    pre = _json_or_empty(os.path.join(path, "preprocessor_config.json"))
    return NATIVE_TOWERS[kind].image.from_processor(pre)


def processor_video_settings(path: str) -> dict:
    """The tower's ``video`` section from the directory's ``video_preprocessor_config.json`` (frame
    sampling and the pixel budget over all frames; {} without one: the tower then takes no videos)."""
    pre = _json_or_empty(os.path.join(path, "video_preprocessor_config.json"))
    size = pre.get("size") or {}
    out = {"fps": pre.get("fps"), "min_frames": pre.get("min_frames"), "max_frames": pre.get("max_frames"),
           "min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge"),
           "cap_pixels_per_frame": pre.get("cap_pixels_per_frame"), "max_video_tokens": pre.get("max_video_tokens")}
    kinds = {"fps": float, "cap_pixels_per_frame": bool}
    return {k: kinds.get(k, int)(v) for k, v in out.items() if v is not None}


def _read_config(path: str) -> dict:
    from mimo.encoders.hf_import import read_config_json

    config = read_config_json(path)
    if config.get("model_type") not in ARCHITECTURES:
        raise MimoError(f"{os.path.join(path, 'config.json')}: model_type {config.get('model_type')!r} is not a Qwen3-VL, "
                        f"Qwen3.5 or Kimi-K2.5 model ({', '.join(ARCHITECTURES)})")
    return config


def _check_tensors(path: str, vision_arch, llm_arch, source: str) -> int:
    """MimoError unless every tensor of the directory has its place (the tower's, the language
    model's) with its shape; shapes from the safetensors headers. Returns the tensor count."""
    from mimo.llm.hf import HFCheckpoint, check_hf_checkpoint, language_model_of

    tower = tower_of(_read_config(path))
    hf = tower.hf_module()
    weights = hf.import_hf(path, vision_arch, shapes_only=True)  # the tower's tensors and arch
    language = set(language_model_of(HFCheckpoint(path))[2])
    stray = [k for k in weights.key_order if not k.startswith(hf.TOWER_PREFIXES) and k not in language]
    if stray:
        raise MimoError(f"{source}: tensor {stray[0]!r} belongs to no part of the {tower.title} model (its vision tower "
                        f"or its language model)")
    checked = check_hf_checkpoint(llm_arch, path, source=source)  # the language model's, none missing or extra
    if checked.differences:
        raise MimoError(f"{source}: the language model's tensors fit, but " + "; ".join(checked.differences))
    return len(weights.key_order)


# ---------------------------------------------------------------- `mimo import-hf DIR` (Qwen3-VL)


def describe_qwen3_vl(path: str, out: str | None = None) -> dict:
    """Check that every tensor of a Qwen3-VL checkpoint fits its config (headers only) and give
    the ``modules:`` section of a mimo config whose tower and LLM load from it (``init.hf``);
    printed, or written to ``out``."""
    import yaml

    from mimo.commands.hf_llava import emit_modules

    config = _read_config(path)
    architecture = ARCHITECTURES[config["model_type"]][0]
    tensors = _check_tensors(path, _vision_arch(config), _llm_arch(config, path), f"checkpoint {path!r}")
    modules = qwen3_vl_modules(config, path)
    text = (f"# modules of the checkpoint {path} ({architecture}); add parallel: per module, and the data and\n"
            f"# train sections. init.hf loads the vision tower (its mergers or projector) and the LLM;\n"
            f"# as a mimo checkpoint: mimo import-hf {path} --config CONFIG --out DIR; mimo export-hf writes it back.\n"
            + yaml.safe_dump({"modules": modules}, sort_keys=False))
    emit_modules(text, out)
    return {"ok": True, "command": "import-hf", "checkpoint": path, "architecture": architecture, "tensors": tensors,
            "modules": modules, "out": out}


def check_fits(config, path: str) -> str:
    """MimoError unless the checkpoint ``path`` fits the ``MimoConfig``: its one encoder of the
    checkpoint's tower kind (returned) and its LLM, arch by arch and tensor by tensor."""
    from mimo.llm.hf import qwen3_vl_arch

    source = _read_config(path)
    tower = tower_of(source)
    names = [name for name, enc in config.encoders.items() if enc.kind == tower.kind]
    if len(names) != 1:
        raise MimoError(f"the config has {len(names)} kind: {tower.kind} encoders ({', '.join(names) or 'none'}); the "
                        f"{tower.title} vision tower of {path!r} goes into exactly one")
    encoder, llm = names[0], config.llm_name
    theirs = qwen3_vl_arch(source)
    if list(config.llm.arch.deepstack_layers) != list(theirs.deepstack_layers):
        raise MimoError(f"modules.{llm}.arch.deepstack_layers is {list(config.llm.arch.deepstack_layers)}, checkpoint "
                        f"{path!r} adds its deepstack levels after layers {list(theirs.deepstack_layers)}")
    try:
        _check_tensors(path, config.encoders[encoder].arch, config.llm.arch, f"checkpoint {path!r}")
    except MimoError as e:
        raise MimoError(f"modules.{encoder} / modules.{llm}: {e}") from None
    return encoder


def _convert_rank(path: str, config_path: str, overrides: list[str], out: str, encoder: str) -> str:
    """One rank of ``import_to_checkpoint``: its part of the model, loaded (``init.hf``) and saved."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.compose.model import MimoModel
    from mimo.training.checkpoint import save_checkpoint

    config = load_config(config_path, overrides).without_adapters()  # (the base)
    config.modules[encoder].init.hf = path  # what the run loads: recorded with the checkpoint's config
    config.llm.init.hf = path
    model = MimoModel(config, dist.get_rank())
    return save_checkpoint(model, {}, 0, out, extra_meta={"imported_from": path})


def import_to_checkpoint(path: str, config_path: str, overrides: list[str], out: str, timeout_s: float = 900.0,
                         pool=None) -> dict:
    """The Qwen3-VL checkpoint as a mimo checkpoint (step 0, weights only) at the config's layout,
    written by the config's ranks on local processes (``pool``: a ``WorkerPool`` of the config's
    world size to run on; default: one started here): ``train.init_from`` starts a run from it,
    ``export-hf`` writes it back. Everything is checked before any process starts."""
    from mimo.compose.config import load_config
    from mimo.training.checkpoint import layout_of
    from mimo.training.launch import WorkerPool

    config = load_config(config_path, overrides)
    encoder = check_fits(config, path)
    args = (_convert_rank, os.path.abspath(path), config_path, list(overrides), out, encoder)  # (recorded: found from anywhere)
    if pool is None:
        with WorkerPool(config.world_size, timeout_s=timeout_s) as started:
            written = started.run(*args)[0]
    else:
        if pool.world_size != config.world_size:
            raise MimoError(f"a pool of {pool.world_size} ranks cannot write the config's layout (world_size={config.world_size})")
        written = pool.run(*args)[0]
    print(f"wrote {written} (layout {layout_of(config)}); start a run from it with train.init_from: {out}, or write it "
          f"back with mimo export-hf {written} --out DIR")
    return {"ok": True, "command": "import-hf", "checkpoint": path, "architecture": ARCHITECTURES[_read_config(path)["model_type"]][0],
            "out": written, "layout": layout_of(config), "encoder": encoder}


# ---------------------------------------------------------------- `mimo export-hf` of such a run


def _is_qwen3_vl_dir(path: str) -> bool:
    try:
        _read_config(path)
        return True
    except MimoError:
        return False


def _text_family(arch, kind: str | None = None) -> str:
    """The LLM's Hugging Face family, one that a VLM of the tower ``kind`` (if given) holds."""
    from mimo.encoders.config import NATIVE_TOWERS
    from mimo.llm.hf import hf_model_type

    family = hf_model_type(arch)
    if family not in TEXT_FAMILIES:
        raise MimoError(f"the LLM is a Hugging Face {family!r} model, not the language model of a Qwen3-VL, Qwen3.5 or "
                        f"Kimi-K2.5 ({', '.join(TEXT_FAMILIES)}); Hugging Face's native-resolution VLMs have no place for it")
    if kind is not None and TEXT_FAMILIES[family] not in NATIVE_TOWERS[kind].model_types:
        raise MimoError(f"the LLM is a Hugging Face {family!r} model, the language model of {TEXT_FAMILIES[family]}, whose "
                        f"vision tower is not the run's kind: {kind} ({NATIVE_TOWERS[kind].title}: "
                        f"{', '.join(NATIVE_TOWERS[kind].model_types)})")
    return family


def qwen3_vl_hf_config(config, encoder: str, token_ids: Mapping[str, int], dtype: torch.dtype) -> dict:
    """The ``Qwen3VLConfig`` / ``Qwen3VLMoeConfig`` / ``Qwen3_5Config`` / ``Qwen3_5MoeConfig`` /
    ``Kimi_K25Config`` (a ``config.json`` dict, by the LLM's family) of the run's tower and LLM,
    with the given token ids."""
    import transformers

    from mimo.llm.hf import hf_config_from_arch

    enc, arch = config.encoders[encoder], config.llm.arch
    family = _text_family(arch, enc.kind)
    levels = len(enc.arch.deepstack_layers)
    if len(arch.deepstack_layers) != levels:
        raise MimoError(f"modules.{encoder} has {levels} deepstack levels, modules.{config.llm_name} "
                        f"{len(arch.deepstack_layers)}; Hugging Face's Qwen3-VL has one count for both (Qwen3.5: none)")
    model_type = TEXT_FAMILIES[family]
    architecture, cls = ARCHITECTURES[model_type]
    text = {k: v for k, v in hf_config_from_arch(arch, family).items() if k != "architectures"}
    cfg = getattr(transformers, cls)(text_config=text, tie_word_embeddings=arch.tie_embeddings, **dict(token_ids),
                                     **enc.arch.to_hf_kwargs(model_type)).to_dict()
    cfg["architectures"] = [architecture]
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    return cfg


def qwen3_vl_state(config, full: Mapping[str, Mapping[str, torch.Tensor]], encoder: str) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict (``model.state_dict()``'s names and order) of the gathered tensors."""
    from mimo.encoders.config import NATIVE_TOWERS
    from mimo.llm.hf import qwen3_vl_text_to_hf

    arch, enc = config.llm.arch, config.encoders[encoder]
    tower = {n[len("tower."):]: t for n, t in full[encoder].items() if n.startswith("tower.") and not n.endswith("fp8_history")}
    return {**NATIVE_TOWERS[enc.kind].hf_module().tower_state_to_hf(tower, enc.arch),
            **qwen3_vl_text_to_hf(full[config.llm_name], arch, _text_family(arch, enc.kind))}


def export_qwen3_vl(out: str, path: str, meta: dict, config, full: Mapping[str, Mapping[str, torch.Tensor]], tokenizer,
                    max_shard_bytes: int | None) -> tuple[str, dict]:
    """Write the run (checkpoint ``path``, its ``meta``, its full tensors) as a Hugging Face
    Qwen3-VL / Qwen3.5 / Kimi-K2.5 directory into ``out`` (module doc); (architecture, what the
    result reports)."""
    from mimo.llm.hf import normalised_qwen3_vl_config, save_hf_checkpoint

    names = list(config.encoders)
    if len(names) != 1:
        raise MimoError(f"the run has encoders {names}; Hugging Face's native-resolution VLMs have one vision tower "
                        f"(use --llm-only to export the language model alone)")
    encoder, llm = names[0], config.llm_name
    if encoder not in full:
        raise CheckpointError(f"{path}: no tensors of the encoder {encoder!r}")
    from mimo.training.checkpoint import weights_origin

    kind = config.encoders[encoder].kind
    source = weights_origin(meta, [encoder, llm], lambda d: _is_qwen3_vl_dir(d) and tower_of(_read_config(d)).kind == kind)
    if source is None:
        raise MimoError(f"export-hf: Hugging Face's config needs the {', '.join(TOKEN_IDS)}, which mimo does not "
                        f"record; they come from the Hugging Face directory the run imported from, and {path} records none "
                        f"that is there (modules.{encoder}.init.hf or modules.{llm}.init.hf, an import-hf checkpoint's "
                        f"imported_from, or convert-checkpoint / train.init_from back to one)")
    source_config = normalised_qwen3_vl_config(_read_config(source))
    token_ids = {k: int(source_config[k]) for k in TOKEN_IDS}
    dtype = next(iter(full[llm].values())).dtype
    hf_config = qwen3_vl_hf_config(config, encoder, token_ids, dtype)
    save_hf_checkpoint(out, qwen3_vl_state(config, full, encoder), hf_config, max_shard_bytes)
    copied = [name for name in PROCESSOR_FILES if os.path.isfile(os.path.join(source, name))]
    for name in copied:
        shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
    tokenizer_saved = False
    if tokenizer is not None and not any(name.startswith("tokenizer") for name in copied):
        tokenizer.save_pretrained(out)  # the run's own, where the source has none
        tokenizer_saved = True
    return hf_config["architectures"][0], {"token_ids_from": source, **token_ids, "copied_from_source": copied,
                                           "run_tokenizer_saved": tokenizer_saved}
