"""Hugging Face import / export of causal LMs, one *family* per ``model_type`` (``HF_FAMILIES``).

Decoder families (this file): Llama, Qwen2, Qwen3 and the MoE ones Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE; Qwen3-VL's and Qwen3-VL-MoE's language models; Qwen3-Next, Qwen3.5 and Qwen3.5-MoE
(``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text``: their own section below, Gated DeltaNet /
gated-attention layers; the Qwen3.5 ones also Qwen3.5's VLMs' language models). A Hugging Face
decoder layer ``j`` is two of our layers: attention ``2j`` (with ``input_layernorm``) and MLP or
MoE ``2j+1`` (with ``post_attention_layernorm``), so these models are the pattern ``"*-"`` /
``"*E"`` per decoder layer (``|`` anywhere between layers for explicit stages). Qwen MoE configs may make some layers dense (``mlp_only_layers``,
``decoder_sparse_step``): those are ``-`` layers of inner size ``intermediate_size``.

Model-specific flags, as Hugging Face defines them:

    llama      attention_bias -> q, k, v and o_proj biases; mlp_bias -> gate/up/down biases
    qwen2      q, k, v biases always, no o_proj bias
    qwen3      attention_bias -> q, k, v and o_proj biases; QK-norm per head always
    qwen3_moe  as qwen3; experts of moe_intermediate_size, norm_topk_prob
    qwen2_moe  qkv_bias -> q, k, v biases, no o_proj bias; a shared expert
               (shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate)
    mixtral    no biases; experts of intermediate_size (num_local_experts), always renormalised;
               sliding_window must be unset (or cover max_position_embeddings)
    olmoe      attention_bias -> all four biases; QK-norm over the whole q / k projection (not
               per head: arch.qk_norm_full); experts of intermediate_size; clip_qkv unsupported
    qwen3_vl_text      Qwen3-VL's language model (the ``text_config`` of a ``qwen3_vl`` config):
               as qwen3, with M-RoPE (rope_parameters' mrope_section, default [24, 20, 20],
               interleaved whatever mrope_interleaved says, as transformers computes it) and
               deepstack after decoder layers 0 .. levels-1 (arch.deepstack_layers 1, 3, ...)
    qwen3_vl_moe_text  Qwen3-VL-MoE's: as qwen3_vl_text with qwen3_moe's experts (no
               norm_topk_prob: the router always renormalises); published checkpoints hold
               the fused experts transposed ([E, D, 2F], [E, F, D]), read either way

MoE routing of the MoE families: softmax over the experts, top-k, gates renormalised when
``norm_topk_prob`` (plain division: ``moe.norm_eps`` 0), no scaling, no groups, no bias.
Imported MoEs have ``aux_loss: none``: Hugging Face adds ``router_aux_loss_coef`` times its
balancing loss only with ``output_router_logits`` (off by default), so the import is the
model's own objective; set ``arch.moe.aux_loss`` to fine-tune with one (export writes its
coefficient as ``router_aux_loss_coef``).

**Expert weights.** transformers 5 holds each layer's experts fused: ``mlp.experts.gate_up_proj
[E, 2F, D]`` (gate rows, then up rows, as our ``experts.up_proj``) and ``mlp.experts.down_proj
[E, D, F]`` (ours), the router ``mlp.gate.weight [E, D]``. Checkpoints (``save_pretrained``'s
and the published ones) hold them per expert, ``mlp.experts.{e}.gate_proj / up_proj /
down_proj.weight`` (Mixtral: ``block_sparse_moe.experts.{e}.w1 / w3 / w2`` and
``block_sparse_moe.gate``). Import reads either (``decoder_checkpoint_view``: per-expert tensors
stacked lazily, ``StackedExperts``); export writes ``model.state_dict()``'s names, which
``from_pretrained`` loads as they are.

**Qwen3-VL** (``qwen3_vl`` / ``qwen3_vl_moe`` configs) and **Qwen3.5** (``qwen3_5`` /
``qwen3_5_moe``: the same layout, no deepstack): the language model sits under
``model.language_model.`` with ``lm_head.weight`` beside it (tied as the top-level
``tie_word_embeddings`` says); the deepstack levels are the vision config's
``deepstack_visual_indexes`` (``Qwen3VisionArch.hf_deepstack_indexes``: none for Qwen3.5).
``qwen3_vl_arch`` (the arch of a whole config.json), ``qwen3_vl_text_from_hf`` /
``qwen3_vl_text_to_hf`` (our state from / to the whole model's state dict) and
``language_model_of`` (its checkpoints) are what the integration calls.

**The family seam** (``HFFamily``; a family in its own module registers with
``HF_FAMILIES[model_type] = family_of(module)``, the module defining the names in brackets):

* ``arch_from_config(cfg, pattern_stages=None) -> HybridArch`` [``arch_from_hf_config``]: the
  arch of a ``config.json`` dict (``pattern_stages``: Hugging Face layers per explicit stage);
  MimoError naming the config key for what our model cannot express.
* ``config_from_arch(arch, model_type) -> dict`` [``hf_config_from_arch``]: the ``config.json``
  of an arch; MimoError unless the arch is exactly this family (``hf_model_type`` picks the
  first family whose ``config_from_arch`` accepts an arch, so families must not overlap).
* ``tensor_pieces(arch, rename) -> {hf_name: (piece, ...)}`` [``hf_tensor_pieces``]: every
  Hugging Face tensor in ``model.state_dict()`` order (``rename``: where the causal LM sits in a
  larger checkpoint), each the concatenation of *pieces* ``(our canonical name, part)``: part
  ``i`` of a fused tensor of ours (its placement's ``parts``, along the dim they split), or part
  0 = the whole of an unfused one. The pieces of one tensor are concatenated along that fused
  dim (dim 0 without parts): q | k | v -> ``qkv.weight`` parts along dim 0, ``gate_up_proj``
  -> ``experts.up_proj`` parts along dim 1. A tensor whose pieces all appear in earlier tensors
  is a *copy* (a tied ``lm_head``): written on export, optional on import.
  ``tensor_pieces`` may be ``hf_tensor_map`` instead: each value one piece ``(ours, part)``.
* ``checkpoint_view(arch, keys, shapes, get) -> (shapes, get)`` [``checkpoint_view``,
  optional]: the checkpoint under ``tensor_pieces``' names (renamings, per-expert tensors
  stacked: ``StackedExperts``, row blocks of a tensor split into names of their own), lazily:
  ``get(name)`` indexable by a tuple of slices. Default: as is.
* ``export_view(state, arch) -> state`` [``join_split(state)``, optional]: the inverse on
  export, from ``tensor_pieces``' names to ``model.state_dict()``'s (the arch: Qwen3-Next's
  regrouping needs its head counts). Default: as is.
* ``unit_dim(hf_name) -> int | None`` [``unit_dim``, optional]: a dim of size 1 Hugging Face
  has and we do not (Mamba's ``conv1d.weight [C, 1, K]``), unless the view drops it.
* ``checkpoint_mtp(arch, keys) -> arch`` [``with_checkpoint_mtp``, optional]: the arch with the
  MTP module a checkpoint's tensor names hold (DeepSeek-V3's: decoder layers past the last).
  Default: Qwen's ``mtp.*`` (``with_checkpoint_mtp``).
* A piece may name one of our persistent buffers (``router.expert_bias``) instead of a
  parameter: it is imported whole and exported from the state given to ``export_hf_state``
  (which must then hold it).

**One layer's rules** (the Qwen3-Next, Qwen3.5 and Qwen3.5-MoE families; issue 48):
``gdn_layer_pieces`` (their ``linear_attn``, with Qwen3-Next's per-key-head grouped projections
shown as row blocks by ``qwen3_next_gdn_view`` and grouped again by ``qwen3_next_gdn_join``) and
``moe_layer_pieces``, in the piece language above, one decoder layer at a time;
``gdn_layer_from_hf`` / ``gdn_layer_to_hf`` and ``layer_state_from_hf`` / ``layer_state_to_hf`` run
them on one layer's state through the same ``_Layout`` as whole models.

Checkpoints are read lazily with safetensors: each rank reads only its own slice of each
tensor its stage needs (``get_slice``, through the parameter's placement:
``mimo.parallel.placement.read_local``; a fused weight part by part, a stacked one expert by
expert). Every name and shape is checked first, on every rank alike, so a misfit checkpoint
fails with one ``MimoError`` naming the first bad tensor.
``transformers`` is imported only by the functions that build Hugging Face objects.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping

import torch

from mimo.core.errors import MimoError
from mimo.llm import hf_deepseek_v3, hf_nemotron_h
from mimo.llm.blocks import build_layer
from mimo.llm.config import HybridArch, MoEArch, MTPArch, RopeScaling
from mimo.llm.lazy import concat_reader, stacked_experts
from mimo.llm.model import LLMStage
from mimo.llm.pattern import LayerSpec, with_stages
from mimo.parallel.params import param_table
from mimo.parallel.placement import ParamPlacement, read_local, replicated

log = logging.getLogger(__name__)

Piece = tuple[str, int]  # (our canonical name, which of its fused parts; 0: the whole of an unfused one)
Rename = Callable[[str], str]  # a Hugging Face causal-LM name -> its name inside a larger model (LLaVA)
Getter = Callable[[str], object]  # a checkpoint name -> the tensor, indexable by a tuple of slices


def _same(name: str) -> str:
    return name


def _identity_view(arch: HybridArch, keys: Iterable[str], shapes: Mapping[str, tuple[int, ...]], get: Getter):
    return {k: tuple(shapes[k]) for k in keys}, get


def _as_is(state: dict, arch: HybridArch | None = None) -> dict:
    return state


def _no_unit_dim(name: str) -> int | None:
    return None


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face model family (see module doc, "The family seam")."""

    architecture: str  # the *ForCausalLM class, config.json's "architectures"
    arch_from_config: Callable[..., HybridArch]
    config_from_arch: Callable[[HybridArch, str], dict]
    tensor_pieces: Callable[[HybridArch, Rename], dict[str, tuple[Piece, ...]]]
    checkpoint_view: Callable = _identity_view
    unit_dim: Callable[[str], int | None] = _no_unit_dim
    export_view: Callable[[dict, HybridArch], dict] = _as_is
    checkpoint_mtp: Callable[[HybridArch, Iterable[str]], HybridArch] | None = None


def family_of(module) -> HFFamily:
    """The family a module defines by the names of the module doc's seam."""
    pieces = getattr(module, "hf_tensor_pieces", None) or module.hf_tensor_map
    join = getattr(module, "join_split", None)
    return HFFamily(module.ARCHITECTURE, module.arch_from_hf_config, module.hf_config_from_arch, pieces,
                    getattr(module, "checkpoint_view", _identity_view), getattr(module, "unit_dim", _no_unit_dim),
                    _as_is if join is None else lambda state, arch: join(state), getattr(module, "with_checkpoint_mtp", None))


# ---------------------------------------------------------------- decoder families


@dataclass(frozen=True)
class Decoder:
    """What tells the decoder families apart (module doc's table)."""

    architecture: str
    bias: str = "attention_bias"  # attention_bias: q, k, v, o; qkv: q, k, v only (qkv_bias, default true); none
    qk_norm: str = "none"  # none | head | full
    mlp_bias: bool = False  # Llama's mlp_bias key
    experts: str | None = None  # config key of the expert count (an MoE family; either spelling is read)
    expert_ffn: str = "moe_intermediate_size"  # config key of the expert inner size
    norm_topk: bool | None = None  # None: norm_topk_prob (default false); True: always (Mixtral)
    sparse_layers: bool = False  # mlp_only_layers / decoder_sparse_step (Qwen MoE)
    shared: bool = False  # Qwen2-MoE's gated shared expert
    experts_first: bool = False  # state_dict order of mlp.experts before mlp.gate (Qwen3-MoE)
    mrope: bool = False  # M-RoPE (mrope_section) and deepstack after decoder layers (Qwen3-VL's text model)
    transposed_experts: bool = False  # checkpoints may hold the fused experts transposed (Qwen3-VL-MoE)


