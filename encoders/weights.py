"""Explicit name / layout mapping between a source checkpoint (timm, Hugging Face) and the tower.

A ``Rule`` maps one mimo tensor to one or more source tensors: the same tensor, a reshape
(``[1, L, D]`` <-> ``[L, D]``), or a concatenation along dim 0 (Hugging Face's separate
q / k / v <-> mimo's fused ``[3D, D]``). Import checks every source tensor against the shapes
the configured ``VitArch`` implies and reports the first that does not fit, naming it and both
shapes; export inverts each rule and casts back to the source dtype, so import -> export
reproduces the source state dict exactly. Source tensors the tower never uses (classifier /
projection / pooling heads, a text tower) travel in ``extras``, unchanged.

A safetensors checkpoint need not be read at import: ``lazy_safetensors`` lists its tensors
as ``LazyTensor`` (shape and dtype from the header), and a rule over them gives a
``MappedTensor``; indexing either (``t[index]``, a tuple of slices, as a placement's regions
come) reads only that region, so each rank loads only its own slices
(``tp_state.load_full_``). ``materialize`` reads a whole tensor (export, resampling).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from mimo.encoders.config import VitArch
from mimo.core.errors import MimoError

__all__ = ["Rule", "RowsRule", "ImportedWeights", "LazyTensor", "MappedTensor", "lazy_safetensors", "materialize", "map_state",
           "load_state_file", "check_arch", "check_arch_fields", "replace_named", "rule_row_blocks", "state_to_theirs"]

Index = tuple[slice, ...]  # explicit start / stop on every dim


class LazyTensor:
    """A tensor of a safetensors file, not read yet: ``shape`` and ``dtype`` from the header;
    ``[index]`` reads only that region (the file is opened per read: no handle outlives it)."""

    def __init__(self, path: str, key: str, shape: tuple[int, ...], dtype: torch.dtype):
        self.path, self.key, self.shape, self.dtype = path, key, tuple(shape), dtype

    def __getitem__(self, index: Index) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            return f.get_slice(self.key)[tuple(index)]

    def full(self) -> torch.Tensor:
        return self[tuple(slice(0, n) for n in self.shape)]

    def __repr__(self) -> str:
        return f"LazyTensor({self.path!r}, {self.key!r}, shape={self.shape}, dtype={self.dtype})"


def lazy_safetensors(path: str) -> dict[str, LazyTensor]:
    """Every tensor of a safetensors file, unread (the header only), in the file's key order."""
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            sl = f.get_slice(key)
            shape = tuple(sl.get_shape())
            # the dtype as torch names it, from an empty read (no element is read)
            dtype = (sl[(slice(0, 0),)] if shape else sl[()]).dtype
            out[key] = LazyTensor(path, key, shape, dtype)
    return out


def materialize(t) -> torch.Tensor:
    """The whole tensor of a tensor, ``LazyTensor`` or ``MappedTensor``."""
    return t if isinstance(t, torch.Tensor) else t.full()


