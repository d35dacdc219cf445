"""Hugging Face import / export of Nemotron-H (``NemotronHForCausalLM``, model_type ``nemotron_h``).

Nemotron-H is our hybrid LLM as it stands: its layer pattern (``hybrid_override_pattern``;
``layers_block_type`` in transformers >= 5) uses our symbols, and Hugging Face block ``i`` is
our layer ``i``: ``model.layers.{i}.norm.weight`` its pre-norm, ``model.layers.{i}.mixer.*``
its mixer.

    M  Mamba-2: in_proj rows z | x | B | C | dt -> our in_proj_weight (z | x | dt) and
       in_bc_weight (B | C); conv1d [x | B | C, 1, K] -> conv_x_* and conv_bc_* [.., K];
       dt_bias, A_log, D; norm.weight -> norm_weight (gated RMSNorm over n_groups groups);
       dt = softplus(dt + dt_bias) clamped to time_step_limit (mamba_dt_limit), as
       mamba_ssm's dt_limit and transformers >= 5.25 clamp it: its lower bound is
       arch.mamba_dt_min (0 by default: no floor); a finite upper bound is a MimoError.
       transformers < 5.25 clamped at (time_step_min, inf) whatever time_step_limit said;
       export writes time_step_min = arch.mamba_dt_min too (when > 0), so they read it alike
    *  attention without RoPE (arch.rope false) and without biases, whatever attention_bias says
    -  MLP up / down with mlp_hidden_act (relu2, or gelu) and mlp_bias
    E  MoE: gate.weight (fp32) -> router.weight; the buffer gate.e_score_correction_bias ->
       our buffer router.expert_bias (moe.expert_bias); sigmoid scores, n_group / topk_group,
       norm_topk_prob with Hugging Face's + 1e-20, routed_scaling_factor; non-gated experts
       experts.up_proj [E, F, I] / experts.down_proj [E, I, F] (act: mlp_hidden_act); one
       shared expert shared_experts.up_proj / down_proj (moe_shared_expert_intermediate_size);
       fc1_latent_proj / fc2_latent_proj -> latent_in / latent_out (moe_latent_size)

Names: transformers' ``state_dict`` has ``model.`` and fused experts; ``save_pretrained`` and
the published checkpoints store ``backbone.`` and per-expert ``experts.{e}.up_proj.weight``
(transformers' conversion mapping of ``nemotron_h`` is exactly these two renamings). Import
reads either (``checkpoint_view``: lazy, each rank reads only its slices); export writes the
``state_dict`` names, which ``from_pretrained`` loads as they are.

``NemotronHForCausalLM`` never ties ``lm_head`` to the embedding (it has no tied-weight keys),
so an import is untied whatever ``tie_word_embeddings`` says. MTP layers (``mtp.*``) are
ignored, as transformers ignores them. What the model cannot express is a ``MimoError``
naming the config key: projection biases (``use_bias``), a convolution without bias, a Mamba
activation other than SiLU, ``mlp_bias`` with MoE layers (the shared expert and latent
projections would have biases).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Mapping

import torch

from mimo.core.errors import MimoError
from mimo.llm.config import HybridArch, MoEArch
from mimo.llm.pattern import with_stages
from mimo.llm.lazy import StackedExperts

MODEL_TYPE = "nemotron_h"
ARCHITECTURE = "NemotronHForCausalLM"

# Hugging Face block type -> our pattern symbol ("mamba" / "attention": transformers' legacy names)
SYMBOL_OF_BLOCK = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
BLOCK_OF_KIND = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "moe": "moe"}
ACTIVATIONS = ("relu2", "gelu")  # transformers' ACT2FN names that are ours too (non-gated)
ROUTER_NORM_EPS = 1e-20  # NemotronHTopkRouter's renormalisation epsilon
# config.json spellings of older Nemotron-H configs (NemotronHConfig.__post_init__ renames them)
LEGACY_KEYS = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "time_step_limit": "mamba_dt_limit",
               "use_conv_bias": "mamba_conv_bias", "chunk_size": "mamba_chunk_size"}
# NemotronHConfig's time_step_min: only dt_bias's random init in transformers >= 5.25 (the floor of
# dt before); export writes it (arch.mamba_dt_min when > 0), import reads time_step_limit instead
TIME_STEP_MIN = 0.001
# NemotronHConfig's defaults of the keys read here (a test checks them against transformers)
DEFAULTS = {
    "head_dim": 128, "max_position_embeddings": 4096, "intermediate_size": 21504,
    "mlp_hidden_act": "relu2", "mlp_bias": False, "ssm_state_size": 128, "mamba_num_heads": 128,
    "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4,
    "time_step_limit": (0.0, float("inf")),
    "use_conv_bias": True, "chunk_size": 128, "use_bias": False, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 7688, "moe_shared_expert_intermediate_size": 7688, "moe_latent_size": None,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-5,
}

Piece = tuple[str, int]  # (our canonical name, which of its fused parts)
Rename = Callable[[str], str]


def _same(name: str) -> str:
    return name


# ---------------------------------------------------------------- config


def _get(cfg: Mapping, key: str):
    """``cfg[key]`` (or its older spelling), else NemotronHConfig's default; MimoError if it has none."""
    for k in (key, LEGACY_KEYS.get(key)):
        if k is not None and cfg.get(k) is not None:
            return cfg[k]
    if key not in DEFAULTS:
        raise MimoError(f"{MODEL_TYPE}: config.json has no {key!r}")
    return DEFAULTS[key]