DECODERS = {
    "llama": Decoder("LlamaForCausalLM", mlp_bias=True),
    "qwen2": Decoder("Qwen2ForCausalLM", bias="qkv"),
    "qwen3": Decoder("Qwen3ForCausalLM", qk_norm="head"),
    "qwen3_moe": Decoder("Qwen3MoeForCausalLM", qk_norm="head", experts="num_experts", sparse_layers=True,
                         experts_first=True),
    "qwen2_moe": Decoder("Qwen2MoeForCausalLM", bias="qkv", experts="num_experts", sparse_layers=True, shared=True),
    "mixtral": Decoder("MixtralForCausalLM", bias="none", experts="num_local_experts", expert_ffn="intermediate_size",
                       norm_topk=True),
    "olmoe": Decoder("OlmoeForCausalLM", qk_norm="full", experts="num_experts", expert_ffn="intermediate_size"),
    "qwen3_vl_text": Decoder("Qwen3VLForConditionalGeneration", qk_norm="head", mrope=True),
    "qwen3_vl_moe_text": Decoder("Qwen3VLMoeForConditionalGeneration", qk_norm="head", experts="num_experts",
                                 norm_topk=True, sparse_layers=True, experts_first=True, mrope=True,
                                 transposed_experts=True),
}


def _decoder_of(model_type: str) -> Decoder:
    if model_type not in DECODERS:
        raise MimoError(f"model_type {model_type!r} is not a decoder family; supported: {', '.join(HF_FAMILIES)}")
    return DECODERS[model_type]


def _mlp_symbols(d: Decoder, model_type: str, cfg: Mapping, layers: int) -> list[str]:
    """Per Hugging Face decoder layer: '-' (dense MLP) or 'E' (MoE)."""
    if d.experts is None:
        return ["-"] * layers
    experts = _expert_count(cfg)
    if not d.sparse_layers:
        return ["E"] * layers
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return ["E" if j not in dense and experts > 0 and (j + 1) % step == 0 else "-" for j in range(layers)]


def _expert_count(cfg: Mapping) -> int:
    """num_experts or num_local_experts (transformers maps one to the other and writes either)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def _reject_decoder_config(d: Decoder, model_type: str, cfg: Mapping) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise MimoError(f"{model_type}: hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
    if cfg.get("use_sliding_window"):
        raise MimoError(f"{model_type}: sliding-window attention (use_sliding_window) is not supported")
    window, longest = cfg.get("sliding_window"), int(cfg.get("max_position_embeddings", 4096))
    if model_type == "mixtral" and window is not None and int(window) < longest:
        raise MimoError(f"{model_type}: sliding-window attention (sliding_window={window} < max_position_embeddings="
                        f"{longest}) is not supported; set sliding_window: null")
    if cfg.get("clip_qkv") is not None:
        raise MimoError(f"{model_type}: clip_qkv={cfg['clip_qkv']} (clamped q / k / v) is not supported")
    if float(cfg.get("router_jitter_noise") or 0.0) > 0:
        raise MimoError(f"{model_type}: router_jitter_noise={cfg['router_jitter_noise']} is not supported (set 0)")


def _moe_from_config(d: Decoder, cfg: Mapping) -> MoEArch:
    return MoEArch(
        experts=_expert_count(cfg), topk=int(cfg["num_experts_per_tok"]), ffn=int(cfg[d.expert_ffn]),
        shared_ffn=int(cfg["shared_expert_intermediate_size"]) if d.shared else 0, shared_gate=d.shared,
        norm_topk=d.norm_topk if d.norm_topk is not None else bool(cfg.get("norm_topk_prob", False)),
    )


def decoder_arch_from_config(model_type: str, cfg: Mapping, pattern_stages: Iterable[int] | None = None) -> HybridArch:
    """Our ``HybridArch`` of a decoder family's ``config.json`` dict."""
    d = _decoder_of(model_type)
    _reject_decoder_config(d, model_type, cfg)
    symbols = _mlp_symbols(d, model_type, cfg, int(cfg["num_hidden_layers"]))
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope_from_hf(cfg)
    attention_bias = bool(cfg.get("attention_bias", False))
    qkv_bias, o_bias = {"attention_bias": (attention_bias, attention_bias), "none": (False, False),
                        "qkv": (bool(cfg.get("qkv_bias", True)), False)}[d.bias]
    return HybridArch(
        pattern=with_stages(["*" + s for s in symbols], pattern_stages),
        hidden=int(cfg["hidden_size"]),
        heads=heads,
        vocab=int(cfg["vocab_size"]),
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        ffn=int(cfg["intermediate_size"]),
        mlp_act="swiglu",
        mlp_bias=bool(cfg.get("mlp_bias", False)) if d.mlp_bias else False,
        qk_norm=d.qk_norm != "none",
        qk_norm_full=d.qk_norm == "full",
        attention_bias=attention_bias,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
        init_std=float(cfg.get("initializer_range", 0.02)),
        moe=_moe_from_config(d, cfg) if "E" in symbols else None,
        mrope_section=_mrope_from_hf(cfg) if d.mrope else None,
    )


def _mrope_from_hf(cfg: Mapping, default: Iterable[int] = (24, 20, 20)) -> list[int]:
    """M-RoPE sections of a Qwen3-VL (or Qwen3.5) text config (transformers' ``default`` when absent)."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    return [int(v) for v in params.get("mrope_section") or default]


def _mrope_to_hf(arch: HybridArch) -> dict:
    """``rope_parameters``' M-RoPE keys of ``arch`` (transformers interleaves whatever the flag says)."""
    return {"mrope_section": list(arch.mrope_section), "mrope_interleaved": True}


def deepstack_after_decoder_layers(levels: int) -> list[int]:
    """``arch.deepstack_layers`` of Hugging Face's deepstack (Qwen3-VL): level k right after
    decoder layer k, i.e. after our MLP / MoE layer ``2k + 1``."""
    return [2 * k + 1 for k in range(levels)]


def hf_decoder_layers(arch: HybridArch) -> list[str]:
    """Our MLP-layer symbol ('-' or 'E') of each Hugging Face decoder layer of ``arch``;
    MimoError unless the pattern is ``*-`` / ``*E`` pairs."""
    kinds = [layer.kind for layer in arch.layer_pattern().layers]
    pairs = [kinds[i : i + 2] for i in range(0, len(kinds), 2)]
    if len(kinds) % 2 or any(p not in (["attention", "mlp"], ["attention", "moe"]) for p in pairs):
        raise MimoError(
            f"Hugging Face decoder models are the pattern '*-' or '*E' repeated (one attention and one MLP or MoE "
            f"layer per decoder layer); the pattern {arch.pattern!r} is not"
        )
    if arch.mlp_act != "swiglu" or (arch.moe is not None and arch.moe.act != "swiglu"):
        raise MimoError("Hugging Face Llama / Qwen / Mixtral / OLMoE MLPs and experts are SwiGLU; arch.mlp_act / "
                        "arch.moe.act is not 'swiglu'")
    return ["-" if p[1] == "mlp" else "E" for p in pairs]


def _moe_problems(d: Decoder, model_type: str, moe: MoEArch) -> list[str]:
    """What in ``arch.moe`` this family cannot express."""
    want = {"score": "softmax", "scale": 1.0, "groups": 1, "expert_bias": False, "quantile_balancing": False,
            "latent": 0, "norm_eps": 0.0, "router_bias": False, "z_loss_coeff": 0.0,
            "shared_gate": d.shared}
    if d.norm_topk is not None:
        want["norm_topk"] = d.norm_topk
    out = [f"arch.moe.{k} is {getattr(moe, k)!r}, {model_type} needs {v!r}" for k, v in want.items() if getattr(moe, k) != v]
    if bool(moe.shared_ffn) != d.shared:
        out.append(f"arch.moe.shared_ffn is {moe.shared_ffn}: {model_type} has {'one' if d.shared else 'no'} shared expert")
    if moe.aux_loss.kind == "per_sample":
        out.append(f"arch.moe.aux_loss.kind 'per_sample': {model_type}'s balancing loss is over the batch (use global)")
    return out


def _decoder_problems(d: Decoder, model_type: str, arch: HybridArch, symbols: list[str]) -> list[str]:
    out = [] if arch.mtp is None or model_type in GATED_FAMILIES else [no_mtp_weights(model_type)]
    if d.bias == "qkv" and arch.o_bias:
        out.append(f"{model_type} has no o_proj bias; set o_bias: false")
    if model_type == "qwen2" and not arch.qkv_bias:
        out.append("qwen2 has q/k/v biases; set qkv_bias: true")
    if d.bias == "attention_bias" and arch.qkv_bias != arch.o_bias:
        out.append(f"{model_type} has one attention_bias flag for q/k/v and o_proj; qkv_bias and o_bias differ")
    if d.bias == "none" and (arch.qkv_bias or arch.o_bias):
        out.append(f"{model_type} has no attention biases")
    norm = "full" if arch.qk_norm and arch.qk_norm_full else "head" if arch.qk_norm else "none"
    if norm != d.qk_norm:
        names = {"none": "no QK-norm", "head": "QK-norm per head (qk_norm)",
                 "full": "QK-norm over the whole projection (qk_norm, qk_norm_full)"}
        out.append(f"{model_type} has {names[d.qk_norm]}, the arch {names[norm]}")
    if arch.mlp_bias and not d.mlp_bias:
        out.append(f"{model_type} has no MLP biases")
    if d.experts is None and "E" in symbols:
        out.append(f"{model_type} has no MoE layers")
    if d.experts is not None and "E" not in symbols:
        out.append(f"{model_type} has MoE layers; the pattern has none")
    if d.experts is not None and not d.sparse_layers and "-" in symbols:
        out.append(f"every {model_type} decoder layer is MoE; the pattern has dense '-' layers")
    if "E" in symbols and arch.moe is not None:
        out += _moe_problems(d, model_type, arch.moe)
    if not arch.rope:
        out.append(f"{model_type} attention has RoPE; set arch.rope: true")
    if d.mrope and arch.mrope_section is None:
        out.append(f"{model_type} has M-RoPE; set arch.mrope_section")
    if not d.mrope and arch.mrope_section is not None:
        out.append(f"{model_type} has 1-D RoPE; arch.mrope_section is set")
    if arch.deepstack_layers and not d.mrope:
        out.append(f"{model_type} has no deepstack; arch.deepstack_layers is set")
    elif arch.deepstack_layers and list(arch.deepstack_layers) != deepstack_after_decoder_layers(len(arch.deepstack_layers)):
        out.append(f"{model_type} adds deepstack level k after decoder layer k (arch.deepstack_layers "
                   f"{deepstack_after_decoder_layers(len(arch.deepstack_layers))}), not {list(arch.deepstack_layers)}")
    return out


def decoder_config_from_arch(arch: HybridArch, model_type: str) -> dict:
    """A decoder family's ``config.json`` dict for ``arch`` (export); MimoError listing what does not fit."""
    d = _decoder_of(model_type)
    symbols = hf_decoder_layers(arch)
    problems = _decoder_problems(d, model_type, arch, symbols)
    # Qwen3-Next / Qwen3.5 layers (issue 48): the qwen3_next family below takes them
    for key, plain in (("norm_zero_centred", False), ("attn_output_gate", False), ("rotary_fraction", 1.0)):
        if getattr(arch, key, plain) != plain:
            problems.append(f"{model_type} has no arch.{key}: {getattr(arch, key)} (of the Hugging Face families mimo "
                            f"maps, qwen3_next takes it); set it to {plain}")
    if problems:
        raise MimoError(f"{model_type} export: " + "; ".join(problems))
    rope: dict = {"rope_theta": arch.rope_theta, "rope_type": "default"}
    if arch.rope_scaling is not None:
        s = arch.rope_scaling
        rope.update(rope_type=s.type, factor=s.factor)
        if s.type == "llama3":
            rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                        original_max_position_embeddings=s.original_max_position_embeddings)
    if d.mrope:  # (deepstack levels live in the vision config: qwen3_vl_arch)
        rope.update(_mrope_to_hf(arch))
    cfg = {
        "model_type": model_type, "architectures": [d.architecture],
        "vocab_size": arch.vocab, "hidden_size": arch.hidden, "intermediate_size": arch.ffn,
        "num_hidden_layers": len(symbols), "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads,
        "head_dim": arch.head_dim, "hidden_act": "silu", "max_position_embeddings": arch.max_seq_len,
        "rms_norm_eps": arch.norm_eps, "rope_parameters": rope, "tie_word_embeddings": arch.tie_embeddings,
        "initializer_range": arch.init_std,
    }
    if d.bias == "attention_bias":
        cfg["attention_bias"] = bool(arch.o_bias)
    if d.bias == "qkv" and model_type != "qwen2":
        cfg["qkv_bias"] = bool(arch.qkv_bias)
    if d.mlp_bias:
        cfg["mlp_bias"] = arch.mlp_bias
    if d.experts is not None:
        m = arch.moe
        cfg.update({d.experts: m.experts, "num_experts_per_tok": m.topk, d.expert_ffn: m.ffn,
                    "router_aux_loss_coef": m.aux_loss.coeff if m.aux_loss.kind != "none" else 0.0})
        if d.norm_topk is None:
            cfg["norm_topk_prob"] = m.norm_topk
        if d.shared:
            cfg["shared_expert_intermediate_size"] = m.shared_ffn
        if d.sparse_layers:
            cfg.update(decoder_sparse_step=1, mlp_only_layers=[j for j, s in enumerate(symbols) if s == "-"])
        if model_type == "mixtral":
            cfg["sliding_window"] = None
    return cfg


