"""Hugging Face Qwen3-VL (and Qwen3.5) vision tower weights <-> ``encoders.qwen3_vl.Qwen3VisionTower``.

Explicit rules (``encoders.weights.Rule``), each checked against the shapes the configured
``Qwen3VisionArch`` implies. In ``Qwen3VLForConditionalGeneration`` (and its checkpoints) the
tower sits under ``model.visual.``; a bare ``Qwen3VLVisionModel`` has no prefix (``prefix=""``).
Qwen3.5's tower (``Qwen3_5ForConditionalGeneration`` and its MoE) is the same without deepstack:
its arch has no ``deepstack_layers``, so no deepstack merger rules.
Every tensor keeps its layout; only names change (HF's fused ``qkv`` is mimo's q | k | v order
already: ``reshape(T, 3, heads, K)``).

Mapping (HF, under the prefix -> mimo):

    patch_embed.proj.{weight [D, C, tp, p, p], bias}  -> patch_embed.{weight, bias}
    pos_embed.weight [side^2, D]                      -> pos_embed
    blocks.i.norm1 / norm2.{weight, bias}             -> blocks.i.norm1 / norm2.*
    blocks.i.attn.qkv.{weight [3D, D], bias}          -> blocks.i.attn.qkv.*
    blocks.i.attn.proj.*                              -> blocks.i.attn.proj.*
    blocks.i.mlp.linear_fc1 / linear_fc2.*            -> blocks.i.mlp.fc1 / fc2.*
    merger.norm.* [D]                                 -> merger.norm.*
    merger.linear_fc1 / linear_fc2.*                  -> merger.fc1 / fc2.*
    deepstack_merger_list.k.norm.* [M]                -> deepstack_mergers.k.norm.*
    deepstack_merger_list.k.linear_fc1 / fc2.*        -> deepstack_mergers.k.fc1 / fc2.*

Tensors outside the prefix (the language model, ``lm_head``) are left alone; a tensor under the
prefix that no rule claims (a block beyond ``depth``, a deepstack merger too many) is an error.

``import_hf(DIR, arch)``: a checkpoint directory (``config.json`` of a Qwen3-VL / Qwen3.5 model type,
``NATIVE_TOWERS['qwen3_vl'].model_types``,
``model.safetensors`` or its shards), its vision config checked against ``arch`` and its tower
tensors left in their files (each rank reads its own slices when the tower loads them): what
``modules.<name>.init.hf`` of a ``kind: qwen3_vl`` encoder loads; ``shapes_only``: the same
checks on the safetensors headers (``mimo check-config``).
"""

from __future__ import annotations

from typing import Mapping

import torch

from mimo.core.errors import MimoError
from mimo.encoders.qwen3_vl import Qwen3VisionArch
from mimo.encoders.weights import ImportedWeights, Rule, check_arch_fields, map_state, materialize, state_to_theirs

__all__ = ["DEFAULT_PREFIX", "TOWER_PREFIXES", "hf_rules", "import_hf_state", "import_hf", "import_native_hf", "check_arch",
           "tower_state_from_hf", "tower_state_to_hf"]

DEFAULT_PREFIX = "model.visual."  # Qwen3VLForConditionalGeneration's (and its checkpoints') tower prefix
TOWER_PREFIXES = (DEFAULT_PREFIX,)  # where a whole model's checkpoint keeps the tower's tensors


def hf_rules(arch: Qwen3VisionArch, prefix: str = DEFAULT_PREFIX) -> list[Rule]:
    """One rule per tower tensor, in the tower's parameter order."""
    D, F_, C, tp, p = arch.hidden, arch.mlp, arch.channels, arch.temporal_patch, arch.patch
    M, O = arch.merge_width, arch.out_hidden

    def same(ours: str, theirs: str, *shape: int) -> Rule:
        return Rule(ours, (prefix + theirs,), tuple(shape), tuple(shape))

    def linear(ours: str, theirs: str, out: int, inp: int) -> list[Rule]:
        return [same(f"{ours}.weight", f"{theirs}.weight", out, inp), same(f"{ours}.bias", f"{theirs}.bias", out)]

    def norm(ours: str, theirs: str, n: int) -> list[Rule]:
        return [same(f"{ours}.weight", f"{theirs}.weight", n), same(f"{ours}.bias", f"{theirs}.bias", n)]

    def merger(ours: str, theirs: str, norm_width: int) -> list[Rule]:
        return (norm(f"{ours}.norm", f"{theirs}.norm", norm_width) + linear(f"{ours}.fc1", f"{theirs}.linear_fc1", M, M)
                + linear(f"{ours}.fc2", f"{theirs}.linear_fc2", O, M))

    rules = [same("patch_embed.weight", "patch_embed.proj.weight", D, C, tp, p, p),
             same("patch_embed.bias", "patch_embed.proj.bias", D),
             same("pos_embed", "pos_embed.weight", arch.num_position_embeddings, D)]
    for i in range(arch.depth):
        b = f"blocks.{i}."
        rules += norm(b + "norm1", b + "norm1", D)
        rules += linear(b + "attn.qkv", b + "attn.qkv", 3 * D, D) + linear(b + "attn.proj", b + "attn.proj", D, D)
        rules += norm(b + "norm2", b + "norm2", D)
        rules += linear(b + "mlp.fc1", b + "mlp.linear_fc1", F_, D) + linear(b + "mlp.fc2", b + "mlp.linear_fc2", D, F_)
    rules += merger("merger", "merger", D)
    for k in range(len(arch.deepstack_layers)):
        rules += merger(f"deepstack_mergers.{k}", f"deepstack_merger_list.{k}", M)
    return rules


