"""A run's low-rank adapters as a PEFT adapter directory (``mimo export-hf --adapter DIR``), and
a PEFT adapter directory as a run's starting adapters (a module's ``lora.init``).

PEFT keeps one adapter per Hugging Face linear module: ``lora_A`` ``[r, in]``, ``lora_B``
``[out, r]`` and, for DoRA, ``lora_magnitude_vector`` ``[out]``, keyed
``base_model.model.<module>.lora_A.weight`` etc. beside an ``adapter_config.json``. Ours sit on
rows of our (often fused) weights; the export's own rules say where each of our rows lands
(``hf_row_blocks`` of the language model, ``rule_row_blocks`` of a tower), so:

* an adapter on rows that land in several Hugging Face tensors (our ``qkv`` with one adapter on
  k | v, written as ``k_proj`` and ``v_proj``) becomes one PEFT adapter per tensor, each with the
  same A and its own rows of B and of the magnitude: ``s B A`` and DoRA's per-row rescaling
  are row by row, so the two compute the same;
* a Hugging Face tensor some of whose rows no adapter of ours covers gets B rows of zero and,
  for DoRA, magnitudes equal to those base rows' norms (a rescaling by exactly one).

* an adapter per expert (A ``[E, r, in]``, B ``[E, out, r]`` on our 3-D expert weights) is
  PEFT's adapter on that parameter of the experts module (``target_parameters``: ``lora_A``
  ``[E r, in]``, ``lora_B`` ``[out, r E]``; a module's second targeted parameter wraps the
  first, whose keys gain ``base_layer.``), without dropout, which PEFT refuses there.

What PEFT cannot hold is refused by name: one Hugging Face tensor with rows of two of our
adapters (two A), adapters whose rows the export does not copy as rows, modules of one run
that differ in DoRA.

Reading one (``read_peft_adapter``) inverts the same rules: each adapter of ours takes its A from
the PEFT modules its rows land in (the same A in each, else an error), its B and magnitude rows
from theirs; the PEFT modules are found under the base model's own names (a causal LM's, or
inside a LLaVA or a Qwen3-VL: ``module_row_blocks`` lists the candidates). Rank, scale and DoRA
must be the config's; a PEFT module no adapter of ours reads, or rows of one that ours do not
cover holding a nonzero B, are errors: nothing of the adapter is dropped silently.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import Mapping

import torch

from mimo.core.errors import MimoError
from mimo.parallel.lora import AdapterSite

__all__ = ["write_peft_adapter", "read_peft_adapter", "read_peft_modules", "peft_modules", "module_row_blocks", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]

RowBlocks = Mapping[str, list[tuple[str, int, int, int]]]  # ours -> [(HF name, its first row, our first row, rows)]

# PEFT refuses LoRA on these modules of these model types (peft.tuners.tuners_utils, _check_lora_target_modules_mamba)
PEFT_MAMBA_TYPES = ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h")
PEFT_NOT_ON_MAMBA = ("out_proj", "conv1d")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _hf_adapters(module: str, sites: list[AdapterSite], row_blocks: RowBlocks) -> dict[str, list[tuple[int, int, AdapterSite, int]]]:
    """HF tensor -> [(its first row, rows, our adapter, the adapter's first row)] for one module."""
    out: dict[str, list[tuple[int, int, AdapterSite, int]]] = {}
    for site in sites:
        blocks = row_blocks.get(site.weight)
        if blocks is None:
            raise MimoError(f"modules.{module}: the adapter {site.adapter} is on {site.weight}, whose rows Hugging Face "
                            f"does not hold as rows of its own tensors: no PEFT adapter holds it (export with --merge)")
        lo, hi = site.rows
        for theirs, t0, o0, n in blocks:
            a, b = max(lo, o0), min(hi, o0 + n)
            if b > a:
                out.setdefault(theirs, []).append((t0 + a - o0, b - a, site, site.first + a - lo))
    return out


def write_peft_adapter(directory: str, base: str, modules: Mapping[str, tuple[list[AdapterSite], Mapping[str, torch.Tensor],
                                                                            list[RowBlocks]]],
                       hf_state: Mapping[str, object], model_type: str | None = None) -> dict:
    """Write the adapters of ``modules`` (name -> (its adapter sites, its full state holding
    the adapters, its candidate row rules: ``module_row_blocks``)) as a PEFT directory
    ``directory`` whose base is the Hugging Face directory ``base`` (``hf_state``: its tensors,
    indexable lazily; each adapter goes to the module of it that its rows land in; ``model_type``:
    its config's). Returns a summary."""
    from safetensors.torch import save_file

    weights = {key[: -len(".weight")]: key for key in hf_state if key.endswith(".weight")}
    weights.update({key: key for key in hf_state if not key.endswith((".weight", ".bias"))})  # (expert parameters)
    tensors: dict[str, torch.Tensor] = {}
    specs: dict[str, object] = {}  # HF module (or expert parameter) -> the spec of its adapter
    params: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # HF module -> its parameter -> (A, B)
    renamed = _peft_moe_renamed(model_type)
    for module, (sites, state, candidates) in modules.items():
        try:
            lost, placed, _ = _place(module, sites, candidates, weights)
        except MimoError as e:
            raise MimoError(f"export-hf --adapter: {e}") from None
        if lost:
            raise MimoError(f"export-hf --adapter: modules.{module}: {lost} of the Hugging Face tensors its adapters' rows "
                            f"land in are not weights of the exported model: export with --merge")
        for hf_module, pieces in placed.items():
            theirs = weights[hf_module]
            if theirs.endswith(".weight") and hf_module.rpartition(".")[2] in renamed:
                raise MimoError(f"export-hf --adapter: PEFT reads LoRA on modules named {', '.join(sorted(renamed))} of a "
                                f"{model_type} model as adapters on its experts (its transformers v4 -> v5 conversion), so "
                                f"modules.{module}'s adapter {pieces[0][2].adapter} on {hf_module} would load onto the "
                                f"experts: leave the dense MLP / shared expert (gate, up, down, shared) out of "
                                f"lora.targets, or export with --merge")
            if model_type in PEFT_MAMBA_TYPES and hf_module.rpartition(".")[2] in PEFT_NOT_ON_MAMBA:
                raise MimoError(f"export-hf --adapter: PEFT takes no LoRA on {hf_module.rpartition('.')[2]} of a Mamba-based "
                                f"model ({model_type}: its fused kernels read that weight directly), where modules.{module}'s "
                                f"adapter {pieces[0][2].adapter} lands: leave that projection (mamba_out) out of lora.targets, "
                                f"or export with --merge")
            owners = {p[2].adapter for p in pieces}
            if len(owners) > 1:
                raise MimoError(f"export-hf --adapter: Hugging Face's {theirs} holds rows of {len(owners)} adapters of "
                                f"modules.{module} ({', '.join(sorted(owners))}); PEFT has one adapter per module: adapt "
                                f"those projections together (one lora target) or export with --merge")
            site = pieces[0][2]
            A = state[f"{site.adapter}.lora_A"]  # [r, in], or [E, r, in] per expert
            shape = tuple(hf_state[theirs].shape)
            if len(shape) != A.dim() or shape[-1] != A.shape[-1] or shape[:-2] != tuple(A.shape[:-2]):
                raise MimoError(f"export-hf --adapter: {theirs} has shape {shape}; the adapter {site.adapter} has A of "
                                f"shape {tuple(A.shape)}")
            B, m = state[f"{site.adapter}.lora_B"], state.get(f"{site.adapter}.lora_magnitude")
            B_hf = torch.zeros(*shape[:-1], B.shape[-1], dtype=B.dtype)
            covered = torch.zeros(shape[-2], dtype=torch.bool)
            m_hf = None if m is None else torch.zeros(shape[0], dtype=m.dtype)
            for t0, n, _, s0 in pieces:
                B_hf[..., t0:t0 + n, :] = B[..., s0:s0 + n, :]
                covered[t0:t0 + n] = True
                if m is not None:
                    m_hf[t0:t0 + n] = m[s0:s0 + n]
            if m is not None and not bool(covered.all()):  # B = 0 there: m = the base row's norm rescales by one
                rows = torch.as_tensor(hf_state[theirs][(slice(0, shape[0]), slice(0, shape[1]))])
                norms = rows.to(torch.promote_types(rows.dtype, torch.float32)).norm(dim=1)
                m_hf[~covered] = norms[~covered].to(m.dtype)
            specs[hf_module] = site.spec
            if not theirs.endswith(".weight"):  # an expert parameter: PEFT's target_parameters, written below
                holder, _, param = hf_module.rpartition(".")
                params.setdefault(holder, {})[param] = (A.detach(), B_hf)
                continue
            name = PREFIX + hf_module
            tensors[f"{name}.lora_A.weight"] = A.detach().contiguous().clone()
            tensors[f"{name}.lora_B.weight"] = B_hf
            if m_hf is not None:
                tensors[f"{name}.lora_magnitude_vector"] = m_hf
    for holder, adapted in params.items():
        order = sorted(adapted, key=_wrapping_order)
        for k, param in enumerate(order):  # PEFT's wrapper of the first parameter is innermost: base_layer. each
            A_ErI, B_EoR = adapted[param]
            E, r, fan_in = A_ErI.shape
            name = PREFIX + holder + ".base_layer" * (len(order) - 1 - k)
            tensors[f"{name}.lora_A.weight"] = A_ErI.reshape(E * r, fan_in).contiguous().clone()  # rows e*r + k
            tensors[f"{name}.lora_B.weight"] = B_EoR.permute(1, 2, 0).reshape(B_EoR.shape[1], r * E).contiguous()  # cols k*E + e
    if not specs:
        raise MimoError("export-hf --adapter: the run has no adapters to write")
    doras = {spec.dora for spec in specs.values()}
    if len(doras) > 1:
        raise MimoError("export-hf --adapter: some modules use DoRA and some do not; PEFT's use_dora is one for the whole "
                        "adapter: export with --merge")
    # the commonest rank and alpha for all; the rest per module (PEFT's rank_pattern / alpha_pattern)
    rank, alpha = Counter((s.rank, s.alpha) for s in specs.values()).most_common(1)[0][0]
    targeted = {f"{holder}.{param}" for holder, adapted in params.items() for param in adapted}
    config = {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": os.path.abspath(base), "revision": None,
        # (PEFT's adapters on parameters take no dropout: a training setting, the weights do not depend on it)
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0 if targeted else max(s.dropout for s in specs.values()),
        "target_modules": sorted(set(specs) - targeted), "use_dora": doras.pop(), "use_rslora": False, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "rank_pattern": {k: s.rank for k, s in specs.items() if s.rank != rank},
        "alpha_pattern": {k: s.alpha for k, s in specs.items() if s.alpha != alpha},
    }
    if targeted:
        config["target_parameters"] = sorted(targeted)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return {"adapter": directory, "adapted_modules": len(specs), "adapter_tensors": len(tensors),
            "rank": rank, "alpha": alpha, "dora": config["use_dora"], "adapted_parameters": len(targeted)}


# PEFT (0.18+) renames the targets of these MoE model types from transformers v4's per-expert modules to v5's
# fused expert parameters whatever module the name belongs to (peft.utils.transformers_weight_conversion); this
# copy serves where peft is not installed
_PEFT_MOE_RENAMES = {"qwen2_moe": ("gate", "gate_proj", "up_proj", "down_proj"), "mixtral": ("gate", "w1", "w2", "w3")}
_PEFT_MOE_TYPES = {**{t: "qwen2_moe" for t in ("qwen3_moe", "qwen3_next", "deepseek_v2", "deepseek_v3", "deepseek_v32",
                                              "olmoe", "glm4_moe", "ernie4_5_moe", "dots1", "hunyuan_v1_moe")},
                   "mixtral": "mixtral", "minimax": "mixtral"}


def _peft_moe_renamed(model_type: str | None) -> set[str]:
    """Module names whose LoRA PEFT moves onto a model type's experts (none for most)."""
    try:
        from peft.utils import transformers_weight_conversion as conversion

        pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        return set(conversion._MOE_TARGET_MODULE_MAPPING.get(pattern, {})) if pattern else set()
    except (ImportError, AttributeError):  # (no peft here, or one without the conversion)
        return set(_PEFT_MOE_RENAMES.get(_PEFT_MOE_TYPES.get(model_type), ()))


def _wrapping_order(param: str) -> tuple[int, str]:
    """The order PEFT wraps a module's targeted parameters in (its registration order: a
    transformers experts module registers its up projection, gate_up_proj or up_proj, before
    down_proj), the first innermost."""
    return ("down" in param, param)


def _parameter_adapters(modules: dict[str, dict[str, torch.Tensor]], conf: dict, what: str) -> dict[str, dict[str, torch.Tensor]]:
    """PEFT's adapters on expert parameters (``target_parameters``; ``lora_A`` ``[E r, in]``,
    ``lora_B`` ``[out, r E]`` under the holding module, ``base_layer.`` once per wrapper outside
    it) as ``{holder.param: {lora_A [E, r, in], lora_B [E, out, r]}}``; other modules as they are."""
    targets = [t.rpartition(".") for t in conf.get("target_parameters") or []]
    out = {}
    for name, tensors in modules.items():
        holder, depth = name, 0
        while holder.endswith(".base_layer"):
            holder, depth = holder[: -len(".base_layer")], depth + 1
        mine = sorted({p for m, _, p in targets if not m or holder == m or holder.endswith("." + m)}, key=_wrapping_order)
        if not mine:
            out[name] = tensors
            continue
        if depth >= len(mine) or "lora_magnitude_vector" in tensors:
            raise MimoError(f"{what}: {name} is no adapter of a parameter of {holder} ({', '.join(mine)})")
        param = mine[len(mine) - 1 - depth]
        r = _pattern_value(conf.get("rank_pattern") or {}, f"{holder}.{param}", conf.get("r"))
        A, B = tensors["lora_A"], tensors["lora_B"]
        E = A.shape[0] // r
        out[f"{holder}.{param}"] = {"lora_A": A.reshape(E, r, A.shape[1]), "lora_B": B.reshape(B.shape[0], r, E).permute(2, 0, 1)}
    return out


# ---------------------------------------------------------------- reading


def module_row_blocks(cfg, llm: bool) -> list[RowBlocks]:
    """Candidate row rules of a module (its config ``cfg``; ``llm``: the language model) under the names a PEFT adapter of a Hugging Face
    model of it may use, first match wins: the language model as a causal LM, inside a LLaVA
    (either naming) or inside a Qwen3-VL (or Kimi-K2.5); a tower's rules without their prefix (found by
    suffix: ``encoder.layers.0.self_attn.q_proj`` under any LLaVA or CLIP prefix)."""
    from mimo.encoders.weights import rule_row_blocks
    from mimo.llm.hf import LLAVA_LM, _same, hf_row_blocks, llava_lm_key, qwen3_vl_lm_key

    if llm:
        renames = [_same, qwen3_vl_lm_key, *[(lambda k, pair=pair: llava_lm_key(k, *pair)) for pair in LLAVA_LM.values()]]
        out = []
        for rename in renames:
            try:
                out.append(hf_row_blocks(cfg.arch, rename))
            except MimoError:  # (a family whose names this rename does not take)
                continue
        return out
    if cfg.native:
        from mimo.encoders.config import NATIVE_TOWERS

        hf_rules = NATIVE_TOWERS[cfg.kind].hf_module().hf_rules
    else:
        from mimo.encoders.hf_import import hf_rules
    return [{f"tower.{ours}": blocks for ours, blocks in rule_row_blocks(hf_rules(cfg.arch, "")).items()}]


def _pattern_value(patterns: Mapping[str, object], module: str, default):
    """PEFT's per-module override: the value of the first pattern the module's name ends with."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return value
    return default


def _read_dir(directory: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(adapter_config.json, PEFT module -> {lora_A, lora_B, lora_magnitude_vector})."""
    from safetensors.torch import load_file

    conf_file, weights = os.path.join(directory, ADAPTER_CONFIG), os.path.join(directory, ADAPTER_WEIGHTS)
    for f in (conf_file, weights):
        if not os.path.isfile(f):
            raise MimoError(f"lora.init {directory}: no {os.path.basename(f)} (a PEFT adapter directory as "
                            f"save_pretrained or mimo export-hf --adapter writes it)")
    with open(conf_file) as f:
        conf = json.load(f)
    if conf.get("peft_type") != "LORA":
        raise MimoError(f"lora.init {directory}: a {conf.get('peft_type')} adapter; mimo reads LoRA / DoRA ones")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(weights).items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.(lora_A|lora_B)\.weight|base_model\.model\.(.+)\.(lora_magnitude_vector)", key)
        if m is None:
            raise MimoError(f"lora.init {directory}: tensor {key!r} is not a LoRA weight (embedding adapters, "
                            f"modules_to_save and bias training are not read)")
        modules.setdefault(m.group(1) or m.group(3), {})[m.group(2) or m.group(4)] = t
    return conf, _parameter_adapters(modules, conf, f"lora.init {directory}")


def _resolve(theirs: str, modules: Mapping[str, dict]) -> str | None:
    name = theirs[: -len(".weight")] if theirs.endswith(".weight") else theirs
    if name in modules:
        return name
    found = [m for m in modules if m.endswith("." + name)]
    return found[0] if len(found) == 1 else None


def _place(module: str, sites: list[AdapterSite], candidates: list[RowBlocks], names: Mapping[str, object]
           ) -> tuple[int, dict[str, list[tuple[int, int, AdapterSite, int]]], set[str]]:
    """Our adapters among the Hugging Face modules ``names`` (PEFT's, or the exported model's),
    by the first candidate naming under which all are found (else the one that finds most):
    (how many HF tensors were not found, HF module -> [(its first row, rows, our adapter, the
    adapter's first row)], the modules of ``names`` that are this module's projections)."""
    best, error = None, None
    for blocks in candidates:
        try:
            raw = _hf_adapters(module, sites, blocks)
        except MimoError as e:  # (our rows are not HF rows under this naming)
            error = e
            continue
        placed: dict[str, list[tuple[int, int, AdapterSite, int]]] = {}
        lost = 0
        for theirs, pieces in raw.items():
            name = _resolve(theirs, names)
            if name is None:
                lost += 1
            else:
                placed.setdefault(name, []).extend(pieces)
        if best is None or lost < best[0]:
            best = (lost, placed, {_resolve(t, names) for bs in blocks.values() for t, *_ in bs} - {None})
        if lost == 0:
            break
    if best is None:
        raise error
    return best


def read_peft_adapter(directory: str, module: str, sites: list[AdapterSite], candidates: list[RowBlocks]
                      ) -> dict[str, torch.Tensor]:
    """The full tensors of ``sites`` (one module's adapters, ``module`` its name) from the PEFT
    adapter directory ``directory``, by the names of the module's one-process state."""
    return read_peft_modules(directory, module, sites, candidates)[0]


def peft_modules(directory: str) -> list[str]:
    """The Hugging Face modules a PEFT adapter directory adapts."""
    return sorted(_read_dir(directory)[1])


def read_peft_modules(directory: str, module: str, sites: list[AdapterSite], candidates: list[RowBlocks]
                      ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """``read_peft_adapter``'s tensors, and the PEFT modules they were read from."""
    conf, modules = _read_dir(directory)
    what = f"modules.{module}.lora.init {directory}"
    if conf.get("use_rslora"):
        raise MimoError(f"{what}: use_rslora scales by alpha / sqrt(r); mimo's adapters scale by alpha / r")
    try:
        lost, placed, owned = _place(module, sites, candidates, modules)
    except MimoError as e:
        raise MimoError(f"{what}: {e}") from None
    if lost:
        raise MimoError(f"{what}: holds no adapter for some of the projections modules.{module}.lora.targets adapts "
                        f"(its modules: {', '.join(sorted(modules)[:4])} ...): adapt what the adapter adapts")
    by_site: dict[str, list[tuple[str, int, int, int]]] = {}
    for peft_module, pieces in placed.items():
        for t0, n, site, s0 in pieces:
            by_site.setdefault(site.adapter, []).append((peft_module, t0, n, s0))
    out: dict[str, torch.Tensor] = {}
    used: dict[str, torch.Tensor] = {}  # PEFT module -> rows of it that ours cover
    rows_of: dict[str, int] = {}  # our adapter -> its rows (over every weight it adapts)
    for site in sites:
        rows_of[site.adapter] = max(rows_of.get(site.adapter, 0), site.first + site.rows[1] - site.rows[0])
    for site in {s.adapter: s for s in sites}.values():
        spec = site.spec
        A = None
        m = torch.zeros(rows_of[site.adapter]) if spec.dora else None
        for peft_module, t0, n, s0 in by_site[site.adapter]:
            theirs = modules[peft_module]
            r = _pattern_value(conf.get("rank_pattern") or {}, peft_module, conf.get("r"))
            alpha = _pattern_value(conf.get("alpha_pattern") or {}, peft_module, conf.get("lora_alpha"))
            if theirs["lora_A"].shape[-2] != spec.rank or r != spec.rank or abs(alpha / r - spec.scale) > 1e-9 * spec.scale:
                raise MimoError(f"{what}: {peft_module} has rank {theirs['lora_A'].shape[-2]} and alpha {alpha}; "
                                f"modules.{module}.lora says rank {spec.rank}, alpha {spec.alpha}")
            if ("lora_magnitude_vector" in theirs) != spec.dora or bool(conf.get("use_dora")) != spec.dora:
                raise MimoError(f"{what}: use_dora is {bool(conf.get('use_dora'))}; modules.{module}.lora.dora is {spec.dora}")
            if A is None:
                A = theirs["lora_A"]
                B = torch.zeros(*A.shape[:-2], rows_of[site.adapter], spec.rank)  # (per expert: [E, out, r])
            elif not torch.equal(A, theirs["lora_A"]):
                raise MimoError(f"{what}: {peft_module} and another PEFT module hold different A, where mimo's adapter "
                                f"{site.adapter} has one: adapt those projections separately (lora.targets)")
            B[..., s0:s0 + n, :] = theirs["lora_B"][..., t0:t0 + n, :]
            if m is not None:
                m[s0:s0 + n] = theirs["lora_magnitude_vector"][t0:t0 + n]
            rows = used.setdefault(peft_module, torch.zeros(theirs["lora_B"].shape[-2], dtype=torch.bool))
            rows[t0:t0 + n] = True
        out[f"{site.adapter}.lora_A"] = A.float()
        out[f"{site.adapter}.lora_B"] = B
        if m is not None:
            out[f"{site.adapter}.lora_magnitude"] = m
    unread = sorted(owned - set(used))
    if unread:
        raise MimoError(f"{what}: adapts {', '.join(unread[:3])}{' ...' if len(unread) > 3 else ''}, which "
                        f"modules.{module}.lora.targets does not: nothing of the adapter is left out")
    for peft_module, rows in used.items():
        if not bool(rows.all()) and bool(modules[peft_module]["lora_B"][..., ~rows, :].any()):
            raise MimoError(f"{what}: {peft_module}'s adapter changes rows no adapter of modules.{module} covers")
    return out, set(used)
