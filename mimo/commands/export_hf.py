"""``mimo export-hf CKPT --out DIR [--llm-only]``: a mimo checkpoint as a Hugging Face model directory.

The checkpoint (a ``step-N`` folder; a checkpoint folder or a run directory: its latest
complete one) is read in this one process, no process group: every model file's tensors are
placed into full tensors by their own placement records (``ParamPlacement.runs`` of the
stored shards, sizes and coordinates, so vocab padding and fused parts come out right at any
layout), and every element of every parameter must be written exactly once. The architecture
is the config the checkpoint records (``meta.json``).

The full tensors are then mapped by ``mimo.commands.hf_llava`` (``import_llava_state`` /
``export_llava_state`` / ``save_llava``): a ``LlavaForConditionalGeneration`` config is
built from the run's modules (a CLIP or SigLIP tower, a Llama / Qwen2 / Qwen3 language model,
the mlp2x_gelu projector), its state dict's names and shapes taken from transformers' own
model built on the meta device, and the trained tensors written into it. What mimo never
builds (vision blocks after the feature layer, the final vision norm, SigLIP's pooling head:
none of them affects LLaVA's output) comes from the Hugging Face tower the run started from,
when its config records one (``modules.<vision>.init.hf``, or ``train.init_from`` back to an
``import-hf-llava`` checkpoint); else they are written as identity blocks (zero weights, unit
norm scales). Beside the weights: the run's tokenizer (with its chat template) and a
``LlavaProcessor`` whose image processor is the run's preprocessing (short side resized to the
image size, bicubic, centre crop, the run's mean / std).

A run whose encoder is ``kind: qwen3_vl`` is written as Hugging Face's Qwen3-VL
(``Qwen3VLForConditionalGeneration`` / ``Qwen3VLMoeForConditionalGeneration``) or, when its LLM is
Qwen3.5's (Gated DeltaNet, no deepstack), Qwen3.5 (``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration``) by ``mimo.commands.hf_qwen3_vl.export_qwen3_vl``: its token
ids and tokenizer / processor files from the directory the run imported from. A ``kind: kimi_k25``
encoder beside a DeepSeek-V3 LLM is written as Kimi-K2.5 (``Kimi_K25ForConditionalGeneration``) alike.

``--llm-only``: the language model alone as its ``*ForCausalLM`` (``mimo.llm.hf``) and the tokenizer
(Qwen3.5's: ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``; Qwen3-VL's has none).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections import defaultdict
from contextlib import ExitStack
from typing import Mapping

import torch

from mimo.core.errors import CheckpointError, MimoError

log = logging.getLogger(__name__)

__all__ = ["find_checkpoint", "gather_checkpoint", "checkpoint_config", "image_token", "llava_hf_config", "llava_state", "export_hf"]

_MODEL_FILE = re.compile(r"^(?P<module>.+)-rank(?P<rank>\d{5})\.model\.safetensors$")
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # Hugging Face's default max_shard_size ("5GB")
_ACTS_HF = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_tanh": "gelu_pytorch_tanh"}


# ---------------------------------------------------------------- reading the checkpoint


def find_checkpoint(path: str) -> str:
    """A ``step-N`` folder as is; a folder of them, or a run directory (its ``config.yaml``'s
    ``train.checkpoint.dir``, or its one sub-folder holding checkpoints): the latest complete one."""
    from mimo.training.checkpoint import META, complete_checkpoints, resolve_checkpoint

    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory (give a step-N checkpoint, a checkpoint folder or a run directory)")
    if os.path.isfile(os.path.join(path, META)) or complete_checkpoints(path):
        return resolve_checkpoint(path)
    candidates = []
    run_config = os.path.join(path, "config.yaml")
    if os.path.isfile(run_config):
        import yaml

        with open(run_config, encoding="utf-8") as f:
            ckpt_dir = ((yaml.safe_load(f) or {}).get("train") or {}).get("checkpoint", {}).get("dir")
        if ckpt_dir:
            candidates += [ckpt_dir, os.path.join(path, ckpt_dir), os.path.join(path, os.path.basename(os.path.normpath(ckpt_dir)))]
    candidates += sorted(os.path.join(path, d) for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    for candidate in dict.fromkeys(candidates):
        if complete_checkpoints(candidate):
            return resolve_checkpoint(candidate)
    raise CheckpointError(f"{path}: no complete checkpoint there or in its checkpoint folder (a step-NNNNNNNN folder with {META})")


def gather_checkpoint(path: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(meta, full tensors by module and layout-independent name) of the checkpoint at ``path``,
    from each model file's tensors and placement records; CheckpointError naming the file for a
    missing or unreadable file, and the tensor for one whose shards do not cover it exactly once."""
    from mimo.training.checkpoint import read_meta

    meta = read_meta(path)
    files = sorted(f for f in meta.get("files", []) if _MODEL_FILE.match(f))
    if not files:
        raise CheckpointError(f"{path}: meta.json lists no model files (*-rankNNNNN.model.safetensors)")
    with ExitStack() as stack:
        return meta, _full_tensors(path, files, stack)


