"""Hugging Face import / export: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.

A Hugging Face decoder layer ``j`` is two of our layers: attention ``2j`` (with
``input_layernorm``) and MLP ``2j+1`` (with ``post_attention_layernorm``), so these models are
the pattern ``"*-" * num_hidden_layers`` (with ``|`` anywhere between layers for explicit
stages). ``HF_NAMES`` is the whole name mapping. Our fused weights are Hugging Face's separate
ones concatenated along dim 0 (q | k | v projections: ``qkv.weight``; gate | up:
``up_proj.weight``); otherwise shapes are the same on both sides (HF's ``[out, in]`` linear
convention), only the vocab padding for TP differs and it is never exported (``full_state``
is unpadded).

Model-specific flags, as Hugging Face defines them:

    llama  attention_bias -> q, k, v and o_proj biases; mlp_bias -> gate/up/down biases
    qwen2  q, k, v biases always, no o_proj bias
    qwen3  attention_bias -> q, k, v and o_proj biases; QK-norm always

Checkpoints are read lazily with safetensors: each rank reads only its own slice of each
tensor its stage needs (``get_slice``, through the parameter's placement:
``mimo.parallel.placement.read_local``; a fused weight part by part). Every name and shape is
checked first, on every rank alike, so a misfit checkpoint fails with one ``MimoError``
naming the first bad tensor.
``transformers`` is imported only by the functions that build Hugging Face objects.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Iterable, Mapping

import torch

from mimo.core.errors import MimoError
from mimo.llm.config import HybridArch, RopeScaling
from mimo.llm.model import LLMStage
from mimo.parallel.placement import ParamPlacement, read_local

log = logging.getLogger(__name__)

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# (our name, which part of it, Hugging Face name, present when), in HF's state_dict order —
# {a}: our attention layer, {m}: our MLP layer, {j}: the Hugging Face decoder layer. A fused
# weight of ours is its parts (0, 1, ...) concatenated along dim 0.
_always = lambda a: True  # noqa: E731
HF_NAMES: tuple[tuple[str, int, str, Callable[[HybridArch], bool]], ...] = (
    ("embed.weight", 0, "model.embed_tokens.weight", _always),
    ("layers.{a}.qkv.weight", 0, "model.layers.{j}.self_attn.q_proj.weight", _always),
    ("layers.{a}.qkv.bias", 0, "model.layers.{j}.self_attn.q_proj.bias", lambda a: a.qkv_bias),
    ("layers.{a}.qkv.weight", 1, "model.layers.{j}.self_attn.k_proj.weight", _always),
    ("layers.{a}.qkv.bias", 1, "model.layers.{j}.self_attn.k_proj.bias", lambda a: a.qkv_bias),
    ("layers.{a}.qkv.weight", 2, "model.layers.{j}.self_attn.v_proj.weight", _always),
    ("layers.{a}.qkv.bias", 2, "model.layers.{j}.self_attn.v_proj.bias", lambda a: a.qkv_bias),
    ("layers.{a}.o_proj.weight", 0, "model.layers.{j}.self_attn.o_proj.weight", _always),
    ("layers.{a}.o_proj.bias", 0, "model.layers.{j}.self_attn.o_proj.bias", lambda a: a.o_bias),
    ("layers.{a}.q_norm.weight", 0, "model.layers.{j}.self_attn.q_norm.weight", lambda a: a.qk_norm),
    ("layers.{a}.k_norm.weight", 0, "model.layers.{j}.self_attn.k_norm.weight", lambda a: a.qk_norm),
    ("layers.{m}.up_proj.weight", 0, "model.layers.{j}.mlp.gate_proj.weight", _always),
    ("layers.{m}.up_proj.bias", 0, "model.layers.{j}.mlp.gate_proj.bias", lambda a: a.mlp_bias),
    ("layers.{m}.up_proj.weight", 1, "model.layers.{j}.mlp.up_proj.weight", _always),
    ("layers.{m}.up_proj.bias", 1, "model.layers.{j}.mlp.up_proj.bias", lambda a: a.mlp_bias),
    ("layers.{m}.down_proj.weight", 0, "model.layers.{j}.mlp.down_proj.weight", _always),
    ("layers.{m}.down_proj.bias", 0, "model.layers.{j}.mlp.down_proj.bias", lambda a: a.mlp_bias),
    ("layers.{a}.norm.weight", 0, "model.layers.{j}.input_layernorm.weight", _always),
    ("layers.{m}.norm.weight", 0, "model.layers.{j}.post_attention_layernorm.weight", _always),
    ("norm.weight", 0, "model.norm.weight", _always),
    ("head.weight", 0, "lm_head.weight", lambda a: not a.tie_embeddings),
)
TIED_HEAD = "lm_head.weight"  # in HF's state_dict() of a tied model, the embedding again
IGNORED = (".rotary_emb.inv_freq",)  # buffers some older checkpoints carry


# ---------------------------------------------------------------- config


def hf_decoder_layers(arch: HybridArch) -> int:
    """Number of HF decoder layers ``arch`` corresponds to; MimoError unless it is ``*-`` pairs."""
    kinds = [layer.kind for layer in arch.layer_pattern().layers]
    pairs = len(kinds) // 2
    if len(kinds) % 2 or kinds != ["attention", "mlp"] * pairs:
        raise MimoError(
            f"Hugging Face Llama / Qwen models are the pattern '*-' repeated (one attention and one "
            f"MLP layer per decoder layer); the pattern {arch.pattern!r} is not"
        )
    if arch.mlp_act != "swiglu":
        raise MimoError(f"Hugging Face Llama / Qwen MLPs are SwiGLU; arch.mlp_act is {arch.mlp_act!r}")
    return pairs


Rename = Callable[[str], str]  # a Hugging Face causal-LM name -> its name inside a larger model (LLaVA)


def _same(name: str) -> str:
    return name


def hf_tensor_map(arch: HybridArch, rename: Rename = _same) -> dict[str, tuple[str, int]]:
    """Every Hugging Face tensor of ``arch`` -> (our canonical parameter name, which part of it),
    in Hugging Face's own order (``rename``: where the causal LM sits inside a larger checkpoint)."""
    out = {}
    for j in range(hf_decoder_layers(arch)):
        for ours, part, theirs, present in HF_NAMES:
            if present(arch) and ("{" in ours or j == 0):
                out[theirs.format(j=j)] = (ours.format(a=2 * j, m=2 * j + 1), part)
    # keep HF's own order: embedding, layers, final norm, head
    first = {"model.embed_tokens.weight": out.pop("model.embed_tokens.weight")}
    last = {k: out.pop(k) for k in ("model.norm.weight", "lm_head.weight") if k in out}
    return {rename(k): v for k, v in {**first, **out, **last}.items()}