@dataclass(frozen=True)
class Rule:
    ours: str  # mimo name
    theirs: tuple[str, ...]  # source key(s); several are concatenated along dim 0
    our_shape: tuple[int, ...]
    their_shape: tuple[int, ...]  # of each source tensor
    optional: bool = False  # absent in some checkpoints (a final norm); the tower asks if it needs it

    def to_ours(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(self.theirs) > 1:
            return torch.cat(tensors, 0)
        return tensors[0].reshape(self.our_shape)

    def to_theirs(self, t: torch.Tensor) -> list[torch.Tensor]:
        if len(self.theirs) > 1:
            return [x.clone() for x in t.split(self.their_shape[0], 0)]
        return [t.reshape(self.their_shape).clone()]

    def read(self, sources: list, index: Index) -> torch.Tensor:
        """``to_ours(sources)[index]``, reading from each source (a tensor or a ``LazyTensor``)
        only the region behind ``index``: rows of the parts it covers, or through a reshape
        that only drops leading 1-dims. Any other reshape reads its source whole."""
        if len(self.theirs) > 1:
            lo, hi = index[0].start, index[0].stop
            pieces, offset = [], 0
            for src in sources:
                a, b = max(lo, offset), min(hi, offset + src.shape[0])
                if b > a:
                    pieces.append(src[(slice(a - offset, b - offset), *index[1:])])
                offset += src.shape[0]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
        (src,) = sources
        lead = len(self.their_shape) - len(self.our_shape)
        if lead >= 0 and self.their_shape[lead:] == self.our_shape and set(self.their_shape[:lead]) <= {1}:
            region = src[(slice(0, 1),) * lead + tuple(index)]
            return region.reshape(region.shape[lead:])
        return self.to_ours([materialize(src)])[tuple(index)]


@dataclass(frozen=True)
class RowsRule(Rule):
    """One source tensor whose rows (dim 0) ours holds in another order: ``ours[i] =
    theirs[rows[i]]`` (a permutation; e.g. rotary channels stored interleaved in the source)."""

    rows: tuple[int, ...] = ()

    def to_ours(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0][torch.tensor(self.rows, dtype=torch.long)]

    def to_theirs(self, t: torch.Tensor) -> list[torch.Tensor]:
        inverse = torch.empty(len(self.rows), dtype=torch.long)
        inverse[torch.tensor(self.rows, dtype=torch.long)] = torch.arange(len(self.rows))
        return [t[inverse].clone()]

    def read(self, sources: list, index: Index) -> torch.Tensor:
        """Only the source rows behind ``index`` (their covering range: a permutation within
        heads reads a head-aligned slice's own heads)."""
        (src,) = sources
        rows = self.rows[index[0].start:index[0].stop]
        if not rows:
            return src[(slice(0, 0), *index[1:])]
        lo = min(rows)
        block = src[(slice(lo, max(rows) + 1), *index[1:])]
        return block[torch.tensor(rows, dtype=torch.long) - lo]


def state_to_theirs(state: Mapping[str, torch.Tensor], rules: list[Rule], what: str) -> dict[str, torch.Tensor]:
    """{source name: tensor} of a full state by our names (``full_state()``, or full gradients):
    each rule inverted, exact; MimoError naming the first problems (a tensor no rule knows, a
    missing one, a wrong shape) as not fitting ``what``."""
    known = {r.ours for r in rules}
    problems = [f"tensor {name!r} is not a {what} tensor" for name in state if name not in known]
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        if rule.ours not in state:
            problems.append(f"missing tensor {rule.ours!r} (expected shape {rule.our_shape})")
            continue
        t = state[rule.ours]
        if tuple(t.shape) != rule.our_shape:
            problems.append(f"tensor {rule.ours!r} has shape {tuple(t.shape)}, the arch expects {rule.our_shape}")
            continue
        for key, part in zip(rule.theirs, rule.to_theirs(t.detach())):
            out[key] = part
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise MimoError(f"the mimo state does not fit the {what}: " + "; ".join(problems[:3]) + more)
    return out


def check_arch_fields(configured, source, where: str) -> None:
    """MimoError naming every dataclass field where the configured arch differs from the
    checkpoint's config (what does not show as tensor shapes: heads, activation, rope, ...)."""
    problems = [f"arch.{f.name} is {getattr(configured, f.name)!r} in the config but {getattr(source, f.name)!r} in {where}"
                for f in dataclasses.fields(configured) if getattr(configured, f.name) != getattr(source, f.name)]
    if problems:
        raise MimoError("; ".join(problems))


def rule_row_blocks(rules) -> dict[str, list[tuple[str, int, int, int]]]:
    """Where the rows of each of our 2-D tensors go on export (``Rule.to_theirs``): ours ->
    [(source key, its first row, our first row, rows)], for rules that copy or split rows."""
    out = {}
    for rule in rules:
        if len(rule.our_shape) != 2:
            continue
        if len(rule.theirs) > 1:
            n = rule.their_shape[0]
            out[rule.ours] = [(key, 0, k * n, n) for k, key in enumerate(rule.theirs)]
        elif rule.their_shape == rule.our_shape:
            out[rule.ours] = [(rule.theirs[0], 0, 0, rule.our_shape[0])]
    return out


@dataclass(frozen=True)
class MappedTensor:
    """A mimo tensor that ``rule`` makes of source tensors still in their file: ``[index]``
    reads only the source regions behind it (``Rule.read``), ``full()`` all of them."""

    rule: Rule
    sources: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rule.our_shape

    @property
    def dtype(self) -> torch.dtype:
        return self.sources[0].dtype

    def __getitem__(self, index: Index) -> torch.Tensor:
        return self.rule.read(list(self.sources), index)

    def full(self) -> torch.Tensor:
        return self.rule.to_ours([materialize(s) for s in self.sources])


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
    # every block the checkpoint has, not only those a tower computes: tensors, or
    # ``MappedTensor`` / ``LazyTensor`` where the source is a safetensors file left in place
    tower: dict[str, torch.Tensor | MappedTensor]
    extras: dict[str, torch.Tensor | LazyTensor]  # source tensors the tower never uses, by source key
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
            for key, t in zip(rule.theirs, rule.to_theirs(materialize(canon[rule.ours]).detach().cpu())):
                out[key] = t.to(self.dtypes[key])
        out.update({key: materialize(t) for key, t in self.extras.items()})
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
    state: Mapping[str, "torch.Tensor | LazyTensor"],
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
    string is the problem to report. Sources left in their file (``LazyTensor``) stay there:
    their rules give ``MappedTensor`` (only a resampled tensor is read, whole). Problems are collected in rule order (embeddings, then
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
                fixed = resamplers[rule.ours](materialize(t)) if rule.ours in resamplers else None
                if fixed is None:
                    problems.append(f"tensor {key!r} has shape {tuple(t.shape)}, the config expects {rule.their_shape}")
                    continue
                resampled[key] = (tuple(t.shape), tuple(fixed.shape))
                t = fixed
            tensors.append(t)
        if len(tensors) == len(rule.theirs):
            in_memory = all(isinstance(t, torch.Tensor) for t in tensors)
            tower[rule.ours] = rule.to_ours(tensors) if in_memory else MappedTensor(rule, tuple(tensors))
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


def load_state_file(path: str, lazy: bool = False) -> dict[str, "torch.Tensor | LazyTensor"]:
    """A state dict from ``.safetensors`` or a torch file (``state_dict`` / ``model`` wrappers
    unwrapped); ``lazy``: a safetensors file's tensors unread (``LazyTensor``)."""
    if not os.path.isfile(path):
        raise MimoError(f"checkpoint {path!r} not found")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return lazy_safetensors(path) if lazy else load_file(path)
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