def _attention_pieces(arch: HybridArch) -> list[tuple[str, tuple[Piece, ...]]]:
    """One decoder layer's attention tensors ({j}: HF layer, {a}: ours), in HF's order."""
    out = []
    for part, x in enumerate("qkv"):
        out.append((f"self_attn.{x}_proj.weight", (("layers.{a}.qkv.weight", part),)))
        if arch.qkv_bias:
            out.append((f"self_attn.{x}_proj.bias", (("layers.{a}.qkv.bias", part),)))
    out.append(("self_attn.o_proj.weight", (("layers.{a}.o_proj.weight", 0),)))
    if arch.o_bias:
        out.append(("self_attn.o_proj.bias", (("layers.{a}.o_proj.bias", 0),)))
    if arch.qk_norm:
        out += [(f"self_attn.{x}_norm.weight", ((f"layers.{{a}}.{x}_norm.weight", 0),)) for x in "qk"]
    return out


def _mlp_pieces(arch: HybridArch) -> list[tuple[str, tuple[Piece, ...]]]:
    out = []
    for proj, ours, part in (("gate_proj", "up_proj", 0), ("up_proj", "up_proj", 1), ("down_proj", "down_proj", 0)):
        out.append((f"mlp.{proj}.weight", ((f"layers.{{m}}.{ours}.weight", part),)))
        if arch.mlp_bias:
            out.append((f"mlp.{proj}.bias", ((f"layers.{{m}}.{ours}.bias", part),)))
    return out


def _moe_pieces(arch: HybridArch, experts_first: bool) -> list[tuple[str, tuple[Piece, ...]]]:
    gate = [("mlp.gate.weight", (("layers.{m}.router.weight", 0),))]
    experts = [("mlp.experts.gate_up_proj", (("layers.{m}.experts.up_proj", 0), ("layers.{m}.experts.up_proj", 1))),
               ("mlp.experts.down_proj", (("layers.{m}.experts.down_proj", 0),))]
    out = experts + gate if experts_first else gate + experts
    if arch.moe.shared_ffn:
        out += [("mlp.shared_expert.gate_proj.weight", (("layers.{m}.shared.up_proj", 0),)),
                ("mlp.shared_expert.up_proj.weight", (("layers.{m}.shared.up_proj", 1),)),
                ("mlp.shared_expert.down_proj.weight", (("layers.{m}.shared.down_proj", 0),))]
    if arch.moe.shared_gate:
        out.append(("mlp.shared_expert_gate.weight", (("layers.{m}.shared.gate", 0),)))
    return out


def decoder_tensor_pieces(model_type: str, arch: HybridArch, rename: Rename = _same) -> dict[str, tuple[Piece, ...]]:
    """Every Hugging Face tensor of a decoder family's ``arch`` -> its pieces, in HF's order."""
    d = _decoder_of(model_type)
    out: dict[str, tuple[Piece, ...]] = {"model.embed_tokens.weight": (("embed.weight", 0),)}
    for j, symbol in enumerate(hf_decoder_layers(arch)):
        mlp = _moe_pieces(arch, d.experts_first) if symbol == "E" else _mlp_pieces(arch)
        norms = [("input_layernorm.weight", (("layers.{a}.norm.weight", 0),)),
                 ("post_attention_layernorm.weight", (("layers.{m}.norm.weight", 0),))]
        for theirs, pieces in _attention_pieces(arch) + mlp + norms:
            out[f"model.layers.{j}.{theirs}"] = tuple((o.format(a=2 * j, m=2 * j + 1), p) for o, p in pieces)
    out["model.norm.weight"] = (("norm.weight", 0),)
    out[TIED_HEAD] = (("embed.weight" if arch.tie_embeddings else "head.weight", 0),)
    return {rename(k): v for k, v in out.items()}


# per-expert checkpoint tensors: (mlp | block_sparse_moe).experts.{e}.<proj>.weight
_PER_EXPERT = re.compile(r"^(?P<layer>.*)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# each per-expert projection -> (the fused tensor, which of its parts along dim 1)
_FUSED_OF = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
             "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", 0), "w2": ("down_proj", 0)}
_PROJ_NAMES = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


def decoder_checkpoint_view(arch: HybridArch | None, keys: Iterable[str], shapes: Mapping[str, tuple[int, ...]], get: Getter):
    """(shapes, get) of a decoder checkpoint under ``model.state_dict()``'s names: Mixtral's
    ``block_sparse_moe.`` -> ``mlp.``, per-expert tensors stacked (lazily) into
    ``mlp.experts.gate_up_proj`` / ``down_proj``; everything else as it is. MimoError naming a
    missing or misfit per-expert tensor."""
    out_shapes: dict[str, tuple[int, ...]] = {}
    sources: dict[str, Callable[[], object]] = {}
    grouped: dict[tuple[str, str], dict[int, dict[int, str]]] = {}  # (layer, fused) -> expert -> part -> key
    for key in keys:
        m = _PER_EXPERT.match(key)
        if m:
            fused, part = _FUSED_OF[m["proj"]]
            grouped.setdefault((m["layer"], fused), {}).setdefault(int(m["e"]), {})[part] = key
            continue
        name = key.replace(".block_sparse_moe.", ".mlp.")
        out_shapes[name] = tuple(shapes[key])
        sources[name] = lambda key=key: get(key)
    for (layer, fused), by_expert in grouped.items():
        name = f"{layer}.mlp.experts.{fused}"
        out_shapes[name], sources[name] = stacked_experts(name, _per_expert_keys(name, by_expert), shapes, get)
    return out_shapes, lambda name: sources[name]()


def _per_expert_keys(name: str, by_expert: dict[int, dict[int, str]]) -> list[list[str]]:
    """The keys of every expert 0..E-1, in part order; MimoError naming the first one missing."""
    some = next(iter(next(iter(by_expert.values())).values()))
    legacy = ".w1." in some or ".w2." in some or ".w3." in some
    projs = _PROJ_NAMES[name.rsplit(".", 1)[1]][1 if legacy else 0]
    prefix = some[: some.index(".experts.") + len(".experts.")]
    out = []
    for e in range(max(by_expert) + 1):
        parts = by_expert.get(e, {})
        for part, proj in enumerate(projs):
            if part not in parts:
                raise MimoError(f"no tensor {prefix}{e}.{proj}.weight (expert {e} of {name!r}, stacked from per-expert "
                                f"tensors; the checkpoint has experts up to {max(by_expert)})")
        out.append([parts[p] for p in range(len(projs))])
    return out


class _Transposed:
    """A checkpoint tensor with its last two dims swapped, lazily (indexable like the source)."""

    def __init__(self, src):
        self.src = src

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.src[(*index[:-2], index[-1], index[-2])].transpose(-1, -2)


def transposed_experts_view(arch: HybridArch | None, keys: Iterable[str], shapes: Mapping[str, tuple[int, ...]],
                            get: Getter):
    """``decoder_checkpoint_view``, then fused experts stored transposed (Qwen3-VL-MoE's published
    ``gate_up_proj [E, D, 2F]`` / ``down_proj [E, F, D]``) read as ``model.state_dict()`` holds
    them (``[E, 2F, D]`` / ``[E, D, F]``), lazily; a tensor already in that shape as it is (the
    rule of transformers' ``Transpose(check_dims=True)``)."""
    shapes, get = decoder_checkpoint_view(arch, keys, shapes, get)
    if arch is None or arch.moe is None:
        return shapes, get
    e, f, d = arch.moe.experts, arch.moe.ffn, arch.hidden
    want = {"mlp.experts.gate_up_proj": (e, 2 * f, d), "mlp.experts.down_proj": (e, d, f)}
    flipped = {}
    for name, shape in shapes.items():
        target = next((w for suffix, w in want.items() if name.endswith("." + suffix)), None)
        if target is not None and tuple(shape) != target and tuple(shape) == (*target[:-2], target[-1], target[-2]):
            flipped[name] = target
    out = {**shapes, **flipped}
    return out, lambda name: _Transposed(get(name)) if name in flipped else get(name)


def _decoder_family(model_type: str) -> HFFamily:
    d = DECODERS[model_type]
    return HFFamily(
        d.architecture,
        lambda cfg, pattern_stages=None: decoder_arch_from_config(model_type, cfg, pattern_stages),
        lambda arch, model_type_=model_type: decoder_config_from_arch(arch, model_type_),
        lambda arch, rename=_same: decoder_tensor_pieces(model_type, arch, rename),
        transposed_experts_view if d.transposed_experts else decoder_checkpoint_view,
    )


HF_FAMILIES: dict[str, HFFamily] = {t: _decoder_family(t) for t in DECODERS}
HF_FAMILIES["nemotron_h"] = family_of(hf_nemotron_h)
HF_FAMILIES["deepseek_v3"] = family_of(hf_deepseek_v3)
# DeepSeek-V3.2: the same module (its DSA layers and indexer tensors where the config or arch has them)
HF_FAMILIES["deepseek_v32"] = replace(HF_FAMILIES["deepseek_v3"], architecture=hf_deepseek_v3.V32_ARCHITECTURE)
SUPPORTED = {t: f.architecture for t, f in HF_FAMILIES.items()}  # model_type -> architecture (at import time)
TIED_HEAD = "lm_head.weight"  # in HF's state_dict() of a tied model, the embedding again
IGNORED = (".rotary_emb.inv_freq",)  # buffers some older checkpoints carry


def family(model_type: str | None) -> HFFamily:
    if model_type not in HF_FAMILIES:
        raise MimoError(f"Hugging Face model_type {model_type!r} is not supported; supported: {', '.join(HF_FAMILIES)}")
    return HF_FAMILIES[model_type]


def hf_model_type(arch: HybridArch) -> str:
    """The family whose ``config_from_arch`` accepts ``arch`` (MimoError with each family's reason otherwise)."""
    reasons: dict[str, list[str]] = {}  # reason -> the families that gave it (the decoder families share most)
    for model_type, fam in HF_FAMILIES.items():
        try:
            fam.config_from_arch(arch, model_type)
            return model_type
        except MimoError as e:
            reasons.setdefault(str(e), []).append(model_type)
    raise MimoError("no Hugging Face family fits the arch: "
                    + " | ".join(f"{', '.join(types)}: {reason}" for reason, types in reasons.items()))


# ---------------------------------------------------------------- config


def no_mtp_weights(model_type: str) -> str:
    return (f"{model_type} has no multi-token prediction weights (Qwen3-Next and Qwen3.5's mtp.* have them); "
            f"remove arch.mtp")


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
    """Our ``HybridArch`` for a Hugging Face ``config.json`` (a dict), by its ``model_type``.

    ``pattern_stages``: decoder layers per explicit pipeline stage (writes ``|`` into the
    pattern); by default the pattern has no ``|`` and stages are balanced automatically.
    """
    return family(cfg.get("model_type")).arch_from_config(cfg, pattern_stages)


def hf_config_from_arch(arch: HybridArch, model_type: str | None = None) -> dict:
    """A ``config.json`` dict for ``arch`` as a Hugging Face ``model_type`` (default: the one that fits)."""
    model_type = hf_model_type(arch) if model_type is None else model_type
    return family(model_type).config_from_arch(arch, model_type)


# ---------------------------------------------------------------- tensor layout


