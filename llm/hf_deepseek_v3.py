"""Hugging Face import / export of DeepSeek-V3 (``DeepseekV3ForCausalLM``, model_type ``deepseek_v3``).

Hugging Face decoder layer ``j`` is two of our layers, as in the decoder families of
``mimo.llm.hf``: multi-head latent attention ``2j`` (``+``, ``mimo.llm.mla``; its pre-norm
``input_layernorm``) and the MLP or MoE ``2j+1`` (its pre-norm ``post_attention_layernorm``). The
first ``first_k_dense_replace`` decoder layers have a dense SwiGLU MLP (``intermediate_size``),
the rest an MoE: the pattern is ``"+-"`` per dense layer, then ``"+E"`` per MoE layer (``|``
between decoder layers for explicit stages).

    self_attn  q_a_proj (+ bias), q_a_layernorm, q_b_proj (q_lora_rank set) or q_proj (q_lora_rank
               null), kv_a_proj_with_mqa (+ bias), kv_a_layernorm, kv_b_proj, o_proj (+ bias):
               our MLA's tensors of the same names; attention_bias -> arch.qkv_bias (the two down
               projections) and arch.o_bias
    mlp        dense: gate_proj | up_proj -> up_proj.weight (parts 0, 1), down_proj
               MoE: gate.weight (fp32) -> router.weight; the buffer gate.e_score_correction_bias ->
               our buffer router.expert_bias; experts.gate_up_proj [E, 2F, D] -> experts.up_proj
               (gate rows | up rows), experts.down_proj [E, D, F]; shared_experts.gate_proj |
               up_proj -> shared.up_proj, shared_experts.down_proj -> shared.down_proj
               (n_shared_experts * moe_intermediate_size)

Routing (``DeepseekV3TopkRouter``, ``mimo.llm.router``): sigmoid scores, selection on scores +
e_score_correction_bias, group-limited (n_group groups scored by their two best, the best
topk_group kept), top num_experts_per_tok, gates the unbiased scores renormalised with Hugging
Face's ``+ 1e-20`` when norm_topk_prob, times routed_scaling_factor. RoPE: DeepSeek's interleaved
pairs over the qk_rope_head_dim channels, rope_theta, and YaRN scaling (``rope_parameters`` of
transformers 5, or an older config's ``rope_scaling`` with ``type``: factor, beta_fast, beta_slow,
mscale, mscale_all_dim, original_max_position_embeddings; attention_factor and truncate when set),
which also scales MLA's softmax by mscale(factor, mscale_all_dim)^2.

Names: transformers' ``state_dict`` holds fused experts; published checkpoints (and
``save_pretrained``'s) hold ``mlp.experts.{e}.gate_proj / up_proj / down_proj.weight``. Import reads
either (``checkpoint_view``: per-expert tensors stacked lazily by ``mimo.llm.lazy.stacked_experts``,
as ``mimo.llm.hf.decoder_checkpoint_view`` stacks them); export writes the ``state_dict`` names, which ``from_pretrained`` loads as they are.

**Multi-token prediction** (issue 56; ``mimo.llm.mtp``). DeepSeek's checkpoints hold their MTP
modules as decoder layers after the last: module ``k`` of ``num_nextn_predict_layers`` at
``model.layers.{L + k}.`` (``L = num_hidden_layers``; ``model.layers.61.*`` of DeepSeek-V3), the
names as vLLM's ``deepseek_mtp.py`` loads them (transformers' ``DeepseekV3ForCausalLM`` builds no
MTP and ignores them):

    enorm.weight                 mtp.{k}.norm_embed.weight    (RMSNorm of the embedding of token t + k + 1)
    hnorm.weight                 mtp.{k}.norm_hidden.weight   (RMSNorm of the previous depth's hidden state)
    eh_proj.weight [D, 2D]       mtp.{k}.fc.weight            (on cat(enorm(e), hnorm(h)): embedding first, as ours)
    input_layernorm, self_attn.*, post_attention_layernorm, mlp.*
                                 mtp.{k}.layers.{a} (MLA) and .{a + 1} (MoE, or a dense MLP), as a
                                 main decoder layer (our layer indices after the pattern's)
    shared_head.norm.weight      mtp.{k}.norm.weight          (the norm before the shared head)
    embed_tokens.weight          copy of embed.weight         (ours shares the model's embedding)
    shared_head.head.weight      copy of head.weight          (the model's head; the embedding when tied)

``checkpoint_view`` shows these tensors (per-expert ones stacked as the main layers') under
``"mtp." + their name`` (``mtp.model.layers.61.enorm.weight``), so that a model without
``arch.mtp`` loads the checkpoint with ``mimo.llm.hf``'s warning that its ``mtp.*`` tensors are not
loaded, as for Qwen's; nothing else is dropped. The two copies are never loaded: reading the
model's embedding (head) also reads the same slice of each MTP copy and raises a ``MimoError``
naming the copy where they differ (whether or not ``arch.mtp`` is set). Export writes the MTP
layers back under DeepSeek's names (``join_split`` strips the prefix), the copies included, the
experts fused as the main layers', and ``num_nextn_predict_layers`` = ``arch.mtp.depth`` (0
without). As for Qwen's ``mtp.*``, a config alone gives no ``mtp`` (transformers' config says
``num_nextn_predict_layers: 1`` whether or not the file holds the layers): ``with_checkpoint_mtp``
sets ``arch.mtp`` (depth = the MTP layers of the checkpoint's keys, block ``+E`` or ``+-`` as their
``mlp`` is an MoE or not) for what ``import-hf`` writes. The MTP layer's kind is DeepSeek's rule
for layer ``L + k`` (MoE past ``first_k_dense_replace``): ``+E`` in a model with MoE layers; in an
all-dense one ``+-`` exports ``first_k_dense_replace = L + depth``.

What the model cannot express is a ``MimoError`` naming the config key: a ``hidden_act`` other
than silu, ``scoring_func`` other than sigmoid, ``topk_method`` other than noaux_tc, ``ep_size``
other than 1, ``moe_layer_freq`` other than 1, ``n_group`` not dividing ``n_routed_experts`` (or
``topk_group`` above it), ``n_shared_experts`` 0, ``num_key_value_heads`` other than
``num_attention_heads`` (MLA has one key per query head), ``rope_interleave`` false, a RoPE type
other than default / yarn, and a ``quantization_config`` (DeepSeek's FP8 weights with their
``weight_scale_inv``: dequantize to bf16 first).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Callable, Iterable, Mapping

import torch

from mimo.core.errors import MimoError
from mimo.llm.config import HybridArch, MoEArch, MTPArch, RopeScaling
from mimo.llm.pattern import with_stages
from mimo.llm.lazy import stacked_experts

log = logging.getLogger(__name__)

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
# DeepSeek-V3.2: the same decoder, every attention layer DeepSeek sparse attention (D, mimo.llm.dsa)
V32_MODEL_TYPE = "deepseek_v32"
V32_ARCHITECTURE = "DeepseekV32ForCausalLM"
ATTENTION = {MODEL_TYPE: "+", V32_MODEL_TYPE: "D"}  # model_type -> our attention layer's symbol
ARCHITECTURES = {MODEL_TYPE: ARCHITECTURE, V32_MODEL_TYPE: V32_ARCHITECTURE}
V32_DEFAULTS = {"max_position_embeddings": 163840, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}
INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")  # V3.2's, both sides
ROUTER_NORM_EPS = 1e-20  # DeepseekV3TopkRouter's renormalisation epsilon
TIED_HEAD = "lm_head.weight"
# DeepseekV3Config's defaults of the keys read here (a test checks them against transformers)
DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_interleave": True, "attention_bias": False,
}
ROPE_THETA = 10000.0  # transformers' default rope_theta
# keys of DeepSeek's own config.json (its remote code) that transformers does not read, and the
# one value of each that our model (and transformers') computes
REFERENCE_KEYS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "ep_size": 1, "moe_layer_freq": 1}
YARN_KEYS = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "original_max_position_embeddings",
             "attention_factor", "truncate")

Piece = tuple[str, int]  # (our canonical name, which of its fused parts)
Rename = Callable[[str], str]


def _same(name: str) -> str:
    return name


# ---------------------------------------------------------------- config


def _name(cfg: Mapping) -> str:
    """The config's model_type (for messages)."""
    return cfg.get("model_type") or MODEL_TYPE