def hf_pattern(cfg: Mapping) -> str:
    """Our pattern (no ``|``) of a Nemotron-H config: ``layers_block_type`` or ``hybrid_override_pattern``."""
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types:
        bad = [t for t in types if t not in SYMBOL_OF_BLOCK]
        if bad:
            raise MimoError(f"{MODEL_TYPE}: layers_block_type has {bad[0]!r}; known: {', '.join(SYMBOL_OF_BLOCK)}")
        return "".join(SYMBOL_OF_BLOCK[t] for t in types)
    pattern = cfg.get("hybrid_override_pattern")
    if not pattern:
        raise MimoError(f"{MODEL_TYPE}: config.json has neither layers_block_type nor hybrid_override_pattern")
    bad = sorted(set(pattern) - set("M*-E"))
    if bad:
        raise MimoError(f"{MODEL_TYPE}: hybrid_override_pattern {pattern!r} has {bad[0]!r}; Nemotron-H layers are M * - E")
    return pattern


def _time_step_limit(cfg: Mapping) -> tuple[float, float]:
    """``time_step_limit`` (or ``mamba_dt_limit``): the (low, high) clamp of Mamba-2's dt."""
    limit = _get(cfg, "time_step_limit")
    try:
        low, high = (float(v) for v in limit)
    except (TypeError, ValueError):
        raise MimoError(f"{MODEL_TYPE}: time_step_limit {limit!r} is not a pair of numbers (low, high)") from None
    return low, high


def _reject(cfg: Mapping, pattern: str, dt_limit: tuple[float, float]) -> None:
    """MimoError for a Nemotron-H config our layers cannot express (``dt_limit``: its
    ``_time_step_limit``)."""
    low, high = dt_limit
    checks = [
        ("M" in pattern and _get(cfg, "use_bias"), "use_bias: true (biases on the Mamba-2 in_proj / out_proj)"),
        ("M" in pattern and not _get(cfg, "use_conv_bias"), "use_conv_bias: false (a Mamba-2 convolution without bias)"),
        ("M" in pattern and _get(cfg, "mamba_hidden_act") != "silu", f"mamba_hidden_act {_get(cfg, 'mamba_hidden_act')!r} (only 'silu')"),
        ("E" in pattern and _get(cfg, "mlp_bias"), "mlp_bias: true with MoE layers (biases on the shared expert and latent projections)"),
        (_get(cfg, "mlp_hidden_act") not in ACTIVATIONS, f"mlp_hidden_act {_get(cfg, 'mlp_hidden_act')!r} (one of {', '.join(ACTIVATIONS)})"),
        ("E" in pattern and not _get(cfg, "moe_shared_expert_intermediate_size"), "moe_shared_expert_intermediate_size: 0"),
        ("M" in pattern and high != float("inf"),
         f"time_step_limit {[low, high]} (a finite upper bound on Mamba-2's dt; only its floor, arch.mamba_dt_min)"),
    ]
    for bad, what in checks:
        if bad:
            raise MimoError(f"{MODEL_TYPE}: {what} is not supported")