def hf_tensor_pieces(arch: HybridArch, rename: Rename = _same, model_type: str | None = None) -> dict[str, tuple[Piece, ...]]:
    """Every Hugging Face tensor of ``arch`` -> its pieces (see module doc), in HF's order."""
    return family(hf_model_type(arch) if model_type is None else model_type).tensor_pieces(arch, rename)


def hf_tensor_map(arch: HybridArch, rename: Rename = _same, model_type: str | None = None) -> dict[str, tuple[Piece, ...]]:
    """``hf_tensor_pieces`` (the name older callers use)."""
    return hf_tensor_pieces(arch, rename, model_type)


def full_placements(arch: HybridArch) -> dict[str, ParamPlacement]:
    """The placement (full shape, fused parts) of every parameter and persistent buffer of the
    one-stage model, by canonical name (built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        stage = LLMStage(arch)
    out = {name: info.placement for name, info in stage.param_table().items()}
    for name, t in stage.state_dict().items():
        out.setdefault(name, replicated(tuple(t.shape)))
    return out


def full_shapes(arch: HybridArch) -> dict[str, tuple[int, ...]]:
    """Full shape of every parameter (and persistent buffer) of the one-stage model."""
    return {name: pl.full_shape for name, pl in full_placements(arch).items()}


def _fused_dim(pl: ParamPlacement) -> int:
    return next(d for _, d in pl.shards) if pl.parts else 0


def _part_size(pl: ParamPlacement, part: int) -> int:
    return pl.parts[part] if pl.parts else pl.full_shape[0]


@dataclass(frozen=True)
class _HFTensor:
    """One Hugging Face tensor: its pieces, the dim they are concatenated along, its shape,
    whether it only repeats earlier ones (a tied head), its unit dim."""

    pieces: tuple[Piece, ...]
    dim: int
    shape: tuple[int, ...]
    copy: bool
    unit: int | None


class _Layout:
    """Both directions of a family's mapping for one arch: each HF tensor's pieces and shape,
    each of our tensors' parts' sources (HF tensor, offset along the fused dim)."""

    def __init__(self, arch: HybridArch | None, rename: Rename = _same, model_type: str | None = None, *,
                 placements: Mapping[str, ParamPlacement] | None = None,
                 tensor_pieces: Mapping[str, tuple[Piece, ...]] | None = None,
                 unit_dim: Callable[[str], int | None] = _no_unit_dim):
        """A family's layout of ``arch``; or, with ``arch`` None, the layout of ``tensor_pieces``
        over ``placements`` (one layer's, say: ``layer_state_from_hf``)."""
        export_view, self.arch = _as_is, arch
        if arch is not None:
            self.model_type = hf_model_type(arch) if model_type is None else model_type
            fam = family(self.model_type)
            placements, tensor_pieces = full_placements(arch), fam.tensor_pieces(arch, rename)
            unit_dim, export_view = fam.unit_dim, fam.export_view
        self.placements = dict(placements)
        self.hf: dict[str, _HFTensor] = {}
        self.sources: dict[str, dict[int, tuple[str, int]]] = {}  # ours -> part -> (HF name, offset)
        for theirs, pieces in tensor_pieces.items():
            pieces = (tuple(pieces),) if isinstance(pieces[0], str) else tuple(map(tuple, pieces))  # one (ours, part)
            self.hf[theirs] = self._tensor(theirs, pieces, unit_dim(theirs))
        self.export_view, self.unit_dim = export_view, unit_dim

    def _tensor(self, theirs: str, pieces: tuple[Piece, ...], unit: int | None) -> _HFTensor:
        pls = []
        for ours, _ in pieces:
            if ours not in self.placements:
                raise MimoError(f"internal: Hugging Face {theirs!r} maps to {ours!r}, which the model does not have")
            pls.append(self.placements[ours])
        dim = next((_fused_dim(pl) for pl in pls if pl.parts), 0)
        offset, copy = 0, True
        for (ours, part), pl in zip(pieces, pls):
            if part not in self.sources.get(ours, {}):
                self.sources.setdefault(ours, {})[part] = (theirs, offset)
                copy = False
            offset += _part_size(pl, part) if pl.parts else pl.full_shape[dim]
        rest = {pl.full_shape[:dim] + pl.full_shape[dim + 1:] for pl in pls}
        if len(rest) != 1:
            raise MimoError(f"internal: the pieces {pieces} of {theirs!r} differ beyond dim {dim}")
        shape = list(pls[0].full_shape)
        shape[dim] = offset
        if unit is not None:
            shape.insert(unit, 1)
        return _HFTensor(pieces, dim, tuple(shape), copy, unit)

    def parts(self, ours: str) -> list[tuple[str, int]]:
        """The (HF name, offset) of each part of ours, in part order."""
        pl, got = self.placements[ours], self.sources.get(ours, {})
        n = len(pl.parts) or 1
        if sorted(got) != list(range(n)):
            raise MimoError(f"internal: the family maps parts {sorted(got)} of {ours!r}, which has {n}")
        return [got[i] for i in range(n)]

    def what(self, theirs: str) -> str:
        """What an HF tensor is of ours, for messages."""
        t, descr = self.hf[theirs], []
        for ours, part in t.pieces:
            pl = self.placements[ours]
            if pl.parts:
                lo = sum(pl.parts[:part])
                where = "rows" if t.dim == 0 else f"dim {t.dim}"
                descr.append(f"{ours!r} ({where} {lo}:{lo + pl.parts[part]}, part {part + 1} of {len(pl.parts)})")
            else:
                descr.append(repr(ours))
        return " | ".join(descr)

    def reader(self, ours: str, get: Getter) -> Callable[[tuple[slice, ...]], torch.Tensor]:
        """``read(index)`` of our full tensor ``ours`` from the HF tensors (``get``), lazily."""
        pl = self.placements[ours]
        dim = _fused_dim(pl)
        windows = [_Window(get(theirs), dim, offset, self.hf[theirs].unit) for theirs, offset in self.parts(ours)]
        sizes = pl.parts or (pl.full_shape[dim],)
        return concat_reader(windows, sizes, dim)


class _Window:
    """An HF tensor seen as one part of ours: indices shifted by ``offset`` along ``dim``, the
    HF unit dim (if any) read as size 1 and dropped."""

    def __init__(self, src, dim: int, offset: int, unit: int | None):
        self.src, self.dim, self.offset, self.unit = src, dim, offset, unit

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        idx = list(index)
        idx[self.dim] = slice(index[self.dim].start + self.offset, index[self.dim].stop + self.offset)
        if self.unit is None:
            return self.src[tuple(idx)]
        idx.insert(self.unit, slice(0, 1))
        return self.src[tuple(idx)].squeeze(self.unit)


def hf_name_map(arch: HybridArch, rename: Rename = _same, model_type: str | None = None) -> dict[str, tuple[str, ...]]:
    """Our canonical tensor name -> the Hugging Face tensors it is read from, in part order
    (one, or one per part of a fused weight), for every tensor of ``arch``."""
    layout = _Layout(arch, rename, model_type)
    return {ours: tuple(dict.fromkeys(t for t, _ in layout.parts(ours))) for ours in layout.sources}


def check_hf_tensors(arch: HybridArch, shapes: Mapping[str, tuple[int, ...]], source: str, rename: Rename = _same,
                     model_type: str | None = None) -> None:
    """MimoError naming the first missing, misfit or unexpected tensor of a checkpoint (under the
    family's ``state_dict`` names: its ``checkpoint_view``)."""
    _check(_Layout(arch, rename, model_type), shapes, source)


def _check(layout: _Layout, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    for theirs, t in layout.hf.items():
        if theirs not in shapes:
            if t.copy:
                continue
            raise MimoError(f"{source}: no tensor {theirs!r} (the model's {layout.what(theirs)}, shape {t.shape})")
        if tuple(shapes[theirs]) != t.shape:
            raise MimoError(
                f"{source}: tensor {theirs!r} has shape {tuple(shapes[theirs])}, but the model's {layout.what(theirs)} "
                f"needs {t.shape}"
            )
    natural = lambda n: [int(p) if p.isdigit() else p for p in n.split(".")]  # noqa: E731  layer 2 before 10
    extra = sorted((n for n in shapes if n not in layout.hf and not n.endswith(IGNORED)), key=natural)
    mtp = [n for n in extra if n.startswith(MTP_PREFIX)]
    if mtp and getattr(layout.arch, "mtp", None) is None:  # a model trained without its MTP heads: said, not an error
        log.warning("%s: its %d mtp.* tensors (multi-token prediction) are not loaded: arch.mtp is not set", source,
                    len(mtp))
        extra = [n for n in extra if not n.startswith(MTP_PREFIX)]
    if extra:
        raise MimoError(f"{source}: tensor {extra[0]!r} (shape {tuple(shapes[extra[0]])}) has no place in the model; "
                        f"{len(extra)} unused in all")


def import_hf_state_(stage: LLMStage, get: Getter, shapes: Mapping[str, tuple[int, ...]], source: str = "checkpoint",
                     rename: Rename = _same, model_type: str | None = None) -> None:
    """Load Hugging Face tensors (``state_dict`` names: a family's ``checkpoint_view`` of a
    checkpoint) into this rank's stage: ``get(name)`` is indexable by a tuple of slices (a full
    tensor, or a safetensors ``get_slice``: then only this rank's slices are read), ``shapes``
    gives every tensor's shape. Persistent buffers the family maps are loaded whole."""
    layout = _Layout(stage.arch, rename, model_type)
    _check(layout, shapes, source)
    _load_checked_(stage, layout, get)


def _load_checked_(stage: LLMStage, layout: _Layout, get: Getter) -> None:
    """``import_hf_state_`` after its check: this rank's slices and the family's buffers."""
    for ours, info in stage.param_table().items():
        read = layout.reader(ours, get)
        local = read_local(read, info.placement, info.sizes, info.coords, info.param.dtype, info.param.device)
        with torch.no_grad():
            info.param.copy_(local)
    params = stage.param_table()
    for name, buf in stage.state_dict(keep_vars=True).items():
        if name in layout.sources and name not in params:
            full = tuple(slice(0, n) for n in layout.placements[name].full_shape)
            with torch.no_grad():
                buf.copy_(layout.reader(name, get)(full))


def from_hf_state(state: Mapping[str, torch.Tensor], arch: HybridArch, rename: Rename = _same,
                  model_type: str | None = None) -> dict[str, torch.Tensor]:
    """Our full canonical state from a Hugging Face state dict; check it first with ``check_hf_tensors``."""
    return _state_from_hf(_Layout(arch, rename, model_type), state)


def _state_from_hf(layout: _Layout, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {ours: layout.reader(ours, state.__getitem__)(tuple(slice(0, n) for n in layout.placements[ours].full_shape))
            for ours in layout.sources}


def hf_row_blocks(arch: HybridArch, rename: Rename = _same, model_type: str | None = None
                  ) -> dict[str, list[tuple[str, int, int, int]]]:
    """Where the rows of each of our 2-D weights (and 3-D expert weights ``[E, out, in]``, rows
    per expert) go on export: ours -> [(HF name, its first row, our first row, rows)], for each
    weight whose every part lands whole, as rows, in a tensor that is not a copy; a low-rank
    adapter on such rows is one on those HF tensors."""
    layout, out = _Layout(arch, rename, model_type), {}
    joined: dict[str, tuple[str, int]] = {}  # a row block "name:label" (export joins them: join_split) -> (name, first row)
    if layout.export_view is not _as_is:
        ends: dict[str, int] = {}
        for theirs, t in layout.hf.items():
            name, sep, _ = theirs.rpartition(":")
            if sep and t.dim == 0 and t.unit is None and layout.unit_dim(name) is None:
                joined[theirs] = (name, ends.get(name, 0))
                ends[name] = joined[theirs][1] + t.shape[0]
    for ours, pl in layout.placements.items():
        if len(pl.full_shape) not in (2, 3) or ours not in layout.sources:
            continue
        rows = len(pl.full_shape) - 2  # the output rows' dim ([E, out, in]: per expert)
        sizes = pl.parts or (pl.full_shape[rows],)
        blocks, start = [], 0
        for (theirs, offset), n in zip(layout.parts(ours), sizes):
            t = layout.hf[theirs]
            if (t.dim != rows and len(t.pieces) > 1) or t.unit is not None or t.copy:
                break
            name, first = joined.get(theirs, (theirs, 0))
            blocks.append((name, first + offset, start, n))
            start += n
        else:
            out[ours] = blocks
    return out


def export_hf_state(full_state: Mapping[str, torch.Tensor], arch: HybridArch, rename: Rename = _same,
                    model_type: str | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face state dict (as ``model.state_dict()`` has it) from our full canonical state
    (all stages merged, and the family's buffers; vocab padding is already stripped by
    ``full_state``)."""
    return _state_to_hf(_Layout(arch, rename, model_type), full_state)


def _state_to_hf(layout: _Layout, full_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for theirs, t in layout.hf.items():
        pieces = []
        for ours, part in t.pieces:
            if ours not in full_state:
                raise MimoError(f"export: the state has no {ours!r} (merge the full state of every stage)")
            pl, full = layout.placements[ours], full_state[ours]
            pieces.append(full.split(pl.parts, dim=t.dim)[part] if pl.parts else full)
        joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces, t.dim)
        out[theirs] = joined if t.unit is None else joined.unsqueeze(t.unit)
    return layout.export_view(out, layout.arch)


# ---------------------------------------------------------------- one layer's rules: Qwen3-Next / Qwen3.5 (issue 48)
#
# For the qwen3_next / qwen3_5_text / qwen3_5_moe_text families, in the piece language of the module
# doc, one decoder layer at a time: Hugging Face names inside ``model.layers.{j}.``, ours inside
# ``layers.{a}.`` (a family's ``tensor_pieces`` prefixes both). ``layer_state_from_hf`` /
# ``layer_state_to_hf`` run such rules on one layer's state, through ``_Layout`` as whole models do.
#
# Gated DeltaNet (``linear_attn``; our ``G`` layer, ``mimo.llm.gdn``): ours are ``norm.weight`` (the
# pre-norm, Hugging Face's ``input_layernorm``: zero-centred in both, ``arch.norm_zero_centred``),
# ``mixer.in_proj_weight`` = q | k | v | z | b | a (parts 0-5, heads in order), ``mixer.conv_weight``
# = q | k | v (parts 0-2; Hugging Face's ``conv1d.weight`` [C, 1, K]), ``mixer.dt_bias``,
# ``mixer.A_log``, ``mixer.norm_weight`` (the gated output norm, ``linear_attn.norm.weight``: a
# plain weight, ones, in both families) and ``mixer.out_proj.weight``.
#
#     qwen3_5     in_proj_qkv = q | k | v, in_proj_z, in_proj_b, in_proj_a: whole parts
#     qwen3_next  in_proj_qkvz and in_proj_ba grouped per key head g (of H; r = v_heads / H value
#                 heads each, value heads g*r .. g*r+r-1, as fix_query_key_value_ordering reads
#                 them): qkvz rows [q_g (dk) | k_g (dk) | v_g (r*dv) | z_g (r*dv)] for g = 0 .. H-1,
#                 ba rows [b_g (r) | a_g (r)]. ``qwen3_next_gdn_view`` shows each as its label
#                 blocks ``in_proj_qkvz.weight:q`` (q_0 | q_1 | ..., our part 0) etc., lazily;
#                 ``qwen3_next_gdn_join`` groups them again on export.
#
# The MoE block (Qwen3-Next, Qwen3.5-MoE) is Qwen2-MoE's: router ``mlp.gate``, fused experts, the
# shared expert and its sigmoid ``shared_expert_gate`` (``moe_layer_pieces``).

GDN_UNIT_DIM = {"linear_attn.conv1d.weight": 1}  # Hugging Face's [C, 1, K] is our [C, K]
GDN_GROUPED = {"linear_attn.in_proj_qkvz.weight": "qkvz", "linear_attn.in_proj_ba.weight": "ba"}  # qwen3_next
_GDN_IN_PART = {label: part for part, label in enumerate("qkvzba")}  # label -> part of mixer.in_proj_weight
GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def gdn_layer_pieces(model_type: str, norm: bool = True) -> dict[str, tuple[Piece, ...]]:
    """A ``linear_attn`` decoder layer's Gated DeltaNet tensors -> pieces of our ``G`` layer, in
    Hugging Face's ``state_dict`` order (then ``input_layernorm``, with ``norm``)."""
    if model_type not in GDN_MODEL_TYPES:
        raise MimoError(f"no Gated DeltaNet rules for model_type {model_type!r} (known: {', '.join(GDN_MODEL_TYPES)})")
    inp, la = "mixer.in_proj_weight", "linear_attn."
    conv = {la + "conv1d.weight": tuple(("mixer.conv_weight", p) for p in range(3))}
    head = {la + "dt_bias": (("mixer.dt_bias", 0),), la + "A_log": (("mixer.A_log", 0),)}
    tail = {la + "norm.weight": (("mixer.norm_weight", 0),), la + "out_proj.weight": (("mixer.out_proj.weight", 0),)}
    if model_type == "qwen3_next":
        proj = {f"{name}:{label}": ((inp, _GDN_IN_PART[label]),) for name, labels in GDN_GROUPED.items() for label in labels}
        out = {**head, **conv, **proj, **tail}
    else:
        proj = {la + "in_proj_qkv.weight": ((inp, 0), (inp, 1), (inp, 2)),
                **{f"{la}in_proj_{x}.weight": ((inp, _GDN_IN_PART[x]),) for x in "zba"}}
        out = {**head, **conv, **tail, **proj}
    if norm:
        out["input_layernorm.weight"] = (("norm.weight", 0),)
    return out


def gdn_grouped_rows(arch: HybridArch, name: str) -> dict[str, torch.Tensor]:
    """Qwen3-Next's grouped ``name`` (a ``GDN_GROUPED`` key, or a name ending with one): each
    label's rows of it, in our order (key head 0's, then 1's, ...)."""
    suffix = _grouped_suffix(name)
    if suffix is None:
        raise MimoError(f"{name!r} is not one of Qwen3-Next's grouped Gated DeltaNet tensors ({', '.join(GDN_GROUPED)})")
    groups, r = arch.gdn_heads, arch.gdn_v_heads // arch.gdn_heads
    dk, dv = arch.gdn_head_dim, arch.gdn_v_head_dim
    size = {"q": dk, "k": dk, "v": r * dv, "z": r * dv, "b": r, "a": r}
    labels = GDN_GROUPED[suffix]
    block = sum(size[x] for x in labels)
    out, lo = {}, 0
    for x in labels:
        out[x] = (torch.arange(groups)[:, None] * block + lo + torch.arange(size[x])).reshape(-1)
        lo += size[x]
    return out


def _grouped_suffix(name: str) -> str | None:
    return next((k for k in GDN_GROUPED if name == k or name.endswith("." + k)), None)


class _RowsAt:
    """The rows ``rows`` of a tensor (its other dims ``rest``), indexable by a tuple of slices:
    reads each contiguous run of the rows asked for."""

    def __init__(self, source, rows: torch.Tensor, rest: tuple[int, ...]):
        self.source, self.rows, self.shape = source, rows, (len(rows), *rest)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        want = self.rows[index[0]].tolist()
        runs, start = [], 0
        for i in range(1, len(want) + 1):
            if i == len(want) or want[i] != want[i - 1] + 1:
                runs.append(self.source[(slice(want[start], want[i - 1] + 1), *index[1:])])
                start = i
        return runs[0] if len(runs) == 1 else torch.cat(runs)


def qwen3_next_gdn_view(arch: HybridArch, keys: Iterable[str], shapes: Mapping[str, tuple[int, ...]], get: Getter,
                        source: str = "checkpoint") -> tuple[dict[str, tuple[int, ...]], Getter]:
    """(shapes, get) with each grouped ``in_proj_qkvz`` / ``in_proj_ba`` tensor as its label
    blocks (``gdn_layer_pieces``' names), lazily; everything else as it is. A grouped tensor of
    the wrong shape is a MimoError naming it."""
    out_shapes: dict[str, tuple[int, ...]] = {}
    sources: dict[str, Callable[[], object]] = {}
    for key in keys:
        if _grouped_suffix(key) is None:
            out_shapes[key], sources[key] = tuple(shapes[key]), (lambda key=key: get(key))
            continue
        rows = gdn_grouped_rows(arch, key)
        need = (sum(len(r) for r in rows.values()), arch.hidden)
        if tuple(shapes[key]) != need:
            per_head = " | ".join(f"{x} {len(r) // arch.gdn_heads}" for x, r in rows.items())
            raise MimoError(f"{source}: tensor {key!r} has shape {tuple(shapes[key])}, but the model needs {need} "
                            f"({arch.gdn_heads} key heads of rows {per_head})")
        for label, idx in rows.items():
            out_shapes[f"{key}:{label}"] = (len(idx), arch.hidden)
            sources[f"{key}:{label}"] = lambda key=key, idx=idx: _RowsAt(get(key), idx, (arch.hidden,))
    return out_shapes, lambda name: sources[name]()


def qwen3_next_gdn_join(state: Mapping[str, torch.Tensor], arch: HybridArch) -> dict[str, torch.Tensor]:
    """``qwen3_next_gdn_view``'s inverse on export: each grouped tensor from its label blocks
    (at the place of its first block); everything else as it is."""
    out: dict[str, torch.Tensor | None] = {}
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        real, sep, label = name.rpartition(":")
        if not sep or _grouped_suffix(real) is None:
            out[name] = t
            continue
        if real not in blocks:
            blocks[real], out[real] = {}, None
        blocks[real][label] = t
    for real, parts in blocks.items():
        rows = gdn_grouped_rows(arch, real)
        if sorted(parts) != sorted(rows):
            raise MimoError(f"export: {real!r} needs the blocks {', '.join(rows)}, got {', '.join(parts)}")
        first = parts[next(iter(rows))]
        joined = first.new_empty((sum(len(r) for r in rows.values()), *first.shape[1:]))
        for label, idx in rows.items():
            joined[idx] = parts[label]
        out[real] = joined
    return out


def moe_layer_pieces(arch: HybridArch, experts_first: bool = False, norm: bool = True) -> dict[str, tuple[Piece, ...]]:
    """A decoder layer's MoE tensors (``mlp.``: the decoder families' rules, ``_moe_pieces``) ->
    pieces of our ``E`` layer, then ``post_attention_layernorm`` (with ``norm``)."""
    strip = lambda ours: ours.format(m=0).removeprefix("layers.0.")  # noqa: E731
    out = {theirs: tuple((strip(o), p) for o, p in pieces) for theirs, pieces in _moe_pieces(arch, experts_first)}
    if norm:
        out["post_attention_layernorm.weight"] = (("norm.weight", 0),)
    return out


def layer_placements(arch: HybridArch, kind: str) -> dict[str, ParamPlacement]:
    """Full placements of one layer of ``kind`` (``LAYER_KINDS``' values) of ``arch``, by our
    names inside the layer (built on the meta device)."""
    with torch.device("meta"):
        layer = build_layer(arch, LayerSpec(0, kind))
    return {name: info.placement for name, info in param_table(layer).items()}


def layer_state_from_hf(placements: Mapping[str, ParamPlacement], pieces: Mapping[str, tuple[Piece, ...]],
                        state: Mapping[str, object], unit_dim: Callable[[str], int | None] = _no_unit_dim,
                        source: str = "state") -> dict[str, torch.Tensor]:
    """One layer's full state from its Hugging Face tensors (``state``: ``pieces``' names; each
    a tensor or anything indexable by a tuple of slices), checked first (``check_hf_tensors``'
    messages). Every value has a ``shape``."""
    layout = _Layout(None, placements=placements, tensor_pieces=pieces, unit_dim=unit_dim)
    _check(layout, {n: tuple(t.shape) for n, t in state.items()}, source)
    return _state_from_hf(layout, state)


def layer_state_to_hf(placements: Mapping[str, ParamPlacement], pieces: Mapping[str, tuple[Piece, ...]],
                      state: Mapping[str, torch.Tensor], unit_dim: Callable[[str], int | None] = _no_unit_dim
                      ) -> dict[str, torch.Tensor]:
    """``layer_state_from_hf``'s inverse: Hugging Face tensors under ``pieces``' names."""
    return _state_to_hf(_Layout(None, placements=placements, tensor_pieces=pieces, unit_dim=unit_dim), state)


def gdn_layer_from_hf(state: Mapping[str, torch.Tensor], arch: HybridArch, model_type: str) -> dict[str, torch.Tensor]:
    """Our ``G`` layer's full state from one Hugging Face decoder layer's Gated DeltaNet tensors
    (names inside ``model.layers.{j}.``: ``linear_attn.*`` and ``input_layernorm.weight``)."""
    pieces = gdn_layer_pieces(model_type)
    if model_type == "qwen3_next":
        shapes, get = qwen3_next_gdn_view(arch, state, {n: tuple(t.shape) for n, t in state.items()}, state.__getitem__)
        state = {n: get(n) for n in shapes}
    return layer_state_from_hf(layer_placements(arch, "gdn"), pieces, state, GDN_UNIT_DIM.get)


def gdn_layer_to_hf(state: Mapping[str, torch.Tensor], arch: HybridArch, model_type: str) -> dict[str, torch.Tensor]:
    """``gdn_layer_from_hf``'s inverse, in Hugging Face's ``state_dict`` order."""
    out = layer_state_to_hf(layer_placements(arch, "gdn"), gdn_layer_pieces(model_type), state, GDN_UNIT_DIM.get)
    return qwen3_next_gdn_join(out, arch) if model_type == "qwen3_next" else out


# ---------------------------------------------------------------- Qwen3-Next and Qwen3.5's text models (issue 48)
#
# ``Qwen3NextForCausalLM`` (qwen3_next), ``Qwen3_5ForCausalLM`` (qwen3_5_text) and
# ``Qwen3_5MoeForCausalLM`` (qwen3_5_moe_text; these two are also the language models of Qwen3.5's
# VLMs: the Qwen3-VL section below). A decoder layer ``j`` is our layers ``2j`` (``G`` for
# ``linear_attention``, ``*`` for ``full_attention``: gated attention, per-head zero-centred QK-norm,
# partial rotary) and ``2j+1`` (``E`` or ``-``). Every norm is zero-centred
# (``arch.norm_zero_centred``); the GDN's gated output norm is plain. What tells them apart
# (``GATED_FAMILIES``):
#
#     qwen3_next        ``E`` or ``-`` as ``mlp_only_layers`` / ``decoder_sparse_step`` / ``num_experts``
#                       say (Qwen2-MoE's block: softmax top-k renormalised as ``norm_topk_prob`` says,
#                       a shared expert with its sigmoid gate); grouped GDN projections; 1-D RoPE
#     qwen3_5_text      ``-`` in every layer; split GDN projections (``gdn_layer_pieces("qwen3_5")``);
#                       M-RoPE (``rope_parameters``' ``mrope_section``, default [11, 11, 10], over the
#                       rotary channels, interleaved whatever ``mrope_interleaved`` says, as
#                       transformers computes it; a text-only input rotates every axis alike)
#     qwen3_5_moe_text  ``E`` in every layer (Qwen3-Next's block, top-k always renormalised: no
#                       ``mlp_only_layers``, ``decoder_sparse_step``, ``norm_topk_prob`` or
#                       ``intermediate_size``); otherwise as qwen3_5_text
#
# Keys a config.json may leave out take the transformers config class's defaults
# (``GatedFamily.defaults``). ``mtp.*`` tensors (multi-token prediction) are not mapped here.


@dataclass(frozen=True)
class GatedFamily:
    """One Gated DeltaNet family (the table above)."""

    decoder: Decoder  # experts None: every layer dense; sparse_layers False: every layer MoE; mrope
    defaults: Mapping  # transformers' config defaults of the keys a config.json may leave out
    gdn: str  # ``gdn_layer_pieces``' rules: "qwen3_next" (grouped projections) or "qwen3_5" (split)
    mrope_default: tuple[int, ...] | None = None  # transformers' mrope_section where the config has none

    @property
    def dense_mlps(self) -> bool:
        """Whether its layers may be dense (its config has ``intermediate_size``)."""
        return self.decoder.experts is None or self.decoder.sparse_layers


_GATED_DEFAULTS = {  # Qwen3NextConfig's, Qwen3_5TextConfig's and Qwen3_5MoeTextConfig's alike
    "num_attention_heads": 16, "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "attention_bias": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "initializer_range": 0.02, "tie_word_embeddings": False,
}
_SHARED_EXPERT_DEFAULTS = {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                           "router_aux_loss_coef": 0.001}
QWEN3_NEXT = Decoder("Qwen3NextForCausalLM", qk_norm="head", experts="num_experts", sparse_layers=True, shared=True)
QWEN3_NEXT_DEFAULTS = {
    **_GATED_DEFAULTS, **_SHARED_EXPERT_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 48, "num_key_value_heads": 2, "decoder_sparse_step": 1, "num_experts_per_tok": 10,
    "num_experts": 512, "norm_topk_prob": True, "mlp_only_layers": [],
}
GATED_FAMILIES = {
    "qwen3_next": GatedFamily(QWEN3_NEXT, QWEN3_NEXT_DEFAULTS, "qwen3_next"),
    "qwen3_5_text": GatedFamily(
        Decoder("Qwen3_5ForCausalLM", qk_norm="head", mrope=True),
        {**_GATED_DEFAULTS, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
         "num_hidden_layers": 32, "num_key_value_heads": 4}, "qwen3_5", (11, 11, 10)),
    "qwen3_5_moe_text": GatedFamily(
        Decoder("Qwen3_5MoeForCausalLM", qk_norm="head", experts="num_experts", shared=True, norm_topk=True,
                mrope=True),
        {**_GATED_DEFAULTS, **_SHARED_EXPERT_DEFAULTS, "vocab_size": 248320, "hidden_size": 2048,
         "num_hidden_layers": 40, "num_key_value_heads": 2, "num_experts_per_tok": 8, "num_experts": 256},
        "qwen3_5", (11, 11, 10)),
}
_QWEN3_NEXT_MIXERS = {"linear_attention": "G", "full_attention": "*"}


def _gated_family(model_type: str) -> GatedFamily:
    if model_type not in GATED_FAMILIES:
        raise MimoError(f"model_type {model_type!r} is not a Gated DeltaNet family ({', '.join(GATED_FAMILIES)})")
    return GATED_FAMILIES[model_type]


def _qwen3_next_config(cfg: Mapping, model_type: str = "qwen3_next") -> dict:
    """``cfg`` with the family's defaults for the keys it leaves out (``layer_types``: every
    ``full_attention_interval``-th layer full attention, the rest linear)."""
    out = {**_gated_family(model_type).defaults,
           **{k: v for k, v in cfg.items() if v is not None or k == "mlp_only_layers"}}
    out["mlp_only_layers"] = list(out.get("mlp_only_layers") or [])
    if not cfg.get("layer_types"):
        every = int(cfg.get("full_attention_interval", 4))
        out["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention"
                              for i in range(int(out["num_hidden_layers"]))]
    return out


def _partial_rotary(cfg: Mapping) -> float:
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))


def qwen3_next_arch_from_config(cfg: Mapping, pattern_stages: Iterable[int] | None = None,
                                model_type: str = "qwen3_next") -> HybridArch:
    """Our ``HybridArch`` of a ``config.json`` dict of a Gated DeltaNet family (``model_type``:
    qwen3_next, qwen3_5_text or qwen3_5_moe_text)."""
    fam = _gated_family(model_type)
    d, cfg = fam.decoder, _qwen3_next_config(cfg, model_type)
    _reject_decoder_config(d, model_type, cfg)
    layers = int(cfg["num_hidden_layers"])
    types = list(cfg["layer_types"])
    if len(types) != layers or any(t not in _QWEN3_NEXT_MIXERS for t in types):
        raise MimoError(f"{model_type}: layer_types must be {layers} of {', '.join(_QWEN3_NEXT_MIXERS)}; got {types}")
    symbols = _mlp_symbols(d, model_type, cfg, layers)
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope_from_hf(cfg)
    bias = bool(cfg["attention_bias"])
    return HybridArch(
        pattern=with_stages([_QWEN3_NEXT_MIXERS[t] + s for t, s in zip(types, symbols)], pattern_stages),
        hidden=int(cfg["hidden_size"]), heads=heads, vocab=int(cfg["vocab_size"]),
        kv_heads=int(cfg["num_key_value_heads"]), head_dim=int(cfg["head_dim"]),
        ffn=int(cfg["intermediate_size"]) if fam.dense_mlps else None,  # None: unused (every layer MoE)
        mlp_act="swiglu", qk_norm=True, attention_bias=bias, qkv_bias=bias, o_bias=bias,
        tie_embeddings=bool(cfg["tie_word_embeddings"]), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(cfg["rms_norm_eps"]), max_seq_len=int(cfg["max_position_embeddings"]),
        init_std=float(cfg["initializer_range"]),
        gdn_heads=int(cfg["linear_num_key_heads"]), gdn_v_heads=int(cfg["linear_num_value_heads"]),
        gdn_head_dim=int(cfg["linear_key_head_dim"]), gdn_v_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg["linear_conv_kernel_dim"]),
        moe=_moe_from_config(d, cfg) if "E" in symbols else None,
        norm_zero_centred=True, attn_output_gate=True, rotary_fraction=_partial_rotary(cfg),
        mrope_section=_mrope_from_hf(cfg, fam.mrope_default) if d.mrope else None,
    )


def qwen3_next_layers(arch: HybridArch) -> list[tuple[str, str]]:
    """(mixer 'G' or '*', MLP '-' or 'E') of each Hugging Face decoder layer of ``arch``;
    MimoError unless the pattern is such pairs."""
    kinds = [layer.kind for layer in arch.layer_pattern().layers]
    pairs = [tuple(kinds[i : i + 2]) for i in range(0, len(kinds), 2)]
    symbol = {"gdn": "G", "attention": "*", "mlp": "-", "moe": "E"}
    if len(kinds) % 2 or any(len(p) != 2 or p[0] not in ("gdn", "attention") or p[1] not in ("mlp", "moe")
                             for p in pairs):
        raise MimoError(f"Qwen3-Next / Qwen3.5 decoder layers are 'G' or '*' then '-' or 'E' (a Gated DeltaNet or "
                        f"attention layer and an MLP or MoE layer each); {arch.pattern!r} has other layers")
    return [(symbol[a], symbol[m]) for a, m in pairs]


def _gated_problems(fam: GatedFamily, model_type: str, arch: HybridArch, symbols: list[str]) -> list[str]:
    """What in ``arch`` the family cannot express (``_decoder_problems``' and its own)."""
    d = fam.decoder
    if d.sparse_layers and "E" not in symbols:
        d = replace(d, experts=None)  # Qwen3-Next without experts (num_experts 0): every layer dense
    problems = _decoder_problems(d, model_type, arch, symbols)
    want = {"norm_zero_centred": True, "attn_output_gate": True, "mlp_act": "swiglu", "mlp_bias": False}
    problems += [f"{model_type} needs arch.{k}: {v!r}, got {getattr(arch, k)!r}" for k, v in want.items()
                 if getattr(arch, k) != v]
    problems += _qwen_mtp_problems(arch)
    if d.mrope and arch.deepstack_layers:
        problems.append(f"{model_type} has no deepstack; arch.deepstack_layers is {list(arch.deepstack_layers)}")
    if arch.rope_scaling is not None:
        problems.append(f"{model_type} export takes no arch.rope_scaling (only the default RoPE is mapped)")
    if arch.moe is not None and "E" in symbols and arch.moe.act != "swiglu":
        problems.append(f"{model_type} experts are SwiGLU; arch.moe.act is not 'swiglu'")
    return problems


def qwen3_next_config_from_arch(arch: HybridArch, model_type: str = "qwen3_next") -> dict:
    """The ``config.json`` dict of ``arch`` as the Gated DeltaNet family ``model_type``; MimoError
    listing what does not fit."""
    fam = _gated_family(model_type)
    layers = qwen3_next_layers(arch)
    symbols = [m for _, m in layers]
    problems = _gated_problems(fam, model_type, arch, symbols)
    if problems:
        raise MimoError(f"{model_type} export: " + "; ".join(problems))
    rope = {"rope_theta": arch.rope_theta, "rope_type": "default", "partial_rotary_factor": arch.rotary_fraction}
    if fam.decoder.mrope:
        rope.update(_mrope_to_hf(arch))
    cfg = {
        "model_type": model_type, "architectures": [fam.decoder.architecture],
        "vocab_size": arch.vocab, "hidden_size": arch.hidden,
        "num_hidden_layers": len(layers), "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads,
        "head_dim": arch.head_dim, "hidden_act": "silu", "max_position_embeddings": arch.max_seq_len,
        "rms_norm_eps": arch.norm_eps, "attention_bias": bool(arch.o_bias), "tie_word_embeddings": arch.tie_embeddings,
        "initializer_range": arch.init_std, "rope_parameters": rope,
        "layer_types": ["linear_attention" if a == "G" else "full_attention" for a, _ in layers],
        "linear_num_key_heads": arch.gdn_heads, "linear_num_value_heads": arch.gdn_v_heads,
        "linear_key_head_dim": arch.gdn_head_dim, "linear_value_head_dim": arch.gdn_v_head_dim,
        "linear_conv_kernel_dim": arch.conv_kernel,
    }
    if fam.dense_mlps:
        cfg["intermediate_size"] = arch.ffn or 0
    cfg.update(_gated_moe_config(fam, arch, symbols))
    if arch.mtp is not None:  # (the key Qwen's released configs carry; transformers keeps it as is)
        cfg["mtp_num_hidden_layers"] = 1
    return cfg


def _gated_moe_config(fam: GatedFamily, arch: HybridArch, symbols: list[str]) -> dict:
    """The MoE keys of a Gated DeltaNet family's config.json (none for a dense family)."""
    d, m = fam.decoder, arch.moe if "E" in symbols else None
    if m is None:  # Qwen3-Next without experts: num_experts 0 makes every layer dense
        return {"num_experts": 0, "num_experts_per_tok": 1, "decoder_sparse_step": 1,
                "mlp_only_layers": []} if d.sparse_layers else {}
    out = {"num_experts": m.experts, "num_experts_per_tok": m.topk, "moe_intermediate_size": m.ffn,
           "shared_expert_intermediate_size": m.shared_ffn,
           "router_aux_loss_coef": m.aux_loss.coeff if m.aux_loss.kind != "none" else 0.0}
    if d.sparse_layers:  # Qwen3-Next: its dense layers by index
        out.update(decoder_sparse_step=1, mlp_only_layers=[j for j, s in enumerate(symbols) if s == "-"])
    if d.norm_topk is None:
        out["norm_topk_prob"] = m.norm_topk
    return out


def qwen3_next_tensor_pieces(arch: HybridArch, rename: Rename = _same,
                             model_type: str = "qwen3_next") -> dict[str, tuple[Piece, ...]]:
    """Every tensor of the family's ``*ForCausalLM`` of ``arch`` -> its pieces, in its
    ``state_dict`` order (Qwen3-Next's grouped GDN projections as ``qwen3_next_gdn_view``'s label
    blocks)."""
    fam = _gated_family(model_type)
    out: dict[str, tuple[Piece, ...]] = {"model.embed_tokens.weight": (("embed.weight", 0),)}
    gdn = [(theirs, tuple(("layers.{a}." + o, p) for o, p in pieces))
           for theirs, pieces in gdn_layer_pieces(fam.gdn, norm=False).items()]
    for j, (mixer, mlp) in enumerate(qwen3_next_layers(arch)):
        body = gdn if mixer == "G" else _attention_pieces(arch)
        body = body + (_moe_pieces(arch, fam.decoder.experts_first) if mlp == "E" else _mlp_pieces(arch))
        norms = [("input_layernorm.weight", (("layers.{a}.norm.weight", 0),)),
                 ("post_attention_layernorm.weight", (("layers.{m}.norm.weight", 0),))]
        for theirs, pieces in body + norms:
            out[f"model.layers.{j}.{theirs}"] = tuple((o.format(a=2 * j, m=2 * j + 1), p) for o, p in pieces)
    out["model.norm.weight"] = (("norm.weight", 0),)
    out[TIED_HEAD] = (("embed.weight" if arch.tie_embeddings else "head.weight", 0),)
    if arch.mtp is not None:
        out.update(qwen_mtp_pieces(arch, fam))
    return {(k if k.startswith(MTP_PREFIX) else rename(k)): v for k, v in out.items()}  # mtp.*: top level in every form


MTP_PREFIX = "mtp."  # Qwen3-Next / Qwen3.5's multi-token prediction tensors (transformers drops them on load)
_QWEN_MTP_BLOCKS = ("*E", "*-")


def _qwen_mtp_problems(arch: HybridArch) -> list[str]:
    """Why ``arch.mtp`` is not Qwen's ``mtp.*`` module (one depth: fc, two pre-fc norms, one
    decoder layer of full attention then the model's MLP kind, a norm); [] if it is."""
    m = arch.mtp
    if m is None:
        return []
    want = "*E" if arch.moe is not None and "E" in arch.pattern else "*-"
    problems = [] if m.depth == 1 else [f"Qwen's mtp.* is one depth; arch.mtp.depth is {m.depth}"]
    if m.block(arch) != want:
        problems.append(f"Qwen's mtp.* layer is full attention then {'MoE' if want == '*E' else 'an MLP'} "
                        f"({want!r}); arch.mtp's block is {m.block(arch)!r}")
    return problems


def qwen_mtp_pieces(arch: HybridArch, fam: "GatedFamily") -> dict[str, tuple[Piece, ...]]:
    """Qwen's ``mtp.*`` tensors -> our ``mtp.0.*`` pieces (``mimo.llm.mtp``): ``fc`` over
    [embedding | hidden], ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden``, one decoder layer
    (our attention and MLP / MoE layers numbered after the pattern's), ``norm``."""
    problems = _qwen_mtp_problems(arch)
    if problems:
        raise MimoError("arch.mtp: " + "; ".join(problems))
    ((a, m),) = [[s.index for s in depth] for depth in arch.mtp_layers()]
    mlp = _moe_pieces(arch, fam.decoder.experts_first) if arch.mtp.block(arch) == "*E" else _mlp_pieces(arch)
    norms = [("input_layernorm.weight", (("layers.{a}.norm.weight", 0),)),
             ("post_attention_layernorm.weight", (("layers.{m}.norm.weight", 0),))]
    out = {"mtp.fc.weight": (("mtp.0.fc.weight", 0),),
           "mtp.pre_fc_norm_embedding.weight": (("mtp.0.norm_embed.weight", 0),),
           "mtp.pre_fc_norm_hidden.weight": (("mtp.0.norm_hidden.weight", 0),)}
    for theirs, pieces in _attention_pieces(arch) + mlp + norms:
        out[f"mtp.layers.0.{theirs}"] = tuple((("mtp.0." + o).format(a=a, m=m), p) for o, p in pieces)
    out["mtp.norm.weight"] = (("mtp.0.norm.weight", 0),)
    return out


def with_checkpoint_mtp(arch: HybridArch, keys: Iterable[str]) -> HybridArch:
    """``arch`` with Qwen's MTP module where the checkpoint holds ``mtp.*`` tensors (transformers
    saves none: a config's ``mtp_num_hidden_layers`` alone says nothing of the file), else
    without; for the arch ``import-hf`` writes. A family may keep its MTP module otherwise (its
    ``checkpoint_mtp``: DeepSeek-V3's decoder layers past the last)."""
    own = family(hf_model_type(replace(arch, mtp=None))).checkpoint_mtp
    if own is not None:
        return own(arch, keys)
    has = any(k.startswith(MTP_PREFIX) for k in keys)
    return replace(arch, mtp=(arch.mtp or MTPArch()) if has else None)


def qwen3_next_checkpoint_view(arch: HybridArch | None, keys: Iterable[str], shapes: Mapping[str, tuple[int, ...]],
                               get: Getter):
    """``decoder_checkpoint_view`` (per-expert tensors stacked), then the grouped GDN projections
    as their label blocks (``qwen3_next_gdn_view``)."""
    shapes, get = decoder_checkpoint_view(arch, keys, shapes, get)
    if arch is None:
        return shapes, get
    return qwen3_next_gdn_view(arch, list(shapes), shapes, get)


def _qwen3_next_unit_dim(name: str) -> int | None:
    return next((d for k, d in GDN_UNIT_DIM.items() if name.endswith("." + k)), None)


def _gated_hf_family(model_type: str) -> HFFamily:
    """The seam's functions of a Gated DeltaNet family: Qwen3-Next's grouped GDN projections
    viewed as label blocks on import and joined on export; Qwen3.5's split ones as they are."""
    fam = _gated_family(model_type)
    grouped = fam.gdn == "qwen3_next"
    return HFFamily(
        fam.decoder.architecture,
        lambda cfg, pattern_stages=None: qwen3_next_arch_from_config(cfg, pattern_stages, model_type),
        qwen3_next_config_from_arch,
        lambda arch, rename=_same: qwen3_next_tensor_pieces(arch, rename, model_type),
        qwen3_next_checkpoint_view if grouped else decoder_checkpoint_view,
        _qwen3_next_unit_dim,
        qwen3_next_gdn_join if grouped else _as_is,
    )


HF_FAMILIES.update({t: _gated_hf_family(t) for t in GATED_FAMILIES})
SUPPORTED.update({t: HF_FAMILIES[t].architecture for t in GATED_FAMILIES})


# ---------------------------------------------------------------- checkpoints


def _hf_float(obj: dict):
    """transformers 5 writes a non-finite float as ``{"__float__": "Infinity"}``."""
    return float(obj["__float__"]) if set(obj) == {"__float__"} else obj


def read_config_json(path: str) -> dict:
    """A ``config.json`` as a dict, Hugging Face's encoded non-finite floats decoded."""
    with open(path) as f:
        try:
            return json.load(f, object_hook=_hf_float)
        except json.JSONDecodeError as e:
            raise MimoError(f"{path}: not valid JSON ({e})") from None


class HFCheckpoint:
    """A Hugging Face checkpoint directory: ``config.json`` plus ``*.safetensors`` (read lazily)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise MimoError(f"{path!r} is not a Hugging Face checkpoint directory: no config.json")
        self.config = read_config_json(config_file)
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


# ---------------------------------------------------------------- Qwen3-VL's (and Qwen3.5's) language model

# a Qwen3-VL / Qwen3.5 config's model_type -> (its transformers config class, the family of its text model);
# Kimi-K2.5's (a DeepSeek-V3 language model beside the MoonViT tower) is laid out alike
QWEN3_VL = {"qwen3_vl": ("Qwen3VLConfig", "qwen3_vl_text"), "qwen3_vl_moe": ("Qwen3VLMoeConfig", "qwen3_vl_moe_text"),
            "qwen3_5": ("Qwen3_5Config", "qwen3_5_text"), "qwen3_5_moe": ("Qwen3_5MoeConfig", "qwen3_5_moe_text"),
            "kimi_k25": ("Kimi_K25Config", "deepseek_v3")}
QWEN3_VL_LM = ("model.language_model.", "lm_head.weight")  # where the causal LM's "model." and head sit
# other namings of such a language model in checkpoints, (body, head, decoder layers' name): Kimi-K2.5's
# published checkpoints, and transformers' save_pretrained of Kimi-K2.5 (the reverse of its renaming of
# MoonViT's "blocks" also names the decoder layers "blocks")
VLM_LM_NAMINGS = {"kimi_k25": (("language_model.model.", "language_model.lm_head.weight", "layers."),
                               ("language_model.model.", "language_model.lm_head.weight", "blocks."))}


def is_qwen3_vl_lm_key(name: str) -> bool:
    """Whether a Qwen3-VL / Qwen3.5 checkpoint key is the language model's (its MTP's included)."""
    return name.startswith((QWEN3_VL_LM[0], MTP_PREFIX)) or name == QWEN3_VL_LM[1]


def qwen3_vl_lm_key(name: str) -> str:
    """A causal-LM key (``model.layers.0....``, ``lm_head.weight``) -> its key in a Qwen3-VL state dict."""
    return llava_lm_key(name, *QWEN3_VL_LM)


def normalised_qwen3_vl_config(config: Mapping) -> dict:
    """A ``config.json`` of one of ``QWEN3_VL``'s model types with transformers' defaults filled in."""
    import transformers

    model_type = config.get("model_type")
    if model_type not in QWEN3_VL:
        raise MimoError(f"model_type {model_type!r} is not a Qwen3-VL / Qwen3.5 config "
                        f"({', '.join(map(repr, QWEN3_VL))})")
    cls = getattr(transformers, QWEN3_VL[model_type][0])
    try:
        return cls(**{k: v for k, v in config.items() if k != "model_type"}).to_dict()
    except (TypeError, ValueError) as e:
        raise MimoError(f"the {model_type} config is not valid for transformers' {cls.__name__}: {e}") from None


def qwen3_vl_text_config(config: Mapping) -> dict:
    """The language model's config inside a Qwen3-VL / Qwen3.5 ``config.json`` (defaults filled in),
    its ``model_type`` the family's (``QWEN3_VL``) and its tie flag the top level's (what
    transformers ties by; the MoE text config's own default says otherwise)."""
    whole = normalised_qwen3_vl_config(config)
    return {**whole["text_config"], "model_type": QWEN3_VL[config["model_type"]][1],
            "tie_word_embeddings": bool(whole.get("tie_word_embeddings", False))}


def qwen3_vl_arch(config: Mapping, pattern_stages: Iterable[int] | None = None) -> HybridArch:
    """Our ``HybridArch`` of a whole Qwen3-VL / Qwen3.5 (or their MoE's) ``config.json`` dict: its
    text model's (M-RoPE sections included) with one deepstack level per entry of the vision
    config's ``deepstack_visual_indexes`` (Qwen3.5: none), added after decoder layers 0, 1, ...
    (``deepstack_layers`` 1, 3, ...; ``pattern_stages``: decoder layers per explicit pipeline
    stage, the deepstack ones on the first)."""
    whole, text = normalised_qwen3_vl_config(config), qwen3_vl_text_config(config)
    arch = arch_from_hf_config(text, pattern_stages)
    # Qwen3.5's language models (the gated families) take no deepstack, whatever its vision config carries
    levels = 0 if text["model_type"] in GATED_FAMILIES else len(whole["vision_config"].get("deepstack_visual_indexes") or ())
    arch.deepstack_layers = deepstack_after_decoder_layers(levels)
    if max(arch.deepstack_layers, default=-1) >= len(arch.layer_pattern().layers):
        raise MimoError(f"{levels} deepstack levels (vision_config.deepstack_visual_indexes) need as many decoder "
                        f"layers; the text model has {len(arch.layer_pattern().layers) // 2}")
    return arch


def qwen3_vl_text_from_hf(state: Mapping[str, torch.Tensor], arch: HybridArch,
                          model_type: str | None = None) -> dict[str, torch.Tensor]:
    """Our full canonical state of the language model in a Qwen3-VL / Qwen3.5 state dict (the whole
    model's ``state_dict()``, or a checkpoint's tensors: per-expert or transposed fused experts
    read too); its other tensors are ignored. MimoError naming a missing or misfit tensor."""
    model_type = hf_model_type(arch) if model_type is None else model_type
    keys = [k for k in state if is_qwen3_vl_lm_key(k)]
    shapes, get = family(model_type).checkpoint_view(arch, keys, {k: tuple(state[k].shape) for k in keys},
                                                     state.__getitem__)
    layout = _Layout(arch, qwen3_vl_lm_key, model_type)
    _check(layout, shapes, "the Qwen3-VL state")
    return {ours: layout.reader(ours, get)(tuple(slice(0, n) for n in layout.placements[ours].full_shape))
            for ours in layout.sources}


def qwen3_vl_text_to_hf(full_state: Mapping[str, torch.Tensor], arch: HybridArch,
                        model_type: str | None = None) -> dict[str, torch.Tensor]:
    """The language model's tensors of a Qwen3-VL / Qwen3.5 ``state_dict()`` (``model.language_model.*``
    and ``lm_head.weight``, a tied one included as the state dict has it) from our full
    canonical state."""
    return export_hf_state(full_state, arch, qwen3_vl_lm_key, model_type)


def vlm_lm_naming(model_type: str, keys: Iterable[str]) -> tuple[Rename, list[str]]:
    """(causal-LM name -> checkpoint name, the checkpoint's language-model keys) of the language
    model in a checkpoint of a ``QWEN3_VL`` model type: under ``VLM_LM_NAMINGS``' naming whose
    decoder layers the keys hold, else transformers' ``state_dict`` names (``qwen3_vl_lm_key``)."""
    keys = list(keys)
    for body, head, layers in VLM_LM_NAMINGS.get(model_type, ()):
        if any(k.startswith(body + layers) for k in keys):
            def rename(name: str, body=body, head=head, layers=layers) -> str:
                key = llava_lm_key(name, body, head)
                return body + layers + key[len(body) + len("layers."):] if key.startswith(body + "layers.") else key

            return rename, [k for k in keys if k.startswith(body) or k == head]
    return qwen3_vl_lm_key, [k for k in keys if is_qwen3_vl_lm_key(k)]


def language_model_of(ckpt: HFCheckpoint) -> tuple[dict, Rename, list[str]]:
    """(causal-LM config, causal-LM name -> checkpoint name, the checkpoint's language-model
    keys) of a causal-LM checkpoint, or of the language model inside a LLaVA one (either naming)
    or a Qwen3-VL / Qwen3.5 / Kimi-K2.5 one (its text config, ``qwen3_vl_text_config``; its naming,
    ``vlm_lm_naming``)."""
    config, keys = ckpt.config, ckpt.keys()
    if config.get("model_type") in QWEN3_VL:
        return (qwen3_vl_text_config(config), *vlm_lm_naming(config["model_type"], keys))
    if config.get("model_type") != "llava":
        return config, _same, keys
    config = llava_text_config(config)
    found = [pair for pair in LLAVA_LM.values() if llava_lm_key("model.embed_tokens.weight", *pair) in keys]
    if not found:
        raise MimoError(f"{ckpt.path!r}: a LLaVA config, but no language model embedding "
                        f"({' or '.join(llava_lm_key('model.embed_tokens.weight', *p) for p in LLAVA_LM.values())})")
    body, head = found[0]
    return config, lambda name: llava_lm_key(name, body, head), [k for k in keys if k.startswith(body) or k == head]


def checkpoint_tensors(ckpt: HFCheckpoint) -> tuple[dict, Rename, dict[str, tuple[int, ...]], Getter]:
    """(causal-LM config, rename, shapes, get) of a checkpoint's language model under its
    family's ``state_dict`` names (``checkpoint_view``: per-expert tensors stacked, lazily)."""
    config, rename, keys = language_model_of(ckpt)
    shapes = {k: ckpt.shape(k) for k in keys}
    shapes, get = family(config.get("model_type")).checkpoint_view(arch_from_hf_config(config), keys, shapes, ckpt.slice)
    return config, rename, shapes, get


# arch fields whose difference from the checkpoint's config.json ``load_hf_checkpoint`` only warns
# about (the weights still fit; the model computes something else than the checkpoint's)
SOFT_FIELDS = ("rope_theta", "rope_scaling", "mrope_section", "norm_eps", "tie_embeddings", "qk_norm", "qk_norm_full", "moe",
               "rotary_fraction", "norm_zero_centred")
# those that size the weights (by the layer kind that has them; None: every arch), named when the
# tensors do not fit; heads / kv_heads / head_dim refuse the checkpoint even where the shapes
# agree (the same rows split into other heads)
SIZE_FIELDS = {"vocab": None, "hidden": None, "heads": "attention", "kv_heads": "attention", "head_dim": "attention",
               "ffn": "mlp", "mamba_heads": "mamba", "mamba_head_dim": "mamba", "mamba_state": "mamba",
               "mamba_groups": "mamba", "gdn_heads": "gdn", "gdn_v_heads": "gdn", "gdn_head_dim": "gdn",
               "gdn_v_head_dim": "gdn"}
HEAD_FIELDS = ("heads", "kv_heads", "head_dim")


@dataclass(frozen=True)
class CheckedCheckpoint:
    """A Hugging Face checkpoint that fits an arch (``check_hf_checkpoint``): its causal-LM
    config and family, the arch its config.json gives, the soft differences from the configured
    arch (``SOFT_FIELDS``), and what loading it needs (nothing read yet)."""

    path: str
    model_type: str
    config: dict  # the causal LM's config.json (a LLaVA's text config)
    llava: bool
    theirs: HybridArch
    differences: tuple[str, ...]  # "arch.norm_eps=1e-05 differs from the checkpoint's config.json (1e-06)"
    layout: _Layout
    get: Getter

    @property
    def layers(self) -> int:
        """Hugging Face layers (``num_hidden_layers``)."""
        return int(self.config.get("num_hidden_layers") or 0)


def _layer_kinds(arch: HybridArch) -> list[str]:
    return [layer.kind for layer in arch.layer_pattern().layers]


def _size_differences(arch: HybridArch, theirs: HybridArch, fields: Iterable[str] = tuple(SIZE_FIELDS)) -> list[str]:
    """How the configured arch's sizes differ from the checkpoint's config.json (layer count and
    kinds, the sizes of the kinds of layers both have, experts), for messages."""
    out = []
    ours_kinds, their_kinds = _layer_kinds(arch), _layer_kinds(theirs)
    if ours_kinds != their_kinds:
        count = lambda kinds: ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))  # noqa: E731
        out.append(f"layers: {count(ours_kinds)} in arch.pattern {arch.pattern!r}, {count(their_kinds)} in the checkpoint "
                   f"({theirs.pattern!r})")
    both = set(ours_kinds) & set(their_kinds)
    for name in fields:
        if getattr(arch, name) != getattr(theirs, name) and SIZE_FIELDS[name] in (None, *both):
            out.append(f"arch.{name} is {getattr(arch, name)}, the checkpoint's {getattr(theirs, name)}")
    if arch.moe is not None and theirs.moe is not None:
        out += [f"arch.moe.{name} is {getattr(arch.moe, name)}, the checkpoint's {getattr(theirs.moe, name)}"
                for name in ("experts", "ffn", "shared_ffn") if getattr(arch.moe, name) != getattr(theirs.moe, name)]
    return out


