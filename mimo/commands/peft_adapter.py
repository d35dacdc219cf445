"""A run's low-rank adapters as a PEFT adapter directory (``mimo export-hf --adapter DIR``).

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

What PEFT cannot hold is refused by name: one Hugging Face tensor with rows of two of our
adapters (two A), adapters whose rows the export does not copy as rows, modules of one run
that differ in DoRA.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Mapping

import torch

from mimo.core.errors import MimoError
from mimo.parallel.lora import AdapterSite

__all__ = ["write_peft_adapter", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _hf_adapters(module: str, sites: list[AdapterSite], state: Mapping[str, torch.Tensor],
                 row_blocks: Mapping[str, list[tuple[str, int, int, int]]]) -> dict[str, list[tuple[int, int, AdapterSite, int]]]:
    """HF tensor -> [(its first row, rows, our adapter, the adapter's first row)] for one module."""
    out: dict[str, list[tuple[int, int, AdapterSite, int]]] = {}
    for site in sites:
        blocks = row_blocks.get(site.weight)
        if blocks is None:
            raise MimoError(f"export-hf --adapter: modules.{module}: the adapter {site.adapter} is on {site.weight}, whose "
                            f"rows Hugging Face does not hold as rows of its own tensors; export with --merge instead")
        lo, hi = site.rows
        for theirs, t0, o0, n in blocks:
            a, b = max(lo, o0), min(hi, o0 + n)
            if b > a:
                out.setdefault(theirs, []).append((t0 + a - o0, b - a, site, a - lo))
    return out


def write_peft_adapter(directory: str, base: str, modules: Mapping[str, tuple[list[AdapterSite], Mapping[str, torch.Tensor],
                                                                            Mapping[str, list[tuple[str, int, int, int]]]]],
                       hf_state: Mapping[str, object]) -> dict:
    """Write the adapters of ``modules`` (name -> (its adapter sites, its full state holding
    the adapters, its row blocks)) as a PEFT directory ``directory`` whose base is the Hugging
    Face directory ``base`` (``hf_state``: its tensors, indexable lazily). Returns a summary."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    specs: dict[str, object] = {}  # HF module -> the spec of its adapter
    for module, (sites, state, row_blocks) in modules.items():
        for theirs, pieces in _hf_adapters(module, sites, state, row_blocks).items():
            owners = {p[2].adapter for p in pieces}
            if len(owners) > 1:
                raise MimoError(f"export-hf --adapter: Hugging Face's {theirs} holds rows of {len(owners)} adapters of "
                                f"modules.{module} ({', '.join(sorted(owners))}); PEFT has one adapter per module: adapt "
                                f"those projections together (one lora target) or export with --merge")
            if theirs not in hf_state or not theirs.endswith(".weight"):
                raise MimoError(f"export-hf --adapter: modules.{module}: {theirs} is not a weight of the exported model")
            site = pieces[0][2]
            A = state[f"{site.adapter}.lora_A"]
            shape = tuple(hf_state[theirs].shape)
            if len(shape) != 2 or shape[1] != A.shape[1]:
                raise MimoError(f"export-hf --adapter: {theirs} has shape {shape}; the adapter {site.adapter} reads {A.shape[1]} "
                                f"input features")
            B, m = state[f"{site.adapter}.lora_B"], state.get(f"{site.adapter}.lora_magnitude")
            B_hf = torch.zeros(shape[0], B.shape[1], dtype=B.dtype)
            covered = torch.zeros(shape[0], dtype=torch.bool)
            m_hf = None if m is None else torch.zeros(shape[0], dtype=m.dtype)
            for t0, n, _, s0 in pieces:
                B_hf[t0:t0 + n] = B[s0:s0 + n]
                covered[t0:t0 + n] = True
                if m is not None:
                    m_hf[t0:t0 + n] = m[s0:s0 + n]
            if m is not None and not bool(covered.all()):  # B = 0 there: m = the base row's norm rescales by one
                rows = torch.as_tensor(hf_state[theirs][(slice(0, shape[0]), slice(0, shape[1]))])
                norms = rows.to(torch.promote_types(rows.dtype, torch.float32)).norm(dim=1)
                m_hf[~covered] = norms[~covered].to(m.dtype)
            name = PREFIX + theirs[: -len(".weight")]
            tensors[f"{name}.lora_A.weight"] = A.detach().contiguous().clone()
            tensors[f"{name}.lora_B.weight"] = B_hf
            if m_hf is not None:
                tensors[f"{name}.lora_magnitude_vector"] = m_hf
            specs[theirs[: -len(".weight")]] = site.spec
    if not specs:
        raise MimoError("export-hf --adapter: the run has no adapters to write")
    doras = {spec.dora for spec in specs.values()}
    if len(doras) > 1:
        raise MimoError("export-hf --adapter: some modules use DoRA and some do not; PEFT's use_dora is one for the whole "
                        "adapter: export with --merge")
    # the commonest rank and alpha for all; the rest per module (PEFT's rank_pattern / alpha_pattern)
    rank, alpha = Counter((s.rank, s.alpha) for s in specs.values()).most_common(1)[0][0]
    config = {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": os.path.abspath(base), "revision": None,
        "r": rank, "lora_alpha": alpha, "lora_dropout": max(s.dropout for s in specs.values()),
        "target_modules": sorted(specs), "use_dora": doras.pop(), "use_rslora": False, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "rank_pattern": {k: s.rank for k, s in specs.items() if s.rank != rank},
        "alpha_pattern": {k: s.alpha for k, s in specs.items() if s.alpha != alpha},
    }
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return {"adapter": directory, "adapted_modules": len(specs), "adapter_tensors": len(tensors),
            "rank": rank, "alpha": alpha, "dora": config["use_dora"]}