def _full_tensors(path: str, files: list[str], stack: ExitStack) -> dict[str, dict[str, torch.Tensor]]:
    from mimo.parallel.placement import ParamPlacement
    from mimo.training.checkpoint import open_tensors

    handles, shards = {}, defaultdict(list)  # (module, name) -> [(file, record)]
    for file in files:
        full = os.path.join(path, file)
        handles[file] = handle = stack.enter_context(open_tensors(full))  # a missing or damaged file: named
        records = json.loads(handle.metadata().get("placements", "{}"))
        module = _MODEL_FILE.match(file)["module"]
        for name in handle.keys():
            if name not in records:
                raise CheckpointError(f"{full}: tensor {name!r} has no placement record")
            shards[module, name].append((file, records[name]))
    out: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for (module, name), pieces in shards.items():
        full_t = covered = None
        for file, rec in pieces:
            placement = ParamPlacement.from_record(rec)
            local = handles[file].get_tensor(name)
            where = f"{os.path.join(path, file)}: {module} {name!r}"
            if list(local.shape) != list(rec["local_shape"]):
                raise CheckpointError(f"{where} has shape {tuple(local.shape)}, its placement record says {tuple(rec['local_shape'])}")
            if full_t is None:
                full_t = torch.empty(placement.full_shape, dtype=local.dtype)
                covered = torch.zeros(placement.full_shape, dtype=torch.uint8)
            elif placement.full_shape != tuple(full_t.shape):
                raise CheckpointError(f"{where}: full shape {placement.full_shape} differs from another shard's {tuple(full_t.shape)}")
            for full_index, local_index in placement.runs(rec["sizes"], rec["coords"]):
                full_t[full_index] = local[local_index]
                covered[full_index] += 1
        if not bool((covered == 1).all()):
            how = "twice" if bool((covered > 1).any()) else "by no shard"
            raise CheckpointError(f"{path}: {module} {name!r}: some elements are written {how} "
                                  f"(files {sorted(f for f, _ in pieces)})")
        out[module][name] = full_t
    return dict(out)


def checkpoint_config(path: str, meta: dict):
    """The ``MimoConfig`` the checkpoint was written with (its ``meta.json``)."""
    from mimo.compose.config import config_from_dict

    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{path}: meta.json records no config")
    return config_from_dict(meta["config"], source=os.path.join(path, "meta.json"))


# ---------------------------------------------------------------- the Hugging Face side


def _text_model_type(arch) -> str:
    """The Hugging Face family of an LLM arch (``mimo.llm.hf.hf_model_type``: the one whose config fits)."""
    from mimo.llm.hf import hf_model_type

    return hf_model_type(arch)