def hf_name_map(arch: HybridArch, rename: Rename = _same) -> dict[str, tuple[str, ...]]:
    """Our canonical parameter name -> the Hugging Face tensors it is made of, in part order
    (one, or the parts a fused weight concatenates along dim 0), for every parameter of ``arch``."""
    parts: dict[str, dict[int, str]] = {}
    for theirs, (ours, part) in hf_tensor_map(arch, rename).items():
        parts.setdefault(ours, {})[part] = theirs
    return {ours: tuple(by_part[i] for i in sorted(by_part)) for ours, by_part in parts.items()}


def _rope_from_hf(cfg: Mapping) -> tuple[float, RopeScaling | None]:
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    scaling = {**legacy, **params}
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3", float(scaling["factor"]), float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]),
        )
    raise MimoError(f"RoPE type {rope_type!r} is not supported (supported: default, linear, llama3)")


def arch_from_hf_config(cfg: Mapping, pattern_stages: Iterable[int] | None = None) -> HybridArch:
    """Our ``HybridArch`` for a Hugging Face ``config.json`` (a dict).

    ``pattern_stages``: decoder layers per explicit pipeline stage (writes ``|`` into the
    pattern); by default the pattern has no ``|`` and stages are balanced automatically.
    """
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise MimoError(f"Hugging Face model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise MimoError(f"{model_type}: hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
    if cfg.get("use_sliding_window"):
        raise MimoError(f"{model_type}: sliding-window attention (use_sliding_window) is not supported")
    layers = int(cfg["num_hidden_layers"])
    if pattern_stages is None:
        pattern = "*-" * layers
    else:
        sizes = list(pattern_stages)
        if sum(sizes) != layers:
            raise MimoError(f"stage sizes {sizes} do not add up to num_hidden_layers={layers}")
        pattern = "|".join("*-" * n for n in sizes)
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope_from_hf(cfg)
    attention_bias = bool(cfg.get("attention_bias", False))
    qkv_bias, o_bias = (True, False) if model_type == "qwen2" else (attention_bias, attention_bias)
    return HybridArch(
        pattern=pattern,
        hidden=int(cfg["hidden_size"]),
        heads=heads,
        vocab=int(cfg["vocab_size"]),
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        ffn=int(cfg["intermediate_size"]),
        mlp_act="swiglu",
        mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
        qk_norm=model_type == "qwen3",
        attention_bias=attention_bias,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
        init_std=float(cfg.get("initializer_range", 0.02)),
    )


def hf_config_from_arch(arch: HybridArch, model_type: str) -> dict:
    """A ``config.json`` dict for ``arch`` as a Hugging Face ``model_type`` (for export)."""
    if model_type not in SUPPORTED:
        raise MimoError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    layers = hf_decoder_layers(arch)
    if model_type == "qwen2" and (not arch.qkv_bias or arch.o_bias):
        raise MimoError("qwen2 has q/k/v biases and no o_proj bias; set qkv_bias: true, o_bias: false")
    if model_type != "qwen2" and arch.qkv_bias != arch.o_bias:
        raise MimoError(f"{model_type} has one attention_bias flag for q/k/v and o_proj; qkv_bias and o_bias differ")
    if arch.qk_norm != (model_type == "qwen3"):
        raise MimoError(f"QK-norm is {'required' if model_type == 'qwen3' else 'not available'} in {model_type}")
    if arch.mlp_bias and model_type != "llama":
        raise MimoError(f"{model_type} has no MLP biases")
    rope: dict = {"rope_theta": arch.rope_theta, "rope_type": "default"}
    if arch.rope_scaling is not None:
        s = arch.rope_scaling
        rope.update(rope_type=s.type, factor=s.factor)
        if s.type == "llama3":
            rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                        original_max_position_embeddings=s.original_max_position_embeddings)
    cfg = {
        "model_type": model_type, "architectures": [SUPPORTED[model_type]],
        "vocab_size": arch.vocab, "hidden_size": arch.hidden, "intermediate_size": arch.ffn,
        "num_hidden_layers": layers, "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads,
        "head_dim": arch.head_dim, "hidden_act": "silu", "max_position_embeddings": arch.max_seq_len,
        "rms_norm_eps": arch.norm_eps, "rope_parameters": rope, "tie_word_embeddings": arch.tie_embeddings,
        "initializer_range": arch.init_std,
    }
    if model_type != "qwen2":
        cfg["attention_bias"] = bool(arch.o_bias)
    if model_type == "llama":
        cfg["mlp_bias"] = arch.mlp_bias
    return cfg


