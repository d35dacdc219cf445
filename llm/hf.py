"""Hugging Face import / export: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM.

A Hugging Face decoder layer ``j`` is two of our layers: attention ``2j`` (with
``input_layernorm``) and MLP ``2j+1`` (with ``post_attention_layernorm``), so these models are
the pattern ``"*-" * num_hidden_layers`` (with ``|`` anywhere between layers for explicit
stages). ``HF_NAMES`` is the whole name mapping; shapes are the same on both sides (HF's
``[out, in]`` linear convention), only the vocab padding for TP differs and it is never
exported (``full_state`` is unpadded).

Model-specific flags, as Hugging Face defines them:

    llama  attention_bias -> q, k, v and o_proj biases; mlp_bias -> gate/up/down biases
    qwen2  q, k, v biases always, no o_proj bias
    qwen3  attention_bias -> q, k, v and o_proj biases; QK-norm always

Checkpoints are read lazily with safetensors (each rank reads only the tensors its stage
needs, whole, and keeps its TP slice). Every name and shape is checked first, on every rank
alike, so a misfit checkpoint fails with one ``MimoError`` naming the first bad tensor.
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

log = logging.getLogger(__name__)

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# (our name, Hugging Face name, present when) — {a}: our attention layer, {m}: our MLP layer,
# {j}: the Hugging Face decoder layer
HF_NAMES: tuple[tuple[str, str, Callable[[HybridArch], bool]], ...] = (  # in HF's state_dict order
    ("embed.weight", "model.embed_tokens.weight", lambda a: True),
    ("layers.{a}.qkv.q_weight", "model.layers.{j}.self_attn.q_proj.weight", lambda a: True),
    ("layers.{a}.qkv.q_bias", "model.layers.{j}.self_attn.q_proj.bias", lambda a: a.qkv_bias),
    ("layers.{a}.qkv.k_weight", "model.layers.{j}.self_attn.k_proj.weight", lambda a: True),
    ("layers.{a}.qkv.k_bias", "model.layers.{j}.self_attn.k_proj.bias", lambda a: a.qkv_bias),
    ("layers.{a}.qkv.v_weight", "model.layers.{j}.self_attn.v_proj.weight", lambda a: True),
    ("layers.{a}.qkv.v_bias", "model.layers.{j}.self_attn.v_proj.bias", lambda a: a.qkv_bias),
    ("layers.{a}.o_proj.weight", "model.layers.{j}.self_attn.o_proj.weight", lambda a: True),
    ("layers.{a}.o_proj.bias", "model.layers.{j}.self_attn.o_proj.bias", lambda a: a.o_bias),
    ("layers.{a}.q_norm.weight", "model.layers.{j}.self_attn.q_norm.weight", lambda a: a.qk_norm),
    ("layers.{a}.k_norm.weight", "model.layers.{j}.self_attn.k_norm.weight", lambda a: a.qk_norm),
    ("layers.{m}.up_proj.gate_weight", "model.layers.{j}.mlp.gate_proj.weight", lambda a: True),
    ("layers.{m}.up_proj.gate_bias", "model.layers.{j}.mlp.gate_proj.bias", lambda a: a.mlp_bias),
    ("layers.{m}.up_proj.up_weight", "model.layers.{j}.mlp.up_proj.weight", lambda a: True),
    ("layers.{m}.up_proj.up_bias", "model.layers.{j}.mlp.up_proj.bias", lambda a: a.mlp_bias),
    ("layers.{m}.down_proj.weight", "model.layers.{j}.mlp.down_proj.weight", lambda a: True),
    ("layers.{m}.down_proj.bias", "model.layers.{j}.mlp.down_proj.bias", lambda a: a.mlp_bias),
    ("layers.{a}.norm.weight", "model.layers.{j}.input_layernorm.weight", lambda a: True),
    ("layers.{m}.norm.weight", "model.layers.{j}.post_attention_layernorm.weight", lambda a: True),
    ("norm.weight", "model.norm.weight", lambda a: True),
    ("head.weight", "lm_head.weight", lambda a: not a.tie_embeddings),
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


def hf_name_map(arch: HybridArch, rename: Rename = _same) -> dict[str, str]:
    """Our canonical parameter name -> Hugging Face name, for every parameter of ``arch``
    (``rename``: where the causal LM sits inside a larger checkpoint)."""
    out = {}
    for j in range(hf_decoder_layers(arch)):
        for ours, theirs, present in HF_NAMES:
            if present(arch) and ("{" in ours or j == 0):
                out[ours.format(a=2 * j, m=2 * j + 1)] = theirs.format(j=j)
    # keep HF's own order: embedding, layers, final norm, head
    first = {"embed.weight": out.pop("embed.weight")}
    last = {k: out.pop(k) for k in ("norm.weight", "head.weight") if k in out}
    return {k: rename(v) for k, v in {**first, **out, **last}.items()}


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


def full_shapes(arch: HybridArch) -> dict[str, tuple[int, ...]]:
    """Full shape of every parameter of the one-stage model (built on the meta device)."""
    with torch.device("meta"):
        stage = LLMStage(arch)
    return {name: tuple(info.spec.full_shape) for name, info in stage.param_table().items()}


def check_hf_tensors(arch: HybridArch, shapes: Mapping[str, tuple[int, ...]], source: str, rename: Rename = _same) -> None:
    """MimoError naming the first missing, misfit or unexpected tensor of a checkpoint."""
    names = hf_name_map(arch, rename)
    tied_head = rename(TIED_HEAD)
    want = full_shapes(arch)
    for ours, theirs in names.items():
        if theirs not in shapes:
            raise MimoError(f"{source}: no tensor {theirs!r} (the model's {ours!r}, shape {want[ours]})")
        if tuple(shapes[theirs]) != want[ours]:
            raise MimoError(
                f"{source}: tensor {theirs!r} has shape {tuple(shapes[theirs])}, but the model's {ours!r} "
                f"needs {want[ours]}"
            )
    used = set(names.values()) | ({tied_head} if arch.tie_embeddings else set())
    natural = lambda n: [int(p) if p.isdigit() else p for p in n.split(".")]  # noqa: E731  layer 2 before 10
    extra = sorted((n for n in shapes if n not in used and not n.endswith(IGNORED)), key=natural)
    if extra:
        raise MimoError(
            f"{source}: tensor {extra[0]!r} (shape {tuple(shapes[extra[0]])}) has no place in the model"
            f"{' (the arch ties embeddings)' if extra[0] == tied_head else ''}; {len(extra)} unused in all"
        )


def import_hf_state_(stage: LLMStage, get: Callable[[str], torch.Tensor],
                     shapes: Mapping[str, tuple[int, ...]], source: str = "checkpoint", rename: Rename = _same) -> None:
    """Load Hugging Face tensors (by name: ``get``, ``shapes``) into this rank's stage."""
    check_hf_tensors(stage.arch, shapes, source, rename)
    names = hf_name_map(stage.arch, rename)
    stage.load_full_({ours: get(names[ours]) for ours in stage.param_table()})


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