def vision_hf_config(arch) -> dict:
    """A CLIP / SigLIP vision config for a ``VitArch`` (the inverse of ``hf_arch``)."""
    from mimo.encoders.hf_import import hf_arch
    from mimo.encoders.vit import patch_bias

    if arch.class_token and arch.pre_norm and not patch_bias(arch):
        family, model_type = "clip", "clip_vision_model"
    elif not arch.class_token and not arch.pre_norm:
        family, model_type = "siglip", "siglip_vision_model"
    else:
        raise MimoError(f"the vision tower {arch} is neither a CLIP tower (class token and pre-norm) nor a SigLIP "
                        f"tower (neither): Hugging Face's LLaVA has no place for it")
    cfg = {"model_type": model_type, "hidden_size": arch.hidden, "intermediate_size": arch.mlp,
           "num_hidden_layers": arch.layers, "num_attention_heads": arch.heads, "num_channels": arch.channels,
           "image_size": arch.image_size, "patch_size": arch.patch, "hidden_act": _ACTS_HF[arch.act],
           "layer_norm_eps": arch.norm_eps}
    if hf_arch(family, cfg) != arch:  # every field of the arch must survive the round trip
        raise MimoError(f"internal: the vision config {cfg} does not describe {arch}")
    return cfg


def image_token(tokenizer, placeholder: str, vocab: int) -> tuple[int, bool]:
    """(id, added) of the token Hugging Face's LLaVA marks image positions with: the
    placeholder's own token, or (a tokenizer without one: mimo never embeds placeholder ids, its
    image rows take those positions) the placeholder added to the exported tokenizer as a new
    special token, whose id must fall inside the LLM's vocab."""
    ids = tokenizer(placeholder, add_special_tokens=False)["input_ids"]
    if len(ids) == 1 and ids[0] != tokenizer.unk_token_id:
        return int(ids[0]), False
    tokenizer.add_tokens([placeholder], special_tokens=True)
    new = int(tokenizer.convert_tokens_to_ids(placeholder))
    if new >= vocab:
        raise MimoError(f"the tokenizer has no single token for the placeholder {placeholder!r} (it gives ids {ids}), and one "
                        f"added would get id {new}, outside the LLM's vocab ({vocab}); Hugging Face's LLaVA marks image "
                        f"positions with one token id: train with a tokenizer that has {placeholder!r} as a special token")
    return new, True


def llava_hf_config(config, encoder: str, image_token_id: int, dtype: torch.dtype) -> dict:
    """The ``LlavaConfig`` (as a ``config.json`` dict) of the run's encoder + LLM."""
    import transformers

    from mimo.llm.hf import hf_config_from_arch

    enc, arch = config.encoders[encoder], config.llm.arch
    if enc.projector.kind != "mlp2x_gelu":
        raise MimoError(f"modules.{encoder}.projector.kind is {enc.projector.kind!r}; Hugging Face's LLaVA projector is "
                        f"mlp2x_gelu (use --llm-only to export the language model alone)")
    if not isinstance(enc.feature_layer, int):
        raise MimoError(f"modules.{encoder}.feature_layer is {enc.feature_layer!r}: LLaVA feeds hidden_states[L] (an int), "
                        f"never the final norm (use --llm-only to export the language model alone)")
    if image_token_id >= arch.vocab:
        raise MimoError(f"the image token id {image_token_id} is outside the LLM's vocab ({arch.vocab})")
    text = hf_config_from_arch(arch, _text_model_type(arch))
    cfg = transformers.LlavaConfig(
        vision_config=vision_hf_config(enc.arch), text_config=text, image_token_id=image_token_id,
        vision_feature_layer=enc.feature_layer,
        vision_feature_select_strategy="default" if enc.arch.class_token and enc.drop_class_token else "full",
        projector_hidden_act="gelu", multimodal_projector_bias=True, tie_word_embeddings=arch.tie_embeddings,
    ).to_dict()
    cfg["architectures"] = ["LlavaForConditionalGeneration"]
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    return cfg


