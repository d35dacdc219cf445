"""Explicit name / layout mapping between a source checkpoint (timm, Hugging Face) and the tower.

A ``Rule`` maps one mimo tensor to one or more source tensors: the same tensor, a reshape
(timm's ``[3D, D]`` fused qkv <-> mimo's ``[3, D, D]``; ``[1, L, D]`` <-> ``[L, D]``), or a
stack (Hugging Face's separate q/k/v <-> ``[3, D, D]``). Import checks every source tensor
against the shapes the configured ``VitArch`` implies and reports the first that does not fit,
naming it and both shapes; export inverts each rule and casts back to the source dtype, so
import -> export reproduces the source state dict exactly. Source tensors the tower never uses
(classifier / projection / pooling heads, a text tower) travel in ``extras``, unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from mimo.encoders.config import VitArch
from mimo.core.errors import MimoError

__all__ = ["Rule", "ImportedWeights", "map_state", "load_state_file", "check_arch", "replace_named"]


@dataclass(frozen=True)
class Rule:
    ours: str  # mimo name
    theirs: tuple[str, ...]  # source key(s); several are stacked along a new dim 0
    our_shape: tuple[int, ...]
    their_shape: tuple[int, ...]  # of each source tensor
    optional: bool = False  # absent in some checkpoints (a final norm); the tower asks if it needs it

    def to_ours(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(self.theirs) > 1:
            return torch.stack(tensors)
        return tensors[0].reshape(self.our_shape)

    def to_theirs(self, t: torch.Tensor) -> list[torch.Tensor]:
        if len(self.theirs) > 1:
            return [x.clone() for x in t.unbind(0)]
        return [t.reshape(self.their_shape).clone()]


# Resampler for a source tensor whose shape differs only by resolution (position embeddings):
# returns the tensor at the rule's source shape, or None when it cannot be resampled.
Resampler = Callable[[torch.Tensor], "torch.Tensor | None"]


def replace_named(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor] | None, what: str) -> dict[str, torch.Tensor]:
    """``base`` with the tensors ``new`` names replaced (for export): a name ``base`` lacks or
    a shape that differs is an error naming ``what``."""
    out = dict(base)
    for name, t in (new or {}).items():
        if name not in out:
            raise MimoError(f"export: {what} has no tensor {name!r}")
        if tuple(t.shape) != tuple(out[name].shape):
            raise MimoError(f"export: {what} {name!r} has shape {tuple(t.shape)}, expected {tuple(out[name].shape)}")
        out[name] = t
    return out


@dataclass
class ImportedWeights:
    """A source checkpoint mapped for one ``VitArch``: the tower's full tensors by mimo name,
    and everything needed to write the source state dict back."""

    source: str  # "timm", "hf-clip", "hf-siglip"
    where: str  # the checkpoint, for messages
    arch: VitArch  # the configured architecture the tensors were mapped (and resampled) for
    tower: dict[str, torch.Tensor]  # every block the checkpoint has, not only those a tower computes
    extras: dict[str, torch.Tensor]  # source tensors the tower never uses, by source key
    rules: tuple[Rule, ...]  # the rules that matched (optional ones may be absent)
    key_order: tuple[str, ...]  # the source's key order
    dtypes: dict[str, torch.dtype]  # source dtype per source key
    resampled: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)  # key: (from, to)
    meta: dict = field(default_factory=dict)  # source specifics (Hugging Face: config, key prefix)

    def export(self, tower_state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The source state dict; ``tower_state`` (e.g. a trained tower's ``full_state()``,
        or full gradients) replaces the tensors it names, the rest are the imported ones."""
        canon = replace_named(self.tower, tower_state, f"{self.where}: the imported tower")
        out: dict[str, torch.Tensor] = {}
        for rule in self.rules:
            for key, t in zip(rule.theirs, rule.to_theirs(canon[rule.ours].detach().cpu())):
                out[key] = t.to(self.dtypes[key])
        out.update(self.extras)
        ordered = {k: out.pop(k) for k in self.key_order if k in out}
        ordered.update(out)
        return ordered

    def source_names(self, ours: str) -> tuple[str, ...]:
        for rule in self.rules:
            if rule.ours == ours:
                return rule.theirs
        raise KeyError(ours)

    def replace(self, **changes) -> "ImportedWeights":
        return dataclasses.replace(self, **changes)