def _unmapped(arch: Qwen3VisionArch, prefix: str):
    def decide(key: str) -> str | None:
        if not key.startswith(prefix):
            return None  # another part of the model (the language model, lm_head)
        rest = key[len(prefix):]
        if rest.startswith("rotary_pos_emb."):
            return None  # a buffer (inv_freq) some saves carry; the tower computes it
        parts = rest.split(".")
        if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) >= arch.depth:
            return f"tensor {key!r} belongs to block {parts[1]}, but arch.depth is {arch.depth}"
        if parts[0] == "deepstack_merger_list" and len(parts) > 1 and parts[1].isdigit():
            return (f"tensor {key!r} belongs to deepstack merger {parts[1]}, but arch.deepstack_layers "
                    f"{list(arch.deepstack_layers)} has {len(arch.deepstack_layers)}")
        return f"tensor {key!r} has no place in the Qwen3-VL vision tower"

    return decide


def import_hf_state(state: Mapping[str, torch.Tensor], arch: Qwen3VisionArch, prefix: str = DEFAULT_PREFIX,
                    where: str = "Hugging Face Qwen3-VL state dict") -> ImportedWeights:
    """The tower's tensors of a Hugging Face state dict (tensors, or ``LazyTensor``s left in
    their safetensors file: then read region by region when a rank loads its slices), with
    everything needed to write the state dict back (``ImportedWeights.export``)."""
    return map_state(state, hf_rules(arch, prefix), source="hf-qwen3-vl", where=where, arch=arch,
                     unmapped=_unmapped(arch, prefix), meta={"prefix": prefix})


def tower_state_from_hf(hf_state: Mapping[str, torch.Tensor], arch: Qwen3VisionArch,
                        prefix: str = DEFAULT_PREFIX) -> dict[str, torch.Tensor]:
    """{mimo name: tensor} of the tower in ``hf_state`` (``MimoError`` naming the first missing
    tensor, wrong shape or unclaimed tower tensor). Tensors outside ``prefix`` are ignored."""
    imported = import_hf_state(hf_state, arch, prefix)
    return {name: materialize(t) for name, t in imported.tower.items()}


def tower_state_to_hf(state: Mapping[str, torch.Tensor], arch: Qwen3VisionArch,
                      prefix: str = DEFAULT_PREFIX) -> dict[str, torch.Tensor]:
    """{Hugging Face name: tensor} of a full mimo tower state (``full_state()``, or full
    gradients): the inverse of ``tower_state_from_hf``, exact."""
    return state_to_theirs(state, hf_rules(arch, prefix), "Qwen3-VL tower")


def check_arch(configured: Qwen3VisionArch, source: Qwen3VisionArch, where: str) -> None:
    """MimoError naming every field where the configured tower differs from the checkpoint's
    vision config (heads, activation, rope and deepstack indices do not show as shapes)."""
    check_arch_fields(configured, source, where)


def import_native_hf(path: str, kind: str, arch=None, shapes_only: bool = False) -> ImportedWeights:
    """The tower of the Hugging Face checkpoint directory ``path`` of a native kind's model
    (``NATIVE_TOWERS[kind]``: its model types, arch class and ``import_hf_state``), mapped onto
    ``arch`` (default: the checkpoint's own; MimoError naming each field where they differ), left in
    its safetensors files (``LazyTensor``: read region by region when loaded); ``shapes_only``: meta
    tensors from the headers, nothing read. ``meta`` holds the whole ``config.json`` (``config``)."""
    from mimo.encoders.config import NATIVE_TOWERS
    from mimo.encoders.hf_import import load_hf_state, read_config_json

    tower = NATIVE_TOWERS[kind]
    config = read_config_json(path)
    where = f"checkpoint {path!r}"
    if config.get("model_type") not in tower.model_types:
        raise MimoError(f"{where}: model_type {config.get('model_type')!r} is not a {tower.title} model "
                        f"({', '.join(tower.model_types)}); a kind: {kind} encoder loads the vision tower of one")
    source = tower.arch.from_hf_config(config)
    arch = source if arch is None else arch
    check_arch_fields(arch, source, where)
    state = load_hf_state(path, shapes_only=shapes_only, lazy=not shapes_only)
    weights = tower.hf_module().import_hf_state(state, arch, where=where)
    weights.meta["config"] = config
    return weights


def import_hf(path: str, arch: Qwen3VisionArch | None = None, shapes_only: bool = False) -> ImportedWeights:
    """The tower of the Hugging Face Qwen3-VL / Qwen3.5 checkpoint directory ``path``
    (``import_native_hf``, module doc)."""
    return import_native_hf(path, "qwen3_vl", arch, shapes_only)