def _get(cfg: Mapping, key: str):
    """``cfg[key]``, else the default of DeepseekV3Config (DeepseekV32Config's for a V3.2 config;
    ``q_lora_rank``: an explicit null stays null, a full q projection); MimoError if it has none."""
    if key == "q_lora_rank" and key in cfg:
        return cfg[key]
    if cfg.get(key) is not None:
        return cfg[key]
    defaults = {**DEFAULTS, **V32_DEFAULTS} if cfg.get("model_type") == V32_MODEL_TYPE else DEFAULTS
    if key not in defaults:
        raise MimoError(f"{_name(cfg)}: config.json has no {key!r}")
    return defaults[key]


def _rope_from_config(cfg: Mapping) -> tuple[float, RopeScaling | None]:
    """rope_theta and the YaRN scaling of a config (``rope_parameters``, else ``rope_scaling``)."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", ROPE_THETA)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise MimoError(f"{_name(cfg)}: rope_parameters rope_type {rope_type!r} is not supported (default or yarn)")
    if params.get("original_max_position_embeddings") is None:
        raise MimoError(f"{_name(cfg)}: yarn rope_parameters need original_max_position_embeddings")
    orig = int(params["original_max_position_embeddings"])
    # (transformers: a missing factor is max_position_embeddings / original_max_position_embeddings)
    factor = params.get("factor") or int(_get(cfg, "max_position_embeddings")) / orig
    optional = lambda k: None if params.get(k) is None else float(params[k])  # noqa: E731
    return theta, RopeScaling(
        "yarn", float(factor), original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"), truncate=bool(params.get("truncate", True)),
    )


def hf_decoder_symbols(cfg: Mapping) -> list[str]:
    """'-' (dense MLP) or 'E' (MoE) of each Hugging Face decoder layer of a config (V3.2's
    ``mlp_layer_types`` where it has them: DeepseekV32Config writes them from
    first_k_dense_replace, and its layers follow them)."""
    layers, dense = int(_get(cfg, "num_hidden_layers")), int(_get(cfg, "first_k_dense_replace"))
    types = cfg.get("mlp_layer_types") if cfg.get("model_type") == V32_MODEL_TYPE else None
    if types is None:
        return ["-" if j < dense else "E" for j in range(layers)]
    if len(types) != layers or any(t not in ("dense", "sparse") for t in types):
        raise MimoError(f"{_name(cfg)}: mlp_layer_types {types!r} must be 'dense' or 'sparse' for each of the "
                        f"num_hidden_layers={layers} layers")
    symbols = ["-" if t == "dense" else "E" for t in types]
    if "E" in symbols and "-" in symbols[symbols.index("E"):]:
        raise MimoError(f"{_name(cfg)}: mlp_layer_types {types!r} put a dense layer after a sparse one: not supported "
                        f"(DeepSeek's dense layers are the first ones)")
    return symbols


def _reject(cfg: Mapping, moe: bool) -> None:
    """MimoError for a DeepSeek-V3 config our model (or transformers') cannot express."""
    heads, kv = int(_get(cfg, "num_attention_heads")), int(_get(cfg, "num_key_value_heads"))
    checks = [
        (_get(cfg, "hidden_act") != "silu", f"hidden_act {_get(cfg, 'hidden_act')!r} (SwiGLU needs 'silu')"),
        (kv != heads, f"num_key_value_heads={kv} with num_attention_heads={heads} (MLA has a key and value per query "
                      f"head: they must be equal)"),
        (not _get(cfg, "rope_interleave"), "rope_interleave: false (MLA rotates DeepSeek's interleaved pairs only)"),
        (cfg.get("quantization_config") is not None,
         "quantization_config (quantized weights, e.g. DeepSeek's FP8 with weight_scale_inv; dequantize to bf16 first)"),
    ]
    checks += [(cfg.get(k) is not None and cfg[k] != v, f"{k} {cfg.get(k)!r} (only {v!r})")
               for k, v in REFERENCE_KEYS.items()]
    if moe:
        e, groups, top = int(_get(cfg, "n_routed_experts")), int(_get(cfg, "n_group")), int(_get(cfg, "topk_group"))
        checks += [
            (groups < 1 or e % groups, f"n_group={groups} (must divide n_routed_experts={e})"),
            (not 1 <= top <= max(groups, 1), f"topk_group={top} (must be 1..n_group={groups})"),
            (int(_get(cfg, "n_shared_experts")) < 1, "n_shared_experts: 0 (DeepSeek-V3's MoE has a shared expert)"),
        ]
    for bad, what in checks:
        if bad:
            raise MimoError(f"{_name(cfg)}: {what} is not supported")


def arch_from_hf_config(cfg: Mapping, pattern_stages: Iterable[int] | None = None) -> HybridArch:
    """Our ``HybridArch`` of a DeepSeek-V3 ``config.json`` (a dict); ``pattern_stages``: Hugging
    Face decoder layers per explicit pipeline stage (``|`` in the pattern), by default none. A
    DeepSeek-V3.2 config (``deepseek_v32``) gives DSA layers ``D`` with its indexer's sizes."""
    if cfg.get("model_type") not in ATTENTION:
        raise MimoError(f"model_type {cfg.get('model_type')!r} is not one of {', '.join(map(repr, ATTENTION))}")
    attention, v32 = ATTENTION[cfg["model_type"]], cfg["model_type"] == V32_MODEL_TYPE
    if v32 and cfg.get("q_lora_rank", 0) is None:
        raise MimoError(f"{V32_MODEL_TYPE}: q_lora_rank null is not supported (the indexer reads the query latent)")
    symbols = hf_decoder_symbols(cfg)
    _reject(cfg, "E" in symbols)
    theta, scaling = _rope_from_config(cfg)
    moe = None
    if "E" in symbols:
        ffn = int(_get(cfg, "moe_intermediate_size"))
        moe = MoEArch(
            experts=int(_get(cfg, "n_routed_experts")), topk=int(_get(cfg, "num_experts_per_tok")), ffn=ffn,
            act="swiglu", shared_ffn=int(_get(cfg, "n_shared_experts")) * ffn, score="sigmoid",
            norm_topk=bool(_get(cfg, "norm_topk_prob")), scale=float(_get(cfg, "routed_scaling_factor")),
            groups=int(_get(cfg, "n_group")), group_topk=int(_get(cfg, "topk_group")), expert_bias=True,
            norm_eps=ROUTER_NORM_EPS,
        )
    heads, bias = int(_get(cfg, "num_attention_heads")), bool(_get(cfg, "attention_bias"))
    q_lora = _get(cfg, "q_lora_rank")
    return HybridArch(
        pattern=with_stages([attention + s for s in symbols], pattern_stages), hidden=int(_get(cfg, "hidden_size")),
        heads=heads, kv_heads=heads, vocab=int(_get(cfg, "vocab_size")), ffn=int(_get(cfg, "intermediate_size")),
        mlp_act="swiglu", attention_bias=bias, qkv_bias=bias, o_bias=bias,
        tie_embeddings=bool(_get(cfg, "tie_word_embeddings")), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(_get(cfg, "rms_norm_eps")), max_seq_len=int(_get(cfg, "max_position_embeddings")),
        init_std=float(_get(cfg, "initializer_range")), moe=moe,
        mla_q_lora_rank=None if q_lora is None else int(q_lora), mla_kv_lora_rank=int(_get(cfg, "kv_lora_rank")),
        mla_qk_rope_head_dim=int(_get(cfg, "qk_rope_head_dim")),
        mla_qk_nope_head_dim=int(_get(cfg, "qk_nope_head_dim")), mla_v_head_dim=int(_get(cfg, "v_head_dim")),
        **({"dsa_index_topk": int(_get(cfg, "index_topk")), "dsa_index_heads": int(_get(cfg, "index_n_heads")),
            "dsa_index_head_dim": int(_get(cfg, "index_head_dim"))} if v32 else {}),
    )


def attention_symbol(arch: HybridArch) -> str:
    """'+' (DeepSeek-V3's MLA) or 'D' (V3.2's DSA): the attention layers of ``arch``'s pattern
    (MLA where it has neither; ``hf_decoder_layers`` says what is wrong)."""
    return "D" if "dsa" in arch.layer_pattern().kinds else "+"


def model_type_of(arch: HybridArch) -> str:
    """deepseek_v3, or deepseek_v32 for an arch of DSA layers."""
    return V32_MODEL_TYPE if attention_symbol(arch) == "D" else MODEL_TYPE


def hf_decoder_layers(arch: HybridArch) -> list[str]:
    """Our MLP-layer symbol ('-' or 'E') of each Hugging Face decoder layer of ``arch``;
    MimoError unless the pattern is ``+-`` pairs, then ``+E`` pairs (V3.2: ``D-``, then ``DE``)."""
    kinds = [layer.kind for layer in arch.layer_pattern().layers]
    pairs = [kinds[i : i + 2] for i in range(0, len(kinds), 2)]
    a = "dsa" if "dsa" in kinds else "mla"
    if len(kinds) % 2 or any(p not in ([a, "mlp"], [a, "moe"]) for p in pairs):
        raise MimoError(f"DeepSeek-V3 decoder layers are '+-' or '+E' (an MLA layer, then an MLP or MoE layer; "
                        f"V3.2's 'D-' or 'DE', every attention layer DSA); {arch.pattern!r} pairs its layers otherwise")
    symbols = ["-" if p[1] == "mlp" else "E" for p in pairs]
    if "E" in symbols and "-" in symbols[symbols.index("E"):]:
        raise MimoError(f"DeepSeek-V3's dense decoder layers are its first ones (first_k_dense_replace), then MoE only; "
                        f"the pattern {arch.pattern!r} has a dense layer after an MoE one")
    return symbols


def _export_problems(arch: HybridArch, symbols: list[str]) -> list[str]:
    problems = _mtp_problems(arch, symbols)
    if attention_symbol(arch) == "D" and arch.mla_q_lora_rank is None:
        problems.append("DeepSeek-V3.2's DSA reads the query latent: arch.mla_q_lora_rank must be set")
    if not arch.rope or arch.mrope_section is not None:
        problems.append("DeepSeek-V3 rotates 1-D RoPE; set arch.rope: true and no mrope_section")
    if arch.rope_scaling is not None and arch.rope_scaling.type != "yarn":
        problems.append(f"arch.rope_scaling type {arch.rope_scaling.type!r}: DeepSeek-V3 export takes yarn (or none)")
    if arch.qkv_bias != arch.o_bias:
        problems.append("DeepSeek-V3 has one attention_bias flag for the down projections and o_proj; qkv_bias and "
                        "o_bias differ")
    wrong = {"mlp_act": "swiglu", "mlp_bias": False, "qk_norm": False, "norm_zero_centred": False,
             "attn_output_gate": False, "rotary_fraction": 1.0, "deepstack_layers": []}
    problems += [f"arch.{k} is {getattr(arch, k)!r}, DeepSeek-V3 needs {v!r}" for k, v in wrong.items()
                 if getattr(arch, k) != v]
    moe = arch.moe
    mtp_moe = arch.mtp is not None and arch.mtp.block(arch) == "+E"
    if ("E" in symbols or mtp_moe) and moe is not None:
        want = {"act": "swiglu", "score": "sigmoid", "expert_bias": True, "shared_gate": False,
                "quantile_balancing": False, "router_bias": False, "latent": 0, "norm_eps": ROUTER_NORM_EPS}
        problems += [f"arch.moe.{k} is {getattr(moe, k)!r}, DeepSeek-V3 needs {v!r}" for k, v in want.items()
                     if getattr(moe, k) != v]
        if not moe.shared_ffn or moe.shared_ffn % moe.ffn:
            problems.append(f"arch.moe.shared_ffn is {moe.shared_ffn}: DeepSeek-V3's shared expert is n_shared_experts "
                            f">= 1 times moe.ffn={moe.ffn}")
    return problems


def _mtp_problems(arch: HybridArch, symbols: list[str]) -> list[str]:
    """Why ``arch.mtp`` is not DeepSeek's MTP layers (module doc); [] if it is (or none)."""
    if arch.mtp is None:
        return []
    block, a = arch.mtp.block(arch), attention_symbol(arch)
    if block not in (a + "E", a + "-"):
        return [f"DeepSeek-V3's MTP module is one decoder layer, its attention then MoE or a dense MLP ('{a}E' or "
                f"'{a}-'); arch.mtp's block is {block!r} (set arch.mtp.pattern)"]
    if "E" in symbols and block != a + "E":
        return [f"DeepSeek-V3's MTP layers come after first_k_dense_replace: MoE ('{a}E') in a model with MoE layers; "
                f"arch.mtp's block is {block!r}"]
    return []


def hf_config_from_arch(arch: HybridArch, model_type: str | None = None) -> dict:
    """A DeepSeek-V3 ``config.json`` dict for ``arch`` (export; V3.2's for an arch of DSA layers);
    MimoError listing what does not fit (also where ``model_type`` names the other one)."""
    symbols = hf_decoder_layers(arch)
    ours = model_type_of(arch)
    if model_type is not None and model_type != ours:
        raise MimoError(f"{model_type} export: the arch's attention layers are "
                        f"{'DSA (D)' if ours == V32_MODEL_TYPE else 'MLA (+)'}, a {ours} model")
    problems = _export_problems(arch, symbols)
    if problems:
        raise MimoError(f"{ours} export: " + "; ".join(problems))
    rope: dict = {"rope_theta": arch.rope_theta, "rope_type": "default"}
    s = arch.rope_scaling
    if s is not None:
        rope.update(rope_type="yarn", factor=s.factor, beta_fast=s.beta_fast, beta_slow=s.beta_slow,
                    original_max_position_embeddings=s.original_max_position_embeddings)
        rope.update({k: getattr(s, k) for k in ("mscale", "mscale_all_dim", "attention_factor") if getattr(s, k) is not None})
        if not s.truncate:
            rope["truncate"] = False
    cfg = {
        "model_type": ours, "architectures": [ARCHITECTURES[ours]], "vocab_size": arch.vocab, "hidden_size": arch.hidden,
        "intermediate_size": arch.ffn, "num_hidden_layers": len(symbols), "first_k_dense_replace": symbols.count("-"),
        "num_attention_heads": arch.heads, "num_key_value_heads": arch.heads,
        "q_lora_rank": arch.mla_q_lora_rank, "kv_lora_rank": arch.mla_kv_lora_rank,
        "qk_rope_head_dim": arch.mla_qk_rope_head_dim, "qk_nope_head_dim": arch.mla_qk_nope_head_dim,
        "v_head_dim": arch.mla_v_head_dim, "hidden_act": "silu", "attention_bias": bool(arch.o_bias),
        "rope_parameters": rope, "rope_interleave": True, "rms_norm_eps": arch.norm_eps,
        "max_position_embeddings": arch.max_seq_len, "initializer_range": arch.init_std,
        "tie_word_embeddings": arch.tie_embeddings, "num_nextn_predict_layers": 0 if arch.mtp is None else arch.mtp.depth,
    }
    mtp = mtp_symbols(arch)
    if mtp and "E" not in symbols and mtp[0] == "-":  # dense MTP layers: DeepSeek's rule needs them below the bound
        cfg["first_k_dense_replace"] = len(symbols) + len(mtp)
    if "E" in symbols + mtp:
        m = arch.moe
        cfg.update(n_routed_experts=m.experts, num_experts_per_tok=m.topk, moe_intermediate_size=m.ffn,
                   n_shared_experts=m.shared_ffn // m.ffn, norm_topk_prob=m.norm_topk, routed_scaling_factor=m.scale,
                   n_group=m.groups, topk_group=m.group_topk, scoring_func="sigmoid", topk_method="noaux_tc")
    if ours == V32_MODEL_TYPE:
        cfg.update(index_topk=arch.dsa_index_topk, index_n_heads=arch.dsa_index_heads,
                   index_head_dim=arch.dsa_index_head_dim,
                   mlp_layer_types=["dense" if s == "-" else "sparse" for s in symbols])
        del cfg["rope_interleave"]  # (V3.2 always interleaves; its config has no such key)
    return cfg


# ---------------------------------------------------------------- tensors


def _attention_pieces(arch: HybridArch) -> list[tuple[str, str, int]]:
    """(Hugging Face name in the decoder layer, ours in the MLA layer, part), in HF's order."""
    bias = ("weight", "bias") if arch.qkv_bias else ("weight",)
    out = []
    if arch.mla_q_lora_rank is not None:
        out += [(f"self_attn.q_a_proj.{k}", f"q_a_proj.{k}", 0) for k in bias]
        out += [("self_attn.q_a_layernorm.weight", "q_a_layernorm.weight", 0),
                ("self_attn.q_b_proj.weight", "q_b_proj.weight", 0)]
    else:
        out.append(("self_attn.q_proj.weight", "q_proj.weight", 0))
    out += [(f"self_attn.kv_a_proj_with_mqa.{k}", f"kv_a_proj_with_mqa.{k}", 0) for k in bias]
    out += [("self_attn.kv_a_layernorm.weight", "kv_a_layernorm.weight", 0),
            ("self_attn.kv_b_proj.weight", "kv_b_proj.weight", 0), ("self_attn.o_proj.weight", "o_proj.weight", 0)]
    if arch.o_bias:
        out.append(("self_attn.o_proj.bias", "o_proj.bias", 0))
    if attention_symbol(arch) == "D":
        out += [(f"self_attn.indexer.{k}", f"indexer.{k}", 0) for k in INDEXER]
    return out


MLP_PIECES = {"mlp.gate_proj.weight": (("up_proj.weight", 0),), "mlp.up_proj.weight": (("up_proj.weight", 1),),
              "mlp.down_proj.weight": (("down_proj.weight", 0),)}
MOE_PIECES = {
    "mlp.experts.gate_up_proj": (("experts.up_proj", 0), ("experts.up_proj", 1)),
    "mlp.experts.down_proj": (("experts.down_proj", 0),),
    "mlp.gate.weight": (("router.weight", 0),),
    "mlp.gate.e_score_correction_bias": (("router.expert_bias", 0),),  # a buffer of both
    "mlp.shared_experts.gate_proj.weight": (("shared.up_proj", 0),),
    "mlp.shared_experts.up_proj.weight": (("shared.up_proj", 1),),
    "mlp.shared_experts.down_proj.weight": (("shared.down_proj", 0),),
}
BUFFERS = ("router.expert_bias",)  # our persistent buffers (inside a layer) that Hugging Face stores


def _decoder_layer_pieces(at: str, a: str, m: str, symbol: str, attention) -> dict[str, tuple[Piece, ...]]:
    """One Hugging Face decoder layer's tensors (prefix ``at``) -> pieces of our MLA layer ``a``
    and our MLP (``symbol`` '-') or MoE ('E') layer ``m``, each with its pre-norm."""
    out = {at + theirs: ((a + ours, part),) for theirs, ours, part in attention}
    for theirs, pieces in (MOE_PIECES if symbol == "E" else MLP_PIECES).items():
        out[at + theirs] = tuple((m + ours, part) for ours, part in pieces)
    out[at + "input_layernorm.weight"] = ((a + "norm.weight", 0),)
    out[at + "post_attention_layernorm.weight"] = ((m + "norm.weight", 0),)
    return out


def hf_tensor_pieces(arch: HybridArch, rename: Rename = _same) -> dict[str, tuple[Piece, ...]]:
    """Every tensor of ``DeepseekV3ForCausalLM``'s ``state_dict`` for ``arch`` -> its pieces, in
    that order (a tied ``lm_head`` the embedding again: a copy)."""
    out: dict[str, tuple[Piece, ...]] = {"model.embed_tokens.weight": (("embed.weight", 0),)}
    attention = _attention_pieces(arch)
    for j, symbol in enumerate(hf_decoder_layers(arch)):
        out.update(_decoder_layer_pieces(f"model.layers.{j}.", f"layers.{2 * j}.", f"layers.{2 * j + 1}.", symbol, attention))
    out["model.norm.weight"] = (("norm.weight", 0),)
    head = (("embed.weight" if arch.tie_embeddings else "head.weight", 0),)
    out[TIED_HEAD] = head
    main = {rename(k): v for k, v in out.items()}
    return {**main, **{MTP_PREFIX + rename(k): v for k, v in _mtp_pieces(arch, attention, head).items()}}


MTP_PREFIX = "mtp."  # checkpoint_view's names of the MTP layers' tensors (mimo.llm.hf.MTP_PREFIX, which warns on them)
def mtp_symbols(arch: HybridArch) -> list[str]:
    """'E' or '-' of each MTP depth's layer (``arch.mtp``; [] without); MimoError unless its
    block is DeepSeek's (``_mtp_problems``)."""
    if arch.mtp is None:
        return []
    problems = _mtp_problems(arch, hf_decoder_layers(arch))
    if problems:
        raise MimoError("arch.mtp: " + "; ".join(problems))
    return [arch.mtp.block(arch)[1]] * arch.mtp.depth


def _mtp_pieces(arch: HybridArch, attention, head: tuple[Piece, ...]) -> dict[str, tuple[Piece, ...]]:
    """DeepSeek's MTP layer tensors (``model.layers.{L + k}.*``, unprefixed) -> our ``mtp.{k}.*``
    pieces (module doc); the embedding and head copies are copies."""
    out: dict[str, tuple[Piece, ...]] = {}
    first = len(hf_decoder_layers(arch))
    for k, (symbol, specs) in enumerate(zip(mtp_symbols(arch), arch.mtp_layers())):
        at, d = f"model.layers.{first + k}.", f"mtp.{k}."
        a, m = (f"{d}layers.{s.index}." for s in specs)
        out[at + "embed_tokens.weight"] = (("embed.weight", 0),)
        out[at + "enorm.weight"] = ((d + "norm_embed.weight", 0),)
        out[at + "hnorm.weight"] = ((d + "norm_hidden.weight", 0),)
        out[at + "eh_proj.weight"] = ((d + "fc.weight", 0),)
        out.update(_decoder_layer_pieces(at, a, m, symbol, attention))
        out[at + "shared_head.norm.weight"] = ((d + "norm.weight", 0),)
        out[at + "shared_head.head.weight"] = head
    return out


def join_split(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Export: the MTP layers' tensors under DeepSeek's names (``checkpoint_view``'s prefix off)."""
    return {(k[len(MTP_PREFIX):] if k.startswith(MTP_PREFIX) else k): v for k, v in state.items()}


def with_checkpoint_mtp(arch: HybridArch, keys: Iterable[str]) -> HybridArch:
    """``arch`` with DeepSeek's MTP layers where the checkpoint's keys hold decoder layers past
    ``arch``'s (``MTPArch``: depth their count, block ``+E`` where their ``mlp`` is an MoE, else
    ``+-``; ``arch.mtp``'s loss_weight kept), else without (a config's
    ``num_nextn_predict_layers`` alone says nothing of the file); for the arch ``import-hf``
    writes. MimoError for MTP layers numbered with gaps, of mixed kinds, or MoE ones in a model
    without ``moe``."""
    first = len(hf_decoder_layers(arch))
    layers: dict[int, set[str]] = {}
    for key in keys:
        m = _LAYER.search(key)
        if m and int(m[1]) >= first:
            layers.setdefault(int(m[1]), set()).add(key[m.end():])
    if not layers:
        return dataclasses.replace(arch, mtp=None)
    if sorted(layers) != list(range(first, first + len(layers))):
        raise MimoError(f"{model_type_of(arch)}: the checkpoint's MTP layers are decoder layers {sorted(layers)}; "
                        f"DeepSeek's are {first}, {first + 1}, ... (num_hidden_layers={first} on)")
    kinds = {"E" if any(n.startswith("mlp.gate.") or n.startswith("mlp.experts.") for n in names) else "-"
             for names in layers.values()}
    if len(kinds) > 1:
        raise MimoError(f"{model_type_of(arch)}: the checkpoint's MTP layers {sorted(layers)} mix MoE and dense MLPs; "
                        f"arch.mtp has one block for every depth")
    (kind,) = kinds
    if kind == "E" and arch.moe is None:
        raise MimoError(f"{model_type_of(arch)}: the checkpoint's MTP layers are MoE, but the model (every decoder layer dense) "
                        f"has no arch.moe")
    weight = MTPArch().loss_weight if arch.mtp is None else arch.mtp.loss_weight
    return dataclasses.replace(arch, mtp=MTPArch(depth=len(layers), loss_weight=weight,
                                                 pattern=attention_symbol(arch) + kind))


# ---------------------------------------------------------------- checkpoint names

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# per-expert checkpoint tensors -> (the fused tensor, which of its parts along dim 1)
_PER_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_OF = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
_PROJS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def mtp_keys(arch: HybridArch, keys: Iterable[str]) -> list[str]:
    """The keys of decoder layers past ``arch``'s (DeepSeek's MTP layers, ``model.layers.61.*``)."""
    n = len(arch.layer_pattern().layers) // 2
    out = []
    for k in keys:
        m = _LAYER.search(k)
        if m and int(m[1]) >= n:
            out.append(k)
    return out


class _CheckedCopies:
    """The model's embedding (or head) read lazily, each read also reading the same slice of the
    MTP layers' copies of it: a ``MimoError`` naming the first copy that differs."""

    def __init__(self, name: str, src, copies: list[tuple[str, object]], source: str):
        self.name, self.src, self.copies, self.source = name, src, copies, source

    def __getitem__(self, index):
        x = self.src[index]
        for key, copy in self.copies:
            if not torch.equal(copy[index], x):
                raise MimoError(f"{self.source}: tensor {key!r} differs from {self.name!r}: DeepSeek's MTP layer holds "
                                f"a copy of the model's, and our multi-token prediction shares the model's "
                                f"(the copy is not loaded)")
        return x


def _copied(keys: list[str], first: int) -> dict[str, list[str]]:
    """The model's embedding / head key -> the MTP layers' copies of it in ``keys``."""
    present, out = set(keys), {}
    for key in keys:
        m = _LAYER.search(key)
        if not (m and int(m[1]) >= first and key[m.end():] in ("embed_tokens.weight", "shared_head.head.weight")):
            continue
        body = key[: m.start() + (m[0][0] == ".")]  # "model." (or a larger checkpoint's prefix of it)
        embed = body + "embed_tokens.weight"
        head = (body[: -len("model.")] if body.endswith("model.") else body) + TIED_HEAD
        main = embed if key.endswith("embed_tokens.weight") or head not in present else head
        if main in present:
            out.setdefault(main, []).append(key)
    return out


def checkpoint_view(arch: HybridArch | None, keys: Iterable[str], shapes: Mapping[str, tuple[int, ...]],
                    get: Callable[[str], object], source: str = "checkpoint"
                    ) -> tuple[dict[str, tuple[int, ...]], Callable[[str], object]]:
    """(shapes, get) of a DeepSeek-V3 checkpoint under ``hf_tensor_pieces``' names: per-expert
    ``mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`` stacked (lazily, ``stacked_experts``,
    as ``mimo.llm.hf.decoder_checkpoint_view`` does for the decoder families) into
    ``mlp.experts.gate_up_proj`` (gate rows | up rows) / ``down_proj``; the tensors of decoder
    layers past the arch's (DeepSeek's MTP layers) under ``"mtp." + name`` (module doc; the arch's
    ``mtp`` does not matter here: ``mimo.llm.hf`` warns on them where it is unset); the model's
    embedding and head checked against the MTP layers' copies as they are read; everything else as
    it is. MimoError naming a missing or misfit per-expert tensor."""
    keys = list(keys)
    out_shapes: dict[str, tuple[int, ...]] = {}
    sources: dict[str, Callable[[], object]] = {}
    grouped: dict[str, dict[int, dict[int, str]]] = {}  # fused name -> expert -> part -> key
    for key in keys:
        m = _PER_EXPERT.match(key)
        if m:
            fused, part = _FUSED_OF[m["proj"]]
            grouped.setdefault(f"{m['layer']}.{fused}", {}).setdefault(int(m["e"]), {})[part] = key
            continue
        out_shapes[key], sources[key] = tuple(shapes[key]), (lambda key=key: get(key))
    for name, by_expert in grouped.items():
        projs = _PROJS[name.rsplit(".", 1)[1]]
        keys_ep = []
        for e in range(max(by_expert) + 1):
            parts = by_expert.get(e, {})
            missing = [p for p in projs if projs.index(p) not in parts]
            if missing:
                raise MimoError(f"{source}: no tensor {name.rsplit('.', 1)[0]}.{e}.{missing[0]}.weight (expert {e} of "
                                f"{name!r}, stacked from per-expert tensors; the checkpoint has experts up to "
                                f"{max(by_expert)})")
            keys_ep.append([parts[i] for i in range(len(projs))])
        out_shapes[name], sources[name] = stacked_experts(name, keys_ep, shapes, get, f"{source}: ")
    if arch is not None:
        first = len(arch.layer_pattern().layers) // 2
        for main, copies in _copied(keys, first).items():
            sources[main] = lambda main=main, copies=copies: _CheckedCopies(
                main, get(main), [(k, get(k)) for k in copies], source)
        mtp = set(mtp_keys(arch, out_shapes))
        out_shapes = {(MTP_PREFIX + k if k in mtp else k): v for k, v in out_shapes.items()}
        sources = {(MTP_PREFIX + k if k in mtp else k): v for k, v in sources.items()}
    return out_shapes, lambda name: sources[name]()