def check_hf_checkpoint(arch: HybridArch, path: str, source: str | None = None) -> CheckedCheckpoint:
    """MimoError unless the Hugging Face checkpoint directory ``path`` (a causal LM, or the
    language model of a LLaVA checkpoint) fits ``arch``: a supported ``model_type``, every tensor
    the arch needs with its shape and none more (names and shapes from the safetensors headers:
    no tensor is read), the same heads; a misfit names the first bad tensor and the sizes
    config.json gives otherwise. What ``load_hf_checkpoint`` checks on every rank, and
    ``mimo check-config`` before any process starts (``source``: how messages name the
    checkpoint; default its path)."""
    source = path if source is None else source
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):  # an unsupported family first, before what its files hold
        model_type = read_config_json(config_file).get("model_type")
        if model_type != "llava" and model_type not in QWEN3_VL:
            family(model_type)
    ckpt = HFCheckpoint(path)
    config, rename, shapes, get = checkpoint_tensors(ckpt)
    model_type = config.get("model_type")
    theirs = arch_from_hf_config(config)
    layout = _Layout(arch, rename, model_type)
    try:
        _check(layout, shapes, source)
    except MimoError as e:
        sizes = _size_differences(arch, theirs)
        raise MimoError(f"{e}" + (f" (its config.json differs: {'; '.join(sizes)})" if sizes else "")) from None
    heads = _size_differences(arch, theirs, HEAD_FIELDS)
    if heads:
        raise MimoError(f"{source}: the tensors fit, but the heads do not: {'; '.join(heads)}")
    soft = tuple(f"arch.{f}={getattr(arch, f)!r} differs from the checkpoint's config.json ({getattr(theirs, f)!r})"
                 for f in SOFT_FIELDS if getattr(theirs, f) != getattr(arch, f))
    return CheckedCheckpoint(path, model_type, config, ckpt.config.get("model_type") == "llava", theirs, soft, layout, get)


def load_hf_checkpoint(stage: LLMStage, path: str) -> None:
    """``init: {hf: DIR}``: load a Hugging Face checkpoint directory into this rank's stage: a
    causal LM, or the language model of a LLaVA checkpoint (either key naming); checked first
    (``check_hf_checkpoint``)."""
    checked = check_hf_checkpoint(stage.arch, path)
    for difference in checked.differences:
        log.warning("%s: %s", path, difference)
    _load_checked_(stage, checked.layout, checked.get)


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