def arch_from_hf_config(cfg: Mapping, pattern_stages: Iterable[int] | None = None) -> HybridArch:
    """Our ``HybridArch`` of a Nemotron-H ``config.json`` (a dict); ``pattern_stages``: layers per
    explicit pipeline stage (``|`` in the pattern), by default none."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise MimoError(f"model_type {cfg.get('model_type')!r} is not {MODEL_TYPE!r}")
    pattern = hf_pattern(cfg)
    dt_limit = _time_step_limit(cfg)
    _reject(cfg, pattern, dt_limit)
    act = _get(cfg, "mlp_hidden_act")
    hidden, heads = int(_get(cfg, "hidden_size")), int(_get(cfg, "num_attention_heads"))
    moe = None
    if "E" in pattern:
        moe = MoEArch(
            experts=int(_get(cfg, "n_routed_experts")), topk=int(_get(cfg, "num_experts_per_tok")),
            ffn=int(_get(cfg, "moe_intermediate_size")), act=act,
            shared_ffn=int(_get(cfg, "moe_shared_expert_intermediate_size")), score="sigmoid",
            norm_topk=bool(_get(cfg, "norm_topk_prob")), scale=float(_get(cfg, "routed_scaling_factor")),
            groups=int(_get(cfg, "n_group")), group_topk=int(_get(cfg, "topk_group")), expert_bias=True,
            latent=int(_get(cfg, "moe_latent_size") or 0), norm_eps=ROUTER_NORM_EPS,
        )
    return HybridArch(
        pattern=with_stages(pattern, pattern_stages), hidden=hidden, heads=heads, vocab=int(_get(cfg, "vocab_size")),
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(_get(cfg, "head_dim")), ffn=int(_get(cfg, "intermediate_size")),
        mlp_act=act, mlp_bias=bool(_get(cfg, "mlp_bias")), tie_embeddings=False, rope=False,
        norm_eps=float(_get(cfg, "layer_norm_epsilon")), max_seq_len=int(_get(cfg, "max_position_embeddings")),
        init_std=float(_get(cfg, "initializer_range")),
        mamba_heads=int(_get(cfg, "mamba_num_heads")), mamba_head_dim=int(_get(cfg, "mamba_head_dim")),
        mamba_state=int(_get(cfg, "ssm_state_size")), mamba_groups=int(_get(cfg, "n_groups")),
        mamba_chunk=int(_get(cfg, "chunk_size")), mamba_dt_min=max(0.0, dt_limit[0]),
        conv_kernel=int(_get(cfg, "conv_kernel")), moe=moe,
    )


def _export_problems(arch: HybridArch) -> list[str]:
    kinds = [layer.kind for layer in arch.layer_pattern().layers]
    problems = ["Nemotron-H has no multi-token prediction weights; remove arch.mtp"] if arch.mtp is not None else []
    if "gdn" in kinds:
        problems.append("the pattern has Gated DeltaNet layers (G); Nemotron-H has M * - E")
    if "attention" in kinds:
        if arch.rope:
            problems.append("Nemotron-H attention has no positions; set arch.rope: false")
        if arch.qk_norm or arch.qkv_bias or arch.o_bias:
            problems.append("Nemotron-H attention has no QK-norm and no biases (qk_norm, qkv_bias, o_bias)")
    if arch.mlp_act not in ACTIVATIONS:
        problems.append(f"arch.mlp_act {arch.mlp_act!r}: Nemotron-H MLPs are non-gated ({', '.join(ACTIVATIONS)})")
    moe = arch.moe
    if "moe" in kinds and moe is not None:
        wrong = [f"{k}: {getattr(moe, k)!r} (needs {v!r})" for k, v in (
            ("score", "sigmoid"), ("expert_bias", True), ("act", arch.mlp_act), ("shared_gate", False),
            ("quantile_balancing", False), ("router_bias", False), ("norm_eps", ROUTER_NORM_EPS)) if getattr(moe, k) != v]
        if not moe.shared_ffn:
            wrong.append("shared_ffn: 0 (Nemotron-H always has one shared expert)")
        if arch.mlp_bias:
            wrong.append("arch.mlp_bias with MoE layers (the shared expert and latent projections would have biases)")
        problems += [f"arch.moe.{w}" if not w.startswith("arch.") else w for w in wrong]
    return problems


def hf_config_from_arch(arch: HybridArch, model_type: str = MODEL_TYPE) -> dict:
    """A Nemotron-H ``config.json`` dict for ``arch`` (export); MimoError listing what does not fit."""
    problems = _export_problems(arch)
    if problems:
        raise MimoError(f"{MODEL_TYPE} export: " + "; ".join(problems))
    layers = arch.layer_pattern().layers
    kinds = {s.kind for s in layers}
    cfg = {
        "model_type": MODEL_TYPE, "architectures": [ARCHITECTURE], "vocab_size": arch.vocab, "hidden_size": arch.hidden,
        "layers_block_type": [BLOCK_OF_KIND[s.kind] for s in layers],
        "hybrid_override_pattern": "".join(SYMBOL_OF_BLOCK[BLOCK_OF_KIND[s.kind]] for s in layers),  # older readers
        "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads, "head_dim": arch.head_dim,
        "attention_bias": False, "intermediate_size": arch.ffn, "mlp_hidden_act": arch.mlp_act, "mlp_bias": arch.mlp_bias,
        "layer_norm_epsilon": arch.norm_eps, "max_position_embeddings": arch.max_seq_len,
        "initializer_range": arch.init_std, "tie_word_embeddings": False,
    }
    if "mamba" in kinds:
        d_inner = arch.mamba_heads * arch.mamba_head_dim
        cfg.update(mamba_num_heads=arch.mamba_heads, mamba_head_dim=arch.mamba_head_dim, ssm_state_size=arch.mamba_state,
                   n_groups=arch.mamba_groups, conv_kernel=arch.conv_kernel, expand=max(1, d_inner // arch.hidden),
                   chunk_size=arch.mamba_chunk, mamba_hidden_act="silu", use_conv_bias=True, use_bias=False,
                   time_step_limit=[arch.mamba_dt_min, float("inf")], time_step_min=arch.mamba_dt_min or TIME_STEP_MIN,
                   time_step_max=max(0.1, arch.mamba_dt_min))
    if "moe" in kinds:
        m = arch.moe
        cfg.update(n_routed_experts=m.experts, num_experts_per_tok=m.topk, moe_intermediate_size=m.ffn,
                   moe_shared_expert_intermediate_size=m.shared_ffn, moe_latent_size=m.latent or None,
                   norm_topk_prob=m.norm_topk, routed_scaling_factor=m.scale, n_group=m.groups, topk_group=m.group_topk)
    return cfg


# ---------------------------------------------------------------- tensors

# A Mamba-2 tensor of Hugging Face's that is several of ours: its row blocks (``name:label``, in
# row order) -> (our tensor inside the layer's mixer, which of its parts).
SPLIT = {
    "mixer.in_proj.weight": (("z", "in_proj_weight", 0), ("x", "in_proj_weight", 1), ("B", "in_bc_weight", 0),
                             ("C", "in_bc_weight", 1), ("dt", "in_proj_weight", 2)),
    "mixer.conv1d.weight": (("x", "conv_x_weight", 0), ("B", "conv_bc_weight", 0), ("C", "conv_bc_weight", 1)),
    "mixer.conv1d.bias": (("x", "conv_x_bias", 0), ("B", "conv_bc_bias", 0), ("C", "conv_bc_bias", 1)),
}
UNIT_DIM = {"mixer.conv1d.weight": 1}  # Hugging Face's [C, 1, K] is our [C, K]
BUFFERS = ("router.expert_bias",)  # our persistent buffers (inside a layer) that Hugging Face stores


def _layer_tensors(arch: HybridArch, kind: str) -> list[tuple[str, str, int]]:
    """(Hugging Face name inside the block, our name inside the layer, part) of one layer, in
    Hugging Face's order; a ``SPLIT`` tensor as its ``name:label`` row blocks."""
    if kind == "mamba":
        out = [("mixer.dt_bias", "mixer.dt_bias", 0), ("mixer.A_log", "mixer.A_log", 0), ("mixer.D", "mixer.D", 0)]
        for theirs in ("mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.in_proj.weight"):
            out += [(f"{theirs}:{label}", f"mixer.{ours}", part) for label, ours, part in SPLIT[theirs]]
        return out + [("mixer.norm.weight", "mixer.norm_weight", 0), ("mixer.out_proj.weight", "mixer.out_proj.weight", 0)]
    if kind == "attention":
        return [(f"mixer.{p}_proj.weight", "qkv.weight", n) for n, p in enumerate("qkv")] + [
            ("mixer.o_proj.weight", "o_proj.weight", 0)]
    if kind == "mlp":
        kinds = ("weight", "bias") if arch.mlp_bias else ("weight",)
        return [(f"mixer.{proj}.{k}", f"{proj}.{k}", 0) for proj in ("up_proj", "down_proj") for k in kinds]
    if kind == "moe":
        out = [("mixer.experts.up_proj", "experts.up_proj", 0), ("mixer.experts.down_proj", "experts.down_proj", 0),
               ("mixer.gate.weight", "router.weight", 0), ("mixer.gate.e_score_correction_bias", "router.expert_bias", 0),
               ("mixer.shared_experts.up_proj.weight", "shared.up_proj", 0),
               ("mixer.shared_experts.down_proj.weight", "shared.down_proj", 0)]
        if arch.moe.latent:
            out += [("mixer.fc1_latent_proj.weight", "latent_in.weight", 0), ("mixer.fc2_latent_proj.weight", "latent_out.weight", 0)]
        return out
    raise MimoError(f"{MODEL_TYPE}: no Hugging Face block for our layer kind {kind!r}")