def map_state(
    state: Mapping[str, torch.Tensor],
    rules: list[Rule],
    *,
    source: str,
    where: str,
    arch: VitArch,
    unmapped: Callable[[str], str | None],
    resamplers: Mapping[str, Resampler] | None = None,
    meta: dict | None = None,
) -> ImportedWeights:
    """Apply ``rules`` to a source state dict.

    ``unmapped(key)`` decides each source key no rule claims: None keeps it as an extra, a
    string is the problem to report. Problems are collected in rule order (embeddings, then
    block by block); the first three are reported, with a count of the rest.
    """
    resamplers = resamplers or {}
    problems: list[str] = []
    tower: dict[str, torch.Tensor] = {}
    matched: list[Rule] = []
    resampled: dict[str, tuple] = {}
    claimed: set[str] = set()
    for rule in rules:
        claimed.update(rule.theirs)
        present = [k for k in rule.theirs if k in state]
        if rule.optional and not present:
            continue
        tensors = []
        for key in rule.theirs:
            if key not in state:
                problems.append(f"missing tensor {key!r} (the config expects shape {rule.their_shape})")
                continue
            t = state[key]
            if tuple(t.shape) != rule.their_shape:
                fixed = resamplers[rule.ours](t) if rule.ours in resamplers else None
                if fixed is None:
                    problems.append(f"tensor {key!r} has shape {tuple(t.shape)}, the config expects {rule.their_shape}")
                    continue
                resampled[key] = (tuple(t.shape), tuple(fixed.shape))
                t = fixed
            tensors.append(t)
        if len(tensors) == len(rule.theirs):
            tower[rule.ours] = rule.to_ours(tensors)
            matched.append(rule)
    extras = {}
    for key in state:
        if key in claimed:
            continue
        problem = unmapped(key)
        if problem is None:
            extras[key] = state[key]
        else:
            problems.append(problem)
    if problems:
        also = "".join(f"; also {p}" for p in problems[1:3])
        rest = len(problems) - 3
        more = f" (and {rest} more problem{'s' if rest > 1 else ''})" if rest > 0 else ""
        raise MimoError(f"{where} does not fit the config: {problems[0]}{also}{more}")
    return ImportedWeights(
        source=source,
        where=where,
        arch=arch,
        tower=tower,
        extras=extras,
        rules=tuple(matched),
        key_order=tuple(state),
        dtypes={k: state[k].dtype for k in claimed if k in state},
        resampled=resampled,
        meta=dict(meta or {}),
    )


def load_state_file(path: str) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or a torch file (``state_dict`` / ``model`` wrappers unwrapped)."""
    if not os.path.isfile(path):
        raise MimoError(f"checkpoint {path!r} not found")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except Exception as e:  # a truncated or foreign file
            raise MimoError(f"checkpoint {path!r} is not a readable safetensors file: {e}") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise MimoError(f"checkpoint {path!r} could not be read as a torch state dict: {e}") from None
    for wrapper in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise MimoError(f"checkpoint {path!r} does not hold a state dict of tensors")
    return obj


_ARCH_FIELDS = ("channels", "patch", "hidden", "layers", "heads", "mlp", "class_token", "pre_norm", "act", "norm_eps")


def check_arch(configured: VitArch, source: VitArch, where: str) -> None:
    """The configured architecture must be the source's (up to image size, which is resampled).

    Most differences already show as tensor shapes; heads, activation and epsilon do not."""
    problems = [
        f"arch.{name} is {getattr(configured, name)!r} in the config but {getattr(source, name)!r} in {where}"
        for name in _ARCH_FIELDS
        if getattr(configured, name) != getattr(source, name)
    ]
    if problems:
        raise MimoError("; ".join(problems))