def _template_state(hf_config: dict) -> dict[str, torch.Tensor]:
    """Names, order and shapes of ``LlavaForConditionalGeneration``'s state dict for the
    config, from the model built on the meta device (nothing allocated)."""
    import transformers

    cfg = transformers.LlavaConfig(**{k: v for k, v in hf_config.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(cfg)
    return model.state_dict()


def _identity_fill(key: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of a block no mimo model computes: unit norm scales, every other weight zero
    (a pre-norm residual block of zero weights is the identity)."""
    parts = key.split(".")
    is_norm_scale = len(parts) >= 2 and "norm" in parts[-2] and parts[-1] == "weight"
    return (torch.ones if is_norm_scale else torch.zeros)(tuple(shape), dtype=dtype)


def llava_state(config, full: Mapping[str, Mapping[str, torch.Tensor]], hf_config: dict, encoder: str,
                source: str | None) -> tuple[dict[str, torch.Tensor], str]:
    """The LLaVA state dict of the gathered tensors, and where the tensors mimo does not hold came from."""
    from mimo.commands.hf_llava import check_fits, export_llava_state, import_llava_state

    template = _template_state(hf_config)
    w = import_llava_state(template, hf_config, "the exported LLaVA")
    check_fits(config, w, encoder)  # the config built from the run describes the run's modules
    trained = full[encoder]
    tower = {n[len("tower."):]: t for n, t in trained.items() if n.startswith("tower.")}
    projector = {n[len("projector."):]: t for n, t in trained.items() if n.startswith("projector.")}
    dtype = next(iter(trained.values())).dtype
    unused = [n for n in w.vision.tower if n not in tower]
    filled_from = "none needed"
    extras: dict[str, torch.Tensor] = {}
    if unused or w.vision.extras:
        src = None
        if source is not None and os.path.isdir(source):
            from mimo.encoders.hf_import import import_hf

            src = import_hf(source, config.encoders[encoder].arch)  # checks the tower's architecture
        elif source is not None:
            log.warning("%s (the tower's source) is gone: the vision blocks mimo does not run are written as identity blocks", source)
        if src is not None:
            from mimo.encoders.weights import materialize

            ours, theirs = w.vision.meta["prefix"], src.meta["prefix"]
            lacking = [n for n in unused if n not in src.tower] + [k for k in w.vision.extras if theirs + k[len(ours):] not in src.extras]
            filled_from = source + (f" ({len(lacking)} it lacks as identity)" if lacking else "")
            tower.update({n: materialize(src.tower[n]).to(dtype) if n in src.tower else _identity_fill(n, w.vision.tower[n].shape, dtype)
                          for n in unused})
            for key, t in w.vision.extras.items():
                their_key = theirs + key[len(ours):]
                extras[key] = materialize(src.extras[their_key]).to(dtype) if their_key in src.extras else _identity_fill(key, t.shape, dtype)
        else:
            filled_from = "identity blocks"
            tower.update({n: _identity_fill(n, w.vision.tower[n].shape, dtype) for n in unused})
            extras = {k: _identity_fill(k, t.shape, dtype) for k, t in w.vision.extras.items()}
    # written as trained (the template's dtypes are the meta model's)
    w.vision = w.vision.replace(extras=extras, dtypes=dict.fromkeys(w.vision.dtypes, dtype))
    w.projector = w.projector.replace(dtypes=dict.fromkeys(w.projector.dtypes, dtype))
    w.dtypes = dict.fromkeys(w.dtypes, next(iter(full[config.llm_name].values())).dtype)
    return export_llava_state(w, tower, projector, full[config.llm_name]), filled_from


def image_processor(config, encoder: str):
    """transformers' ``CLIPImageProcessor`` doing the run's preprocessing (``mimo.data.images.preprocess``)."""
    from transformers import CLIPImageProcessor

    from mimo.compose.inputs import image_spec

    spec = image_spec(config.encoders[encoder])
    return CLIPImageProcessor(
        do_resize=True, size={"shortest_edge": spec.size}, resample=3, do_center_crop=True,
        crop_size={"height": spec.size, "width": spec.size}, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, image_mean=list(spec.mean), image_std=list(spec.std), do_convert_rgb=True,
    )


# ---------------------------------------------------------------- the command


def _only_encoder(config) -> str:
    names = list(config.encoders)
    if len(names) != 1:
        raise MimoError(f"the run has encoders {names}; Hugging Face's LLaVA has one vision tower "
                        f"(use --llm-only to export the language model alone)")
    return names[0]


def _with_base(path: str, config, full: dict, adapter: str | None, merge: bool) -> dict[str, tuple]:
    """A LoRA checkpoint's modules completed with their base (``adapted_base``) and, with
    ``merge``, the adapters folded in; otherwise the adapters taken out of ``full`` and returned:
    module -> (its adapter sites, its full state with the adapters)."""
    from mimo.compose.model import adapted_base
    from mimo.parallel.lora import is_adapter_tensor, merge_adapters

    adapted = [name for name, m in config.modules.items() if m.lora is not None]
    if not adapted:
        if adapter or merge:
            raise MimoError(f"{path}: the run has no lora section: --adapter / --merge export a LoRA run's adapters")
        return {}
    if not (adapter or merge):
        raise MimoError(f"{path}: a LoRA checkpoint (modules {', '.join(adapted)} hold their adapters, not the frozen base): "
                        f"--adapter DIR writes the base to --out and the adapters as a PEFT adapter to DIR; --merge writes "
                        f"the adapters merged into the base")
    from mimo.training.checkpoint import holds_whole, resolve_checkpoint

    start_meta, start_full = {}, {}  # train.init_from: a module it holds whole took its base from it (load_checkpoint's start)
    if config.train.init_from:
        try:
            start_path = resolve_checkpoint(config.train.init_from)
        except CheckpointError as e:
            raise MimoError(f"{path}: the run's base weights came from train.init_from, which export-hf reads again: {e}") from e
        start_meta, start_full = gather_checkpoint(start_path)
    adapters = {}
    for name in adapted:
        base, sites = adapted_base(config, name)
        if holds_whole(start_meta, name) and name in start_full:
            base.update({n: t for n, t in start_full[name].items() if n in base})
        stored = full.get(name, {})
        absent = [f"{s.adapter}.lora_A" for s in sites if f"{s.adapter}.lora_A" not in stored]
        if absent:
            raise CheckpointError(f"{path}: modules.{name} has no adapter tensors {absent[:3]}")
        state = {**base, **stored}
        if merge:
            full[name] = merge_adapters(state, sites)
        else:
            full[name] = {n: t for n, t in state.items() if not is_adapter_tensor(n)}  # the base as trained
            adapters[name] = (sites, state)
    return adapters


def export_hf(checkpoint: str, out: str, llm_only: bool = False, max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES,
              adapter: str | None = None, merge: bool = False) -> dict:
    from mimo.commands.hf_llava import save_llava
    from mimo.data.text import load_tokenizer
    from mimo.llm.hf import export_hf_state, hf_config_from_arch, save_hf_checkpoint

    path = find_checkpoint(checkpoint)
    for flag, d in (("--out", out), ("--adapter", adapter)):
        if d is not None and os.path.exists(d) and (not os.path.isdir(d) or os.listdir(d)):
            raise MimoError(f"{flag} {d}: exists and is not an empty directory (choose a new one)")
    if adapter is not None and os.path.abspath(adapter) == os.path.abspath(out):
        raise MimoError("--adapter: a directory of its own, not --out (the base model goes there)")
    meta, full = gather_checkpoint(path)
    config = checkpoint_config(path, meta)
    adapters = _with_base(path, config, full, adapter, merge)
    llm = config.llm_name
    if llm not in full:
        raise CheckpointError(f"{path}: no tensors of the language model {llm!r}")
    tokenizer = load_tokenizer(config.data.tokenizer) if config.data.tokenizer else None
    tmp = out.rstrip(os.sep) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:  # nothing half-written is left behind: the directories are moved into place at the end
        arch = config.llm.arch
        dtype = next(iter(full[llm].values())).dtype
        if llm_only:
            text_type = _text_model_type(arch)
            if text_type in ("qwen3_vl_text", "qwen3_vl_moe_text"):
                raise MimoError(f"--llm-only: Hugging Face has no causal LM of Qwen3-VL's language model ({text_type}: M-RoPE, "
                                f"deepstack); export the whole model (without --llm-only)")
            hf_config = {**hf_config_from_arch(arch, text_type), "dtype": str(dtype).removeprefix("torch.")}
            save_hf_checkpoint(tmp, export_hf_state(full[llm], arch), hf_config, max_shard_bytes)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            architecture, filled_from, extra = hf_config["architectures"][0], None, {}
            adapters = {m: a for m, a in adapters.items() if m == llm}  # the language model alone: its adapters alone
        elif any(enc.native for enc in config.encoders.values()):  # a native tower: Hugging Face's Qwen3-VL, Kimi-K2.5, ...
            from mimo.commands.hf_qwen3_vl import export_qwen3_vl

            architecture, extra = export_qwen3_vl(tmp, path, meta, config, full, tokenizer, max_shard_bytes)
            filled_from = None
        else:
            if tokenizer is None:
                raise MimoError("the run has no data.tokenizer: a LLaVA directory needs one (its processor marks the image "
                                "positions with the tokenizer's image token); --llm-only exports the language model without it")
            from transformers import LlavaProcessor

            from mimo.training.checkpoint import weights_origin

            encoder = _only_encoder(config)
            enc = config.encoders[encoder]
            image_token_id, added = image_token(tokenizer, enc.placeholder, arch.vocab)
            if added:
                print(f"the tokenizer has no {enc.placeholder!r} token: added to the exported tokenizer as id {image_token_id}")
            hf_config = llava_hf_config(config, encoder, image_token_id, dtype)
            state, filled_from = llava_state(config, full, hf_config, encoder, weights_origin(meta, [encoder]))
            save_llava(tmp, state, hf_config, max_shard_bytes)
            processor = LlavaProcessor(
                image_processor=image_processor(config, encoder), tokenizer=tokenizer, patch_size=enc.arch.patch,
                vision_feature_select_strategy=hf_config["vision_feature_select_strategy"], chat_template=tokenizer.chat_template,
                image_token=enc.placeholder, num_additional_image_tokens=1 if enc.arch.class_token else 0,
            )
            processor.save_pretrained(tmp)
            processor.image_processor.save_pretrained(tmp)  # preprocessor_config.json too, for readers of the older layout
            architecture = "LlavaForConditionalGeneration"
            extra = {"unused_vision_tensors_from": filled_from, "image_token_id": image_token_id, "image_token_added": added}
        if adapters:
            from mimo.compose.peft import module_row_blocks, write_peft_adapter
            from mimo.encoders.hf_import import load_hf_state, read_config_json

            adapter_tmp = adapter.rstrip(os.sep) + ".tmp"
            shutil.rmtree(adapter_tmp, ignore_errors=True)
            candidates = {m: module_row_blocks(config.modules[m], m == llm) for m in adapters}
            extra["adapter"] = write_peft_adapter(adapter_tmp, out, {m: (sites, state, candidates[m])
                                                                     for m, (sites, state) in adapters.items()},
                                                  load_hf_state(tmp, lazy=True), read_config_json(tmp).get("model_type"))
            if os.path.isdir(adapter):
                os.rmdir(adapter)
            os.replace(adapter_tmp, adapter)
            extra["adapter"]["adapter"] = adapter
        elif merge:
            extra["merged"] = True
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if adapter is not None:
            shutil.rmtree(adapter.rstrip(os.sep) + ".tmp", ignore_errors=True)
        raise
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked above)
    os.replace(tmp, out)
    files = sorted(os.listdir(out))
    has_tokenizer = tokenizer is not None or any(f.startswith("tokenizer") for f in files)  # (Qwen3-VL: the source's)
    print(f"exported {path} (step {meta['step']}) as {architecture} to {out}: {len(files)} files"
          + ("" if has_tokenizer else "; no tokenizer (the run has no data.tokenizer)")
          + (f"; vision blocks mimo does not run: {filled_from}" if filled_from not in (None, "none needed") else ""))
    return {"ok": True, "command": "export-hf", "checkpoint": path, "step": meta["step"], "out": out,
            "architecture": architecture, "llm_only": llm_only, "files": files, "tokenizer": has_tokenizer, **extra}