def hf_tensor_map(arch: HybridArch, rename: Rename = _same) -> dict[str, tuple[str, int]]:
    """Every Hugging Face tensor of ``arch`` -> (our canonical name, which part of it), in
    Hugging Face's order; buffers included (``BUFFERS``), a ``SPLIT`` tensor as its row blocks
    (``checkpoint_view`` makes them of a checkpoint, ``join_split`` joins them on export)."""
    out = {"model.embeddings.weight": ("embed.weight", 0)}
    for spec in arch.layer_pattern().layers:
        out[f"model.layers.{spec.index}.norm.weight"] = (f"layers.{spec.index}.norm.weight", 0)
        for theirs, ours, part in _layer_tensors(arch, spec.kind):
            out[f"model.layers.{spec.index}.{theirs}"] = (f"layers.{spec.index}.{ours}", part)
    out["model.norm_f.weight"] = ("norm.weight", 0)
    if not arch.tie_embeddings:  # a tied head: the embedding again (the seam's TIED_HEAD)
        out["lm_head.weight"] = ("head.weight", 0)
    return {rename(k): v for k, v in out.items()}


def _split_rows(arch: HybridArch) -> dict[str, tuple[int, ...]]:
    """Rows of each ``SPLIT`` block, by label."""
    d, bc = arch.mamba_heads * arch.mamba_head_dim, arch.mamba_groups * arch.mamba_state
    return {"z": d, "x": d, "B": bc, "C": bc, "dt": arch.mamba_heads}


