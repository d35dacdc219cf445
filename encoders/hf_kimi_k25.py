"""Hugging Face Kimi-K2.5 tower and projector weights <-> ``encoders.moonvit.MoonViTTower``.

Explicit rules (``encoders.weights.Rule``), each checked against the shapes the configured
``MoonViTArch`` implies. Kimi-K2.5's tensors come under three namings, told apart by their keys
(``checkpoint_naming``), and all three import:

* ``state_dict``: transformers' ``Kimi_K25ForConditionalGeneration.state_dict()`` names, what
  ``from_pretrained`` loads as they are, and what ``tower_state_to_hf`` (export, gradients) writes;
* ``original``: Moonshot's published checkpoints (``moonshotai/Kimi-K2.5``), which transformers
  converts on load: q | k | v fused as ``wqkv``, each head's q and k rows in rotary pairs
  (interleaved: rows 2i, 2i + 1 rotate together) where transformers keeps the halves (rows i,
  i + K/2): the ``RowsRule`` below reorders them exactly as transformers' ``PermuteForRope``;
* ``saved``: what transformers' ``save_pretrained`` writes (its conversion reversed): the original
  names, but the patch embedding under ``vision_tower.encoder.`` and the projector's norm under
  ``model.mm_projector.`` (the language model's decoder layers there under ``blocks.``:
  ``mimo.llm.hf`` reads them).

Mapping (``state_dict`` name / ``original`` name -> mimo; ``i`` a block, K the head size):

    model.vision_tower.patch_embed.proj.{weight [D, 3, p, p], bias}
        / vision_tower.patch_embed.proj.*                       -> patch_embed.{weight, bias}
    model.vision_tower.patch_embed.pos_emb.position_embeddings [side, side, D]
        / vision_tower.patch_embed.pos_emb.weight               -> pos_embed
    model.vision_tower.layers.i.norm1 / norm2.*
        / vision_tower.encoder.blocks.i.norm0 / norm1.*         -> blocks.i.norm1 / norm2.*
    model.vision_tower.layers.i.attn.q_proj | k_proj | v_proj.*
        / vision_tower.encoder.blocks.i.wqkv.* (q, k rows paired) -> blocks.i.attn.qkv.* (q | k | v rows)
    model.vision_tower.layers.i.attn.proj.* / ...blocks.i.wo.*  -> blocks.i.attn.proj.*
    model.vision_tower.layers.i.mlp.fc1 / fc2.*
        / vision_tower.encoder.blocks.i.mlp.fc0 / fc1.*         -> blocks.i.mlp.fc1 / fc2.*
    model.vision_tower.final_layernorm.* / vision_tower.encoder.final_layernorm.* -> final_norm.*
    model.mm_projector.pre_norm.* [D] / mm_projector.pre_norm.* -> merger.norm.*
    model.mm_projector.in_proj / out_proj.* / mm_projector.proj.0 / proj.2.* -> merger.fc1 / fc2.*

Tensors of the language model (``model.language_model.*``, ``language_model.*``, ``lm_head.weight``)
are left alone; a tower tensor no rule claims (a block beyond ``depth``) is an error.

``import_hf(DIR, arch)``: a checkpoint directory (``config.json`` of model_type ``kimi_k25``,
safetensors weights), its config checked against ``arch`` and its tower tensors left in their
files (each rank reads its own slices); ``shapes_only``: the same checks on the headers.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from mimo.encoders.config import MoonViTArch
from mimo.encoders.weights import ImportedWeights, Rule, RowsRule, map_state, materialize, state_to_theirs

__all__ = ["DEFAULT_PREFIX", "TOWER_PREFIXES", "NAMINGS", "checkpoint_naming", "hf_rules", "import_hf_state", "import_hf",
           "tower_state_from_hf", "tower_state_to_hf", "rotary_pairs_rows"]

DEFAULT_PREFIX = "model."  # Kimi_K25ForConditionalGeneration's: model.vision_tower., model.mm_projector.
NAMINGS = ("state_dict", "original", "saved")
# where a whole model's checkpoint keeps the tower's and projector's tensors (any naming)
TOWER_PREFIXES = ("model.vision_tower.", "model.mm_projector.", "vision_tower.", "mm_projector.")


def checkpoint_naming(keys: Iterable[str]) -> str:
    """Which naming a Kimi-K2.5 checkpoint's tensors use (module doc)."""
    keys = set(keys)
    if any(k.startswith("vision_tower.encoder.blocks.") for k in keys) or "vision_tower.patch_embed.pos_emb.weight" in keys:
        return "saved" if "vision_tower.encoder.patch_embed.proj.weight" in keys else "original"
    return "state_dict"