def load_hf_checkpoint(stage: LLMStage, path: str) -> None:
    """``init: {hf: DIR}``: load a Hugging Face checkpoint directory into this rank's stage: a
    causal LM, or the language model of a LLaVA checkpoint (either key naming)."""
    ckpt = HFCheckpoint(path)
    config, rename, keys = ckpt.config, _same, ckpt.keys()
    if config.get("model_type") == "llava":
        config = llava_text_config(config)
        found = [pair for pair in LLAVA_LM.values() if llava_lm_key("model.embed_tokens.weight", *pair) in keys]
        if not found:
            raise MimoError(f"{path!r}: a LLaVA config, but no language model embedding "
                            f"({' or '.join(llava_lm_key('model.embed_tokens.weight', *p) for p in LLAVA_LM.values())})")
        body, head = found[0]
        rename = lambda name: llava_lm_key(name, body, head)  # noqa: E731
        keys = [k for k in keys if k.startswith(body) or k == head]
    theirs = arch_from_hf_config(config)
    for field in ("rope_theta", "rope_scaling", "norm_eps", "tie_embeddings", "qk_norm"):
        if getattr(theirs, field) != getattr(stage.arch, field):
            log.warning("%s: arch.%s=%r differs from the checkpoint's config.json (%r)",
                        path, field, getattr(stage.arch, field), getattr(theirs, field))
    shapes = {name: ckpt.shape(name) for name in keys}
    import_hf_state_(stage, ckpt.get, shapes, path, rename)


def export_hf_state(full_state: Mapping[str, torch.Tensor], arch: HybridArch, rename: Rename = _same) -> dict[str, torch.Tensor]:
    """Hugging Face state dict (as ``model.state_dict()`` has it) from our full canonical state
    (all stages merged; vocab padding is already stripped by ``full_state``)."""
    out = {}
    for ours, theirs in hf_name_map(arch, rename).items():
        if ours not in full_state:
            raise MimoError(f"export: the state has no {ours!r} (merge the full state of every stage)")
        out[theirs] = full_state[ours]
    if arch.tie_embeddings:
        out[rename(TIED_HEAD)] = full_state["embed.weight"]
    return out


def save_hf_checkpoint(path: str, hf_state: Mapping[str, torch.Tensor], config: Mapping) -> None:
    """Write ``config.json`` and ``model.safetensors`` (a tied head is not stored, as HF does)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tied = bool(config.get("tie_word_embeddings", False))
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in hf_state.items() if not (tied and k == TIED_HEAD)}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(config), f, indent=2)
