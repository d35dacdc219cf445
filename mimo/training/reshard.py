"""The checkpoint reader: each local tensor (weights, optimizer state) assembled from the stored pieces that overlap it.

``StoredModule`` is the one reader of a module's tensors, at the checkpoint's own layout (it then
opens only the files that layout points to: ``first``) or at another. Every stored tensor carries
the placement record of the local tensor it was (``ParamInfo.record``: full shape, the axes that
split which dims, their sizes and the writer's coordinates): model weights and persistent buffers
in ``*.model`` files; optimizer state in ``*.dopt`` files, the one format written now (each
parameter's flat local elements ``lo .. hi`` of ``master`` / ``exp_avg`` / ``exp_avg_sq``, with the
records, the ranges and the step counts: a range is the whole tensor but under the distributed
optimizer's shards). Checkpoints written before hold the state of a per-parameter optimizer in
``*.optim`` files (``{name}/{field}`` beside the owner's model file, whose records it uses): still
read. From a record,
``ParamPlacement.runs`` names the regions of the full tensor a piece holds; the reader asks the
same of the tensor it needs at the new layout and copies every intersection, reading only those
elements (safetensors slices). The elements copied are counted: every needed one covered exactly
once, else a ``CheckpointError``. Nothing is gathered and no collective runs: each rank reads what it
needs, whatever the old layout was (tp, pp, dp, cp, ep, etp, gtp, colocation, a sharded optimizer
or not).

What is not a tensor of the model: the data position is the step's (global microbatches do not
depend on the layout, docs/design.md §2); the RNG files are per rank, and each rank restores the one of its
own rank number where the checkpoint has it (mimo's training draws from generators seeded by
name and step, init and data order, so the global streams do not reach the results).

Optimizer state moves with its parameter: ``exp_avg`` / ``exp_avg_sq`` (and ``master`` where
the new optimizer keeps one: the stored master, else the stored fp32 weights) are resharded like
the weights; a step count is one number per parameter (the optimizer, ``mimo.training.bucket_optim``,
keeps one per bucket: its parameters' must agree). Whichever optimizer class or precision wrote the
state, it loads into the one ``AdamW`` of any precision (the moments cast to its state's dtype).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from mimo.core.errors import CheckpointError
from mimo.parallel.placement import ParamPlacement

Index = tuple[slice, ...]
FILE = re.compile(r"^(?P<module>.+)-rank(?P<rank>\d{5})\.(?P<kind>model|optim|dopt)\.safetensors$")
MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_FIELDS = ("master", *MOMENTS)
STATE_KIND = "dopt"  # the optimizer-state files written now; "optim": per-parameter state of checkpoints before


def _module_files(files: list[str], module: str) -> list[tuple[str, int, str]]:
    """(kind, rank, file name) of ``module``'s tensor files among a checkpoint's ``files``."""
    return [(m["kind"], int(m["rank"]), name) for name in files if (m := FILE.match(name)) and m["module"] == module]


def holds_state(files: list[str], module: str) -> bool:
    """Whether a checkpoint (its ``files``) holds optimizer state of ``module`` (either format)."""
    return any(kind != "model" for kind, _, _ in _module_files(files, module))


def _region_numel(index: Index) -> int:
    return math.prod(s.stop - s.start for s in index)


def _intersect(a: Index, b: Index) -> Index | None:
    out = []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if hi <= lo:
            return None
        out.append(slice(lo, hi))
    return tuple(out)


def _shift(inter: Index, full: Index, local: Index) -> Index:
    """``inter`` (full-tensor coordinates, inside the region ``full``) in the local tensor that
    holds ``full`` at ``local``."""
    return tuple(slice(l.start + i.start - f.start, l.start + i.stop - f.start) for i, f, l in zip(inter, full, local))


@dataclass
class _Source:
    """One stored local tensor: its placement (at the writer's sizes and coordinates) and a
    reader of any region of its local elements."""

    placement: ParamPlacement
    sizes: dict
    coords: dict
    read: Callable[[Index], torch.Tensor]
    where: str

    @classmethod
    def of(cls, record: dict, read, where: str) -> "_Source":
        return cls(ParamPlacement.from_record(record), dict(record["sizes"]), dict(record["coords"]), read, where)

    def regions(self):
        return self.placement.runs(self.sizes, self.coords)


def _slice_reader(f, key: str):
    def read(index: Index) -> torch.Tensor:
        return f.get_tensor(key) if not index else f.get_slice(key)[index]
    return read


@dataclass
class _FlatParts:
    """An optimizer's pieces of one local tensor (one record): each ``*.dopt`` file holds its
    flat elements ``lo .. hi`` (all of them, but under the distributed optimizer); joined on first read."""

    shape: tuple[int, ...]
    where: str
    parts: list = field(default_factory=list)  # (lo, hi, read the 1-d piece)
    _whole: torch.Tensor | None = None

    def release(self) -> None:
        self._whole = None

    def read(self, index: Index) -> torch.Tensor:
        if self._whole is None:
            n = math.prod(self.shape)
            covered = torch.zeros(n, dtype=torch.bool)
            whole = None
            for lo, hi, get in self.parts:
                piece = get()
                whole = torch.zeros(n, dtype=piece.dtype) if whole is None else whole
                whole[lo:hi] = piece
                covered[lo:hi] = True
            if whole is None or not bool(covered.all()):
                raise CheckpointError(f"{self.where}: the optimizer shards of a tensor do not cover it "
                                      f"({int(covered.sum())} of {n} elements; a file of the checkpoint missing?)")
            self._whole = whole.view(self.shape)
        return self._whole[index] if index else self._whole


class StoredModule:
    """Every stored tensor of one module of a checkpoint by (name, field): ``param`` (weights and
    persistent buffers), ``master``, ``exp_avg``, ``exp_avg_sq``; each name's optimizer step
    count. ``open_file(name) -> (safe_open handle, placements of a model file)`` opens a file of
    the checkpoint once. ``first``: the files to index first (at the checkpoint's own layout,
    those of this rank's owners); the module's other files are indexed only when a tensor or step
    count is not found in them (``_widen``)."""

    def __init__(self, path: str, files: list[str], module: str, open_file, first: set[str] | None = None):
        self.path, self.module, self._open = path, module, open_file
        self.sources: dict[tuple[str, str], list] = defaultdict(list)
        self.steps: dict[str, float] = {}
        self.fresh: set[str] = set()  # trained when written, but not stepped yet: no state
        self._flat: dict[tuple[str, str, str], _FlatParts] = {}
        self._joined: dict[str, list[_FlatParts]] = defaultdict(list)  # per name: its joined pieces (freed after use)
        self._rest = sorted(_module_files(files, module))  # (kind, rank, file) not indexed yet: dopt, model, optim
        self._index(lambda name: first is None or name in first)

    def _index(self, take) -> None:
        """Index the files not indexed yet whose name ``take`` accepts."""
        now = [f for f in self._rest if take(f[2])]
        self._rest = [f for f in self._rest if not take(f[2])]
        for kind, _, name in now:
            f, records = self._open(name)
            where = f"{self.path}/{name}"
            if kind == "model":
                for key, rec in records.items():
                    self.sources[(key, "param")].append(_Source.of(rec, _slice_reader(f, key), where))
            elif kind == "optim":
                self._index_legacy(f, name, where)
            else:
                self._index_state(f, where)

    def _index_state(self, f, where: str) -> None:
        """A ``*.dopt`` file: pieces of each parameter's flat local tensor, joined on first read."""
        meta = json.loads(f.metadata()["shard"])
        keys = set(f.keys())
        self.fresh.update(meta.get("fresh", ()))
        for pname, got in meta["ranges"].items():
            rec = meta["placements"][pname]
            self.steps[pname] = float(meta["steps"][str(got["bucket"])])
            lo, hi = got["range"]
            for fieldname in STATE_FIELDS:
                if f"{pname}.{fieldname}" not in keys:  # (no master: the weights are the master)
                    continue
                key = (pname, fieldname, repr(sorted(rec["coords"].items())))
                if key not in self._flat:
                    self._flat[key] = _FlatParts(tuple(rec["local_shape"]), where)
                    self._joined[pname].append(self._flat[key])
                    self.sources[(pname, fieldname)].append(_Source.of(rec, self._flat[key].read, where))
                self._flat[key].parts.append((lo, hi, lambda f=f, k=f"{pname}.{fieldname}": f.get_tensor(k)))

    def _index_legacy(self, f, name: str, where: str) -> None:
        """A ``*.optim`` file (checkpoints before the one state format): ``{name}/{field}`` whole
        local tensors, placed by the records of the model file beside it."""
        _, model_records = self._open(name.replace(".optim.", ".model."))
        for key in f.keys():
            pname, fieldname = key.rsplit("/", 1)
            if fieldname == "step":
                self.steps[pname] = float(f.get_tensor(key))
            elif pname in model_records:
                self.sources[(pname, fieldname)].append(_Source.of(model_records[pname], _slice_reader(f, key), where))
            else:
                raise CheckpointError(f"{where}: optimizer state of {pname!r} without its weights in the model file")
        for key, value in json.loads(f.metadata().get("scalars", "{}")).items():
            pname, fieldname = key.rsplit("/", 1)
            if fieldname == "step":
                self.steps[pname] = float(value)
        self.fresh.update(n for n in json.loads(f.metadata().get("params", "[]")) if n not in self.steps)

    def _widen(self) -> bool:
        """Index every file of the module not indexed yet; whether there was one."""
        if not self._rest:
            return False
        self._index(lambda name: True)
        return True

    def names(self) -> set[str]:
        self._widen()
        return {n for n, fieldname in self.sources if fieldname == "param"}

    def has(self, name: str, fieldname: str) -> bool:
        return (name, fieldname) in self.sources or (self._widen() and (name, fieldname) in self.sources)

    def holds_state(self, name: str) -> bool:
        """Whether the files indexed so far hold optimizer state of ``name``, or say it had none
        yet (``fresh``); widens nothing."""
        return name in self.steps or name in self.fresh

    def full_shape(self, name: str) -> tuple[int, ...] | None:
        """The stored full shape of ``name`` (None: not stored)."""
        sources = self.sources.get((name, "param")) or (self._widen() and self.sources.get((name, "param")))
        return tuple(sources[0].placement.full_shape) if sources else None

    def read(self, name: str, fieldname: str, info, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``name``'s ``fieldname`` as the local tensor of ``info`` (a ``ParamInfo``: placement,
        sizes, coordinates at the new layout), zeros in padding. What the files indexed so far
        do not cover is looked for in the rest (``_widen``) before it is an error."""
        try:
            return self._read(name, fieldname, info, dtype)
        except CheckpointError:
            if not self._widen():
                raise
            return self._read(name, fieldname, info, dtype)

    def _read(self, name: str, fieldname: str, info, dtype: torch.dtype | None) -> torch.Tensor:
        sources = self.sources.get((name, fieldname))
        what = f"{self.path}: module {self.module!r}"
        if not sources:
            raise CheckpointError(f"{what}: no {fieldname} of {name!r} (the checkpoint does not fit this model: "
                                  f"another architecture, or freezing changed?)")
        mine: ParamPlacement = info.placement
        stored = sources[0].placement
        if stored.full_shape != mine.full_shape:  # (fused parts may differ: each record maps its own to the full tensor)
            raise CheckpointError(f"{sources[0].where}: {name!r} is {stored.full_shape}, this model's is "
                                  f"{mine.full_shape}: another architecture")
        sizes, coords = info.sizes, info.coords
        needed = mine.runs(sizes, coords)
        out, copied = None, 0
        for src in sources:
            for full_s, local_s in src.regions():
                for full_d, local_d in needed:
                    inter = _intersect(full_s, full_d)
                    if inter is None:
                        continue
                    piece = src.read(_shift(inter, full_s, local_s))
                    if out is None:
                        out = torch.zeros(mine.local_shape(sizes), dtype=dtype or piece.dtype)
                    out[_shift(inter, full_d, local_d)] = piece
                    copied += _region_numel(inter)
        want = sum(_region_numel(full) for full, _ in needed)
        if copied != want:
            raise CheckpointError(f"{what}: the stored pieces of {fieldname} {name!r} cover {copied} of the {want} elements "
                                  f"this rank needs (files missing, or written by two runs?)")
        return out if out is not None else torch.zeros(mine.local_shape(sizes), dtype=dtype or torch.float32)

    def step(self, name: str) -> float:
        if name not in self.steps and not (self._widen() and name in self.steps):
            raise CheckpointError(f"{self.path}: module {self.module!r}: no optimizer step count of {name!r} "
                                  f"(were its parameters frozen when the checkpoint was written?)")
        return self.steps[name]

    def adam_state(self, name: str, info, master: bool) -> dict[str, torch.Tensor]:
        """``name``'s moments (and fp32 master: the stored one, else the stored weights) as the
        local tensors of ``info``."""
        state = {k: self.read(name, k, info, torch.float32) for k in MOMENTS}
        if master:
            state["master"] = self.read(name, "master" if self.has(name, "master") else "param", info, torch.float32)
        for joined in self._joined.get(name, ()):  # a bucketed optimizer's joined tensors: each read once per rank
            joined.release()
        return state