def rotary_pairs_rows(arch: MoonViTArch) -> tuple[int, ...]:
    """The fused q | k | v rows of ours in the original ``wqkv``'s row numbers: per head of q and
    of k, our row j < K/2 is its row 2j and our row K/2 + j its row 2j + 1; v as it is."""
    D, K = arch.hidden, arch.head_dim
    half = K // 2
    within = [2 * j for j in range(half)] + [2 * j + 1 for j in range(half)]
    rows = [part * D + h * K + j for part in (0, 1) for h in range(arch.heads) for j in within]
    return tuple(rows + list(range(2 * D, 3 * D)))


def hf_rules(arch: MoonViTArch, prefix: str = DEFAULT_PREFIX, naming: str = "state_dict") -> list[Rule]:
    """One rule per tower tensor, in the tower's parameter order; ``prefix``: where the model's
    ``model.`` stands (``state_dict`` naming: "" for a bare ``Kimi_K25Model``'s names)."""
    if naming not in NAMINGS:
        raise ValueError(f"naming {naming!r}: one of {NAMINGS}")
    D, F_, p, M, O = arch.hidden, arch.mlp, arch.patch, arch.merge_width, arch.out_hidden
    side = arch.pos_emb_side
    original = naming != "state_dict"

    def same(ours: str, theirs: str, *shape: int) -> Rule:
        return Rule(ours, (theirs,), tuple(shape), tuple(shape))

    def weight_bias(ours: str, theirs: str, *shape: int) -> list[Rule]:
        return [same(f"{ours}.weight", f"{theirs}.weight", *shape), same(f"{ours}.bias", f"{theirs}.bias", shape[0])]

    if original:
        tower, blocks = "vision_tower.", "vision_tower.encoder.blocks."
        patch = "vision_tower.encoder.patch_embed.proj" if naming == "saved" else "vision_tower.patch_embed.proj"
        pos, final = "vision_tower.patch_embed.pos_emb.weight", "vision_tower.encoder.final_layernorm"
        norm = ("model." if naming == "saved" else "") + "mm_projector.pre_norm"
        fc1, fc2 = "mm_projector.proj.0", "mm_projector.proj.2"
        block_names = ("norm0", "norm1", "wo", "mlp.fc0", "mlp.fc1")
    else:
        tower = prefix + "vision_tower."
        blocks = tower + "layers."
        patch, pos, final = tower + "patch_embed.proj", tower + "patch_embed.pos_emb.position_embeddings", tower + "final_layernorm"
        norm, fc1, fc2 = (prefix + "mm_projector." + n for n in ("pre_norm", "in_proj", "out_proj"))
        block_names = ("norm1", "norm2", "attn.proj", "mlp.fc1", "mlp.fc2")
    rules = weight_bias("patch_embed", patch, D, 3, p, p) + [same("pos_embed", pos, side, side, D)]
    qkv_rows = rotary_pairs_rows(arch) if original else ()
    for i in range(arch.depth):
        b, theirs = f"blocks.{i}.", f"{blocks}{i}."
        n1, n2, proj, mlp1, mlp2 = (theirs + n for n in block_names)
        rules += weight_bias(b + "norm1", n1, D)
        if original:
            rules += [RowsRule(f"{b}attn.qkv.{k}", (f"{theirs}wqkv.{k}",), shape, shape, rows=qkv_rows)
                      for k, shape in (("weight", (3 * D, D)), ("bias", (3 * D,)))]
        else:
            rules += [Rule(f"{b}attn.qkv.weight", tuple(f"{theirs}attn.{x}_proj.weight" for x in "qkv"), (3 * D, D), (D, D)),
                      Rule(f"{b}attn.qkv.bias", tuple(f"{theirs}attn.{x}_proj.bias" for x in "qkv"), (3 * D,), (D,))]
        rules += weight_bias(b + "attn.proj", proj, D, D)
        rules += weight_bias(b + "norm2", n2, D)
        rules += weight_bias(b + "mlp.fc1", mlp1, F_, D) + weight_bias(b + "mlp.fc2", mlp2, D, F_)
    rules += weight_bias("final_norm", final, D)
    rules += weight_bias("merger.norm", norm, D) + weight_bias("merger.fc1", fc1, M, M) + weight_bias("merger.fc2", fc2, O, M)
    return rules