def _block_of(name: str) -> str | None:
    """The ``SPLIT`` / ``UNIT_DIM`` key a Hugging Face layer tensor name ends with, if any."""
    return next((k for k in SPLIT if name.endswith("." + k)), None)


def join_split(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict from one with ``SPLIT`` row blocks (export): each split tensor
    its blocks concatenated (and its unit dim back), at the place of its first block."""
    out: dict[str, torch.Tensor] = {}
    blocks: dict[str, list[torch.Tensor]] = {}
    for name, t in state.items():
        real, sep, _ = name.rpartition(":")
        if not sep:
            out[name] = t
            continue
        if real not in blocks:
            blocks[real] = []
            out[real] = None  # keeps the place
        blocks[real].append(t)
    for real, parts in blocks.items():
        t = torch.cat(parts)
        dim = UNIT_DIM.get(_block_of(real))
        out[real] = t if dim is None else t.unsqueeze(dim)
    return out


# ---------------------------------------------------------------- checkpoint names

_PER_EXPERT = re.compile(r"^(?P<layer>.*\.mixer\.experts)\.(?P<e>\d+)\.(?P<proj>up_proj|down_proj)\.weight$")


class _Rows:
    """Rows ``lo:lo+n`` of a tensor (indexable by a tuple of slices), without its unit dim."""

    def __init__(self, source, lo: int, n: int, unit_dim: int | None):
        self.source, self.lo, self.n, self.unit_dim = source, lo, n, unit_dim

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        start, stop, _ = index[0].indices(self.n)
        rest = list(index[1:])
        if self.unit_dim is not None:
            rest.insert(self.unit_dim - 1, slice(0, 1))
        t = self.source[(slice(self.lo + start, self.lo + stop), *rest)]
        return t if self.unit_dim is None else t.squeeze(self.unit_dim)


def _hf_names(keys: Iterable[str], shapes: Mapping[str, tuple[int, ...]], get: Callable[[str], object]
              ) -> tuple[dict[str, tuple[int, ...]], dict[str, Callable[[], object]]]:
    """``backbone.`` -> ``model.``, per-expert tensors stacked (lazily), ``mtp.*`` dropped."""
    out_shapes: dict[str, tuple[int, ...]] = {}
    sources: dict[str, Callable[[], object]] = {}
    experts: dict[str, dict[int, str]] = {}
    for key in keys:
        if key.startswith("mtp."):
            continue
        name = "model." + key[len("backbone."):] if key.startswith("backbone.") else key
        m = _PER_EXPERT.match(name)
        if m:
            experts.setdefault(f"{m['layer']}.{m['proj']}", {})[int(m["e"])] = key
            continue
        out_shapes[name] = tuple(shapes[key])
        sources[name] = lambda key=key: get(key)
    for fused, by_expert in experts.items():
        missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
        if missing:
            raise MimoError(f"the checkpoint has per-expert tensors of {fused!r} but none for expert {missing[0]}")
        keys_e = [by_expert[e] for e in range(len(by_expert))]
        odd = next((k for k in keys_e if tuple(shapes[k]) != tuple(shapes[keys_e[0]])), None)
        if odd is not None:
            raise MimoError(f"tensor {odd!r} has shape {tuple(shapes[odd])}, unlike {keys_e[0]!r} {tuple(shapes[keys_e[0]])}")
        out_shapes[fused] = (len(keys_e), *shapes[keys_e[0]])
        sources[fused] = lambda keys_e=keys_e: StackedExperts([[get(k)] for k in keys_e], (shapes[keys_e[0]][0],))
    return out_shapes, sources


def checkpoint_view(arch: HybridArch, keys: Iterable[str], shapes: Mapping[str, tuple[int, ...]],
                    get: Callable[[str], object], source: str = "checkpoint"
                    ) -> tuple[dict[str, tuple[int, ...]], Callable[[str], object]]:
    """(shapes, get) of a Nemotron-H checkpoint under ``hf_tensor_map``'s names: ``state_dict``
    names (``backbone.`` -> ``model.``; per-expert tensors stacked into ``experts.up_proj`` /
    ``down_proj``; ``mtp.*`` dropped) and each ``SPLIT`` tensor as its row blocks. All lazy:
    ``get(name)[index]`` reads only the rows asked for. A split tensor of the wrong shape is a
    MimoError naming it; anything else stays as it is for the usual name / shape check."""
    out_shapes, sources = _hf_names(keys, shapes, get)
    rows = _split_rows(arch)
    for name in [n for n in out_shapes if _block_of(n)]:
        block = _block_of(name)
        labels = [label for label, _, _ in SPLIT[block]]
        sizes = [rows[label] for label in labels]
        shape = out_shapes.pop(name)
        dim = UNIT_DIM.get(block)
        rest = (arch.conv_kernel,) if block == "mixer.conv1d.weight" else (arch.hidden,) if block.endswith("in_proj.weight") else ()
        need = (sum(sizes), *((1,) if dim else ()), *rest)
        if shape != need:
            raise MimoError(f"{source}: tensor {name!r} has shape {shape}, but the model needs {need} "
                            f"(rows {' | '.join(f'{l} {n}' for l, n in zip(labels, sizes))})")
        whole = sources.pop(name)
        for label, lo, n in zip(labels, [sum(sizes[:i]) for i in range(len(sizes))], sizes):
            out_shapes[f"{name}:{label}"] = (n, *rest)
            sources[f"{name}:{label}"] = lambda whole=whole, lo=lo, n=n, dim=dim: _Rows(whole(), lo, n, dim)
    return out_shapes, lambda name: sources[name]()