# ---------------------------------------------------------------- checkpoints


class HFCheckpoint:
    """A Hugging Face checkpoint directory: ``config.json`` plus ``*.safetensors`` (read lazily)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise MimoError(f"{path!r} is not a Hugging Face checkpoint directory: no config.json")
        with open(config_file) as f:
            self.config = json.load(f)
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise MimoError(f"{path!r} has no *.safetensors weights (only safetensors checkpoints are read)")
        self._handles = {}
        self._file_of: dict[str, str] = {}
        for name in files:
            handle = safe_open(os.path.join(path, name), framework="pt")
            self._handles[name] = handle
            for key in handle.keys():
                self._file_of[key] = name

    def keys(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)

    def slice(self, name: str):
        """The tensor, lazily: index it with a tuple of slices to read only that part."""
        return self._handles[self._file_of[name]].get_slice(name)


def full_placements(arch: HybridArch) -> dict[str, ParamPlacement]:
    """The placement (full shape, fused parts) of every parameter of the one-stage model, by
    canonical name (built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        stage = LLMStage(arch)
    return {name: info.placement for name, info in stage.param_table().items()}


def full_shapes(arch: HybridArch) -> dict[str, tuple[int, ...]]:
    """Full shape of every parameter of the one-stage model."""
    return {name: pl.full_shape for name, pl in full_placements(arch).items()}


def _part_sizes(name: str, placement: ParamPlacement, n: int) -> tuple[int, ...]:
    """Sizes along dim 0 of the ``n`` Hugging Face tensors that make our parameter ``name``."""
    if n == 1:
        return (placement.full_shape[0],)
    if len(placement.parts) != n or {d for _, d in placement.shards} != {0}:
        raise MimoError(f"internal: {name!r} ({placement}) is not {n} parts fused along dim 0")
    return placement.parts


def _expected_hf_tensors(arch: HybridArch, rename: Rename) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every Hugging Face tensor -> (what it is of ours, for messages; the shape it must have)."""
    placements, names = full_placements(arch), hf_name_map(arch, rename)
    out = {}
    for theirs, (ours, part) in hf_tensor_map(arch, rename).items():
        pl, n = placements[ours], len(names[ours])
        sizes = _part_sizes(ours, pl, n)
        what = repr(ours)
        if n > 1:
            lo = sum(sizes[:part])
            what += f" (rows {lo}:{lo + sizes[part]}, part {part + 1} of {n})"
        out[theirs] = (what, (sizes[part], *pl.full_shape[1:]))
    return out


def check_hf_tensors(arch: HybridArch, shapes: Mapping[str, tuple[int, ...]], source: str, rename: Rename = _same) -> None:
    """MimoError naming the first missing, misfit or unexpected tensor of a checkpoint."""
    tied_head = rename(TIED_HEAD)
    want = _expected_hf_tensors(arch, rename)
    for theirs, (ours, need) in want.items():
        if theirs not in shapes:
            raise MimoError(f"{source}: no tensor {theirs!r} (the model's {ours}, shape {need})")
        if tuple(shapes[theirs]) != need:
            raise MimoError(
                f"{source}: tensor {theirs!r} has shape {tuple(shapes[theirs])}, but the model's {ours} "
                f"needs {need}"
            )
    used = set(want) | ({tied_head} if arch.tie_embeddings else set())
    natural = lambda n: [int(p) if p.isdigit() else p for p in n.split(".")]  # noqa: E731  layer 2 before 10
    extra = sorted((n for n in shapes if n not in used and not n.endswith(IGNORED)), key=natural)
    if extra:
        raise MimoError(
            f"{source}: tensor {extra[0]!r} (shape {tuple(shapes[extra[0]])}) has no place in the model"
            f"{' (the arch ties embeddings)' if extra[0] == tied_head else ''}; {len(extra)} unused in all"
        )


def _concat_reader(sources: list, sizes: tuple[int, ...]) -> Callable[[tuple[slice, ...]], torch.Tensor]:
    """``read(index)`` of the concatenation of ``sources`` along dim 0 (each indexable by a tuple
    of slices: a tensor, or a safetensors slice), reading from each only the rows ``index`` covers."""
    if len(sources) == 1:
        return lambda index: sources[0][index]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def read(index: tuple[slice, ...]) -> torch.Tensor:
        rows, rest = index[0], tuple(index[1:])
        pieces = []
        for src, start, size in zip(sources, starts, sizes):
            lo, hi = max(rows.start, start), min(rows.stop, start + size)
            if hi > lo:
                pieces.append(src[(slice(lo - start, hi - start), *rest)])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # load time, not a forward

    return read


def import_hf_state_(stage: LLMStage, get: Callable[[str], object],
                     shapes: Mapping[str, tuple[int, ...]], source: str = "checkpoint", rename: Rename = _same) -> None:
    """Load Hugging Face tensors into this rank's stage: ``get(name)`` is indexable by a tuple
    of slices (a full tensor, or a safetensors ``get_slice``: then only this rank's slices are
    read), ``shapes`` gives every tensor's shape."""
    check_hf_tensors(stage.arch, shapes, source, rename)
    names = hf_name_map(stage.arch, rename)
    for ours, info in stage.param_table().items():
        theirs = names[ours]
        sizes = tuple(shapes[t][0] for t in theirs)
        read = _concat_reader([get(t) for t in theirs], sizes)
        local = read_local(read, info.placement, info.sizes, info.coords, info.param.dtype, info.param.device)
        with torch.no_grad():
            info.param.copy_(local)


def from_hf_state(state: Mapping[str, torch.Tensor], arch: HybridArch, rename: Rename = _same) -> dict[str, torch.Tensor]:
    """Our full canonical state from a Hugging Face state dict (fused weights concatenated);
    check it first with ``check_hf_tensors``."""
    return {ours: state[theirs[0]] if len(theirs) == 1 else torch.cat([state[t] for t in theirs])
            for ours, theirs in hf_name_map(arch, rename).items()}


# Where the causal LM sits inside a LLaVA checkpoint: (what replaces its "model.", its head key),
# in transformers' current names and in those of published llava-1.5 checkpoints
LLAVA_LM = {"current": ("model.language_model.", "lm_head.weight"),
            "legacy": ("language_model.model.", "language_model.lm_head.weight")}


def llava_lm_key(name: str, body: str, head: str) -> str:
    """A causal-LM key -> its key inside a LLaVA checkpoint (``body``, ``head``: a ``LLAVA_LM`` pair)."""
    if name == TIED_HEAD:
        return head
    if not name.startswith("model."):
        raise ValueError(f"not a causal-LM key: {name!r}")
    return body + name[len("model."):]


def normalised_llava_config(config: Mapping) -> dict:
    """A LLaVA ``config.json`` with Hugging Face's defaults filled in (llava-1.5 configs leave
    most of the Llama sizes to them)."""
    import transformers

    if config.get("model_type") != "llava":
        raise MimoError(f"model_type {config.get('model_type')!r} is not 'llava' (a LlavaForConditionalGeneration config)")
    try:
        return transformers.LlavaConfig(**{k: v for k, v in config.items() if k != "model_type"}).to_dict()
    except (TypeError, ValueError) as e:
        raise MimoError(f"the LLaVA config is not valid for transformers' LlavaConfig: {e}") from None


def llava_text_config(config: Mapping) -> dict:
    """The language model's config inside a LLaVA ``config.json`` (defaults filled in), with
    LLaVA's tie flag (top level, or the text config's in older configs)."""
    whole = normalised_llava_config(config)
    return {**whole["text_config"], "tie_word_embeddings": bool(whole["tie_word_embeddings"])}


def language_model_of(ckpt: HFCheckpoint) -> tuple[dict, Rename, list[str]]:
    """(causal-LM config, causal-LM name -> checkpoint name, the checkpoint's language-model
    keys) of a causal-LM checkpoint, or of the language model inside a LLaVA one (either naming)."""
    config, keys = ckpt.config, ckpt.keys()
    if config.get("model_type") != "llava":
        return config, _same, keys
    config = llava_text_config(config)
    found = [pair for pair in LLAVA_LM.values() if llava_lm_key("model.embed_tokens.weight", *pair) in keys]
    if not found:
        raise MimoError(f"{ckpt.path!r}: a LLaVA config, but no language model embedding "
                        f"({' or '.join(llava_lm_key('model.embed_tokens.weight', *p) for p in LLAVA_LM.values())})")
    body, head = found[0]
    return config, lambda name: llava_lm_key(name, body, head), [k for k in keys if k.startswith(body) or k == head]


def load_hf_checkpoint(stage: LLMStage, path: str) -> None:
    """``init: {hf: DIR}``: load a Hugging Face checkpoint directory into this rank's stage: a
    causal LM, or the language model of a LLaVA checkpoint (either key naming)."""
    ckpt = HFCheckpoint(path)
    config, rename, keys = language_model_of(ckpt)
    theirs = arch_from_hf_config(config)
    for field in ("rope_theta", "rope_scaling", "norm_eps", "tie_embeddings", "qk_norm"):
        if getattr(theirs, field) != getattr(stage.arch, field):
            log.warning("%s: arch.%s=%r differs from the checkpoint's config.json (%r)",
                        path, field, getattr(stage.arch, field), getattr(theirs, field))
    shapes = {name: ckpt.shape(name) for name in keys}
    import_hf_state_(stage, ckpt.slice, shapes, path, rename)


def export_hf_state(full_state: Mapping[str, torch.Tensor], arch: HybridArch, rename: Rename = _same) -> dict[str, torch.Tensor]:
    """Hugging Face state dict (as ``model.state_dict()`` has it) from our full canonical state
    (all stages merged; vocab padding is already stripped by ``full_state``)."""
    placements, names = full_placements(arch), hf_name_map(arch, rename)
    out = {}
    for theirs, (ours, part) in hf_tensor_map(arch, rename).items():
        if ours not in full_state:
            raise MimoError(f"export: the state has no {ours!r} (merge the full state of every stage)")
        t = full_state[ours]
        out[theirs] = t if len(names[ours]) == 1 else t.split(_part_sizes(ours, placements[ours], len(names[ours])))[part]
    if arch.tie_embeddings:
        out[rename(TIED_HEAD)] = full_state["embed.weight"]
    return out


def save_hf_checkpoint(path: str, hf_state: Mapping[str, torch.Tensor], config: Mapping,
                       max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the safetensors weights (``write_safetensors``; a tied head is
    not stored, as HF does)."""
    os.makedirs(path, exist_ok=True)
    tied = bool(config.get("tie_word_embeddings", False))
    write_safetensors(path, {k: v for k, v in hf_state.items() if not (tied and k == TIED_HEAD)}, max_shard_bytes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config), f, indent=2)


def write_safetensors(path: str, tensors: Mapping[str, torch.Tensor], max_shard_bytes: int | None = None) -> list[str]:
    """``model.safetensors``, or (when the tensors exceed ``max_shard_bytes``) Hugging Face's
    sharded layout: ``model-0000i-of-0000N.safetensors`` in key order, each at most
    ``max_shard_bytes`` unless one tensor is larger, and ``model.safetensors.index.json``.
    Returns the files written."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return [*names, "model.safetensors.index.json"]