def _unmapped(arch: MoonViTArch):
    def decide(key: str) -> str | None:
        if not key.startswith(TOWER_PREFIXES):
            return None  # another part of the model (the language model, lm_head)
        for blocks in ("vision_tower.layers.", "vision_tower.encoder.blocks."):
            at = key.find(blocks)
            if at in (0, len("model.")):
                index = key[at + len(blocks):].split(".")[0]
                if index.isdigit() and int(index) >= arch.depth:
                    return f"tensor {key!r} belongs to block {index}, but arch.depth is {arch.depth}"
        return f"tensor {key!r} has no place in the Kimi-K2.5 tower or its projector"

    return decide


def import_hf_state(state: Mapping[str, torch.Tensor], arch: MoonViTArch, prefix: str = DEFAULT_PREFIX,
                    where: str = "Hugging Face Kimi-K2.5 state dict") -> ImportedWeights:
    """The tower's and projector's tensors of a Hugging Face state dict or checkpoint (tensors, or
    ``LazyTensor``s left in their safetensors file), in whichever naming it uses (module doc)."""
    naming = checkpoint_naming(state)
    return map_state(state, hf_rules(arch, prefix, naming), source="hf-kimi-k25", where=where, arch=arch,
                     unmapped=_unmapped(arch), meta={"prefix": prefix, "naming": naming})


def tower_state_from_hf(hf_state: Mapping[str, torch.Tensor], arch: MoonViTArch,
                        prefix: str = DEFAULT_PREFIX) -> dict[str, torch.Tensor]:
    """{mimo name: tensor} of the tower in ``hf_state`` (any naming; MimoError naming the first
    missing tensor, wrong shape or unclaimed tower tensor)."""
    imported = import_hf_state(hf_state, arch, prefix)
    return {name: materialize(t) for name, t in imported.tower.items()}


def tower_state_to_hf(state: Mapping[str, torch.Tensor], arch: MoonViTArch,
                      prefix: str = DEFAULT_PREFIX) -> dict[str, torch.Tensor]:
    """{transformers' ``state_dict`` name: tensor} of a full mimo tower state (``full_state()``, or
    full gradients): the inverse of ``tower_state_from_hf``, exact."""
    return state_to_theirs(state, hf_rules(arch, prefix), "Kimi-K2.5 tower")


def import_hf(path: str, arch: MoonViTArch | None = None, shapes_only: bool = False) -> ImportedWeights:
    """The tower and projector of the Hugging Face Kimi-K2.5 checkpoint directory ``path``, mapped
    onto ``arch`` (default: the checkpoint's own), left in its safetensors files; ``shapes_only``:
    meta tensors from the headers, nothing read (``import_native_hf``). ``meta`` holds the whole
    ``config.json``."""
    from mimo.encoders.hf_qwen3_vl import import_native_hf

    return import_native_hf(path, "kimi_k25", arch, shapes_only)
