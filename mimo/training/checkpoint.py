"""Checkpoints: every parameter written once, by its owner, beside its placement; optimizer states and RNG; atomic.

Layout on disk (``train.checkpoint.dir``)::

    step-00000004/                          a complete checkpoint (the name is only ever renamed into place)
      meta.json                             step, the layout it was written at, files, the resolved config
      language-rank00002.model.safetensors  the language tensors rank 2 owns, each with its placement record
      language-rank00002.dopt.safetensors   optimizer state of those parameters (or of rank 2's shards)
      vision-rank00000.model.safetensors
      rng-rank00003.safetensors             torch / Python / NumPy RNG of each rank

Weights and optimizer states are each rank's *local* shards, saved as they are: no gathering,
exactly what the rank restores. Which rank writes a tensor is read from its parameter's
placement (``ParamInfo.is_owner``), as the global norm reads it: coordinate 0 on every axis of
its view that holds it replicated (dp and cp for every parameter; tp for one TP does not split;
edp, not tp, for an expert weight), its own coordinate on the axes that shard it and on pp (a
stage, not a replica). Copies that are identical by construction (replicas, whose gradients
are summed or which compute the same one, and so take identical steps; the last stage's copy of
a tied embedding, written by the first stage) are therefore written once, and every element of
every parameter is in exactly one file. The LLM stage's persistent buffers (the MoE routers'
``expert_bias`` / ``qb_beta``, balancing state outside autograd) are written and read the same
way, as replicated tensors. Each tensor's placement record (``ParamInfo.record``:
full shape, shards, sizes, coordinates, local shape) is stored in its file's metadata
(``placements``), so a later reader can reshard. Loading at the same layout, a rank finds each
of its parameters in the file of that parameter's owner (its own shard coordinates and stage, 0
on the replica axes), checks the stored record against its own, and copies the tensor in. A
checkpoint records the layout it was written at; loading it at another layout reads each local
tensor from the stored pieces that overlap it. Either way one reader reads every tensor
(``mimo.training.reshard.StoredModule``).

Optimizer state has one format (``_state_file``): per parameter its flat local elements
``lo .. hi`` of ``exp_avg`` / ``exp_avg_sq`` (and ``master`` where the optimizer keeps fp32
masters of narrower weights), with the range, the step count and the placement record. Where the
optimizer steps whole buckets a rank writes the whole range of each parameter it owns (the
weights' rule); the distributed optimizer writes each rank's shard. Checkpoints written before
this format hold a per-parameter optimizer's state in ``*.optim`` files, and ``*.dopt`` files of
the optimizer classes before the one ``AdamW`` (``mimo.training.bucket_optim``) carry masters of
fp32 weights too: both still load, in any precision.

Checksums: every file is written by safetensors' ``save_file`` while helper threads compute the
crc32 of the same bytes from the tensors' memory (``_write_tensors``; ``_safetensors_layout`` lays
them out as ``save_file`` does, and the file's header and size, read back, confirm it: where they
differ, the crc32 is read from the file instead). The crc32 costs a save nothing where a core is
free for it; reading each file back to compare would cost 5% of a save and check the page cache
rather than the disk (docs/performance.md), so the save checks headers and sizes only, and the
first load of the checkpoint reads every byte against its checksum. Each rank leaves its
checksums beside its files (``checksums-rank<R>.json``); the commit gathers every rank's into
meta.json (``checksums``: per file its ``crc32`` and ``bytes``). A file whose size or header on
disk is not what was written is an error on that rank, and the checkpoint is not committed.

Finding one to load: ``usable_checkpoint`` takes the newest complete checkpoint whose files are all
there, readable (each safetensors header parses and covers its file) and hold the bytes written
(each file's size and crc32, streamed over it, equal to its checksum: ``validate_checkpoint``,
which reads every byte once), skipping newer ones that are not with a warning naming the bad
file; an explicit one (``resolve_checkpoint``: ``--resume-from``, ``train.init_from``) that is
not is a ``CheckpointError`` naming it. A checkpoint written before checksums has none: its
headers are checked, its bytes are not (logged once at info). A file that cannot be read while
loading is a ``CheckpointError`` naming it, never a bare SafetensorError.

Atomicity: all ranks write into ``step-N.tmp``; after a barrier rank 0 writes ``meta.json``
last, fsyncs, and renames the folder to ``step-N``. A crash at any point (kill -9 included)
leaves either no ``step-N`` or a complete one; a complete checkpoint is a ``step-N`` folder
with ``meta.json``. Only then, the new checkpoint committed and its files checked, are old
checkpoints pruned: those older than the newest ``keep`` usable ones (``prune``: a damaged
checkpoint never counts toward ``keep``, so it never costs a good one its place). They are
renamed to ``.old`` before deletion, so a crash while pruning never leaves a half-deleted
folder that looks complete. An asynchronous save (``train.checkpoint.async_save``,
``mimo.training.async_save``) writes and checksums the same files from a background
thread per rank: each rank marks its files done with a file in ``step-N.tmp`` instead of the
barrier, and rank 0's thread commits as above once every mark is there.

The checkpoint folder must be visible to every rank (a shared filesystem across nodes).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import random
import re
import shutil
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import safetensors
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mimo.compose.config import MimoConfig
from mimo.compose.model import MimoModel
from mimo.core.errors import CheckpointError
from mimo.parallel.fp8 import fit_history
from mimo.parallel.lora import init_magnitudes_, is_adapter_tensor
from mimo.parallel.params import ParamInfo, persistent_buffers
from mimo.parallel.placement import replicated
from mimo.training.bucket_optim import AdamW, finish_updates
from mimo.training.reshard import STATE_FIELDS, STATE_KIND, StoredModule

log = logging.getLogger("mimo.training.checkpoint")

FORMAT = 2  # 1: one file per (module, dense grid coordinates), no placements
META = "meta.json"
_COMPLETE = re.compile(r"^step-(\d{8})$")
_CHECKSUMS = re.compile(r"^checksums-rank\d{5}\.json$")  # a rank's checksums in step-N.tmp, merged into meta.json
_LEFTOVER = re.compile(r"^step-(\d{8})\.(tmp|old)$")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


# ---------------------------------------------------------------- layout


def layout_of(config: MimoConfig) -> dict:
    """What decides how parameters are split into local shards: sizes and rank ranges."""
    modules = {}
    for name, m in config.modules.items():
        par, ranks = m.parallel, config.rank_range(name)
        modules[name] = {"ranks": f"{ranks.start}:{ranks.stop}", **{d: getattr(par, d) for d in ("tp", "cp", "dp", "pp", "ep")},
                         "etp": par.expert_tp}  # resolved: etp unset and etp = tp are one layout
        if par.gtp > 1:  # (recorded only where used: earlier checkpoints have none)
            modules[name]["gtp"] = par.gtp
    return {"world_size": config.world_size, "modules": modules, "expert_layout": True}  # etp resolved


def _resolved_etp(layout):
    """A stored layout with each module's etp resolved: checkpoints before parallel folding
    recorded the then only value, ``etp: 1``, meaning the experts laid out like the dense
    layers (etp = tp); they carry no ``expert_layout`` mark."""
    if not isinstance(layout, dict) or layout.get("expert_layout") or not isinstance(layout.get("modules"), dict):
        return layout
    modules = {n: ({**m, "etp": m.get("tp")} if isinstance(m, dict) and m.get("ep", 1) == 1 and m.get("etp") == 1 else m)
               for n, m in layout["modules"].items()}
    return {**layout, "modules": modules, "expert_layout": True}


def describe_layout(layout: dict) -> str:
    """``[world_size=4; vision tp=1,dp=4,ranks=0:4; language tp=2,dp=2,ranks=0:4]`` (sizes of 1 left out but tp)."""
    parts = []
    for name, m in layout["modules"].items():
        sizes = [f"{d}={m[d]}" for d in ("tp", "gtp", "cp", "dp", "pp", "ep", "etp") if d == "tp" or m.get(d, 1) != (m["tp"] if d == "etp" else 1)]
        parts.append(f"{name} {','.join(sizes)},ranks={m['ranks']}")
    return f"[world_size={layout['world_size']}; " + "; ".join(parts) + "]"


def check_layout(meta: dict, config: MimoConfig, path: str) -> bool:
    """Whether the checkpoint at ``path`` was written at ``config``'s layout (False: it is
    resharded on load, ``mimo.training.reshard``). Other modules are a CheckpointError."""
    stored, want = _resolved_etp(meta.get("layout")), layout_of(config)
    if stored == want:
        return True
    modules = sorted(stored["modules"]) if isinstance(stored, dict) and isinstance(stored.get("modules"), dict) else None
    if modules != sorted(want["modules"]):
        raise CheckpointError(f"{path}: checkpoint of modules {modules}, config has {sorted(want['modules'])} "
                              f"(another model: start a new run with another train.checkpoint.dir)")
    return False


def layout_change(meta: dict, config: MimoConfig, path: str) -> str | None:
    """None at the checkpoint's own layout, else a warning saying it will be resharded."""
    if check_layout(meta, config, path):
        return None
    return (f"{path}: checkpoint written at layout {describe_layout(_resolved_etp(meta['layout']))}, the config asks for "
            f"{describe_layout(layout_of(config))}: resharding it on load")


# ---------------------------------------------------------------- finding checkpoints


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, META), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a complete checkpoint ({META}: {e})") from None
    if meta.get("format") != FORMAT:
        older = (" (format 1 named its files by grid coordinates and stored no placements: resume it with the "
                 "mimo that wrote it, or start a new run)") if meta.get("format") == 1 else ""
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, this mimo reads format {FORMAT}{older}")
    return meta


def complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _COMPLETE.match(name)
        path = os.path.join(directory, name)
        if m and os.path.isfile(os.path.join(path, META)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(directory: str) -> tuple[int, str] | None:
    """The newest complete checkpoint (step, path), or None. In-progress and crashed saves
    (``.tmp``) and folders being deleted (``.old``) are ignored."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


@contextmanager
def open_tensors(path: str):
    """``safe_open(path)``; a missing, cut or corrupt file is a CheckpointError naming it."""
    try:
        f = safe_open(path, "pt")  # reads and checks the header
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (SafetensorError, OSError) as e:  # e.g. "incomplete metadata, file not fully covered": a cut file
        raise CheckpointError(f"{path}: unreadable, the file is damaged ({type(e).__name__}: {e})") from None
    with f:
        yield f


def validate_checkpoint(path: str, checksums: bool = True) -> dict:
    """The meta of the checkpoint at ``path`` once every file it lists is there, readable (its
    header parses and covers the file: what a cut file fails), of the size written and, with
    ``checksums``, holding the bytes written: its crc32, streamed over the file, equal to the
    one recorded when it was written (what bytes overwritten in place fail; reads every byte
    once). ``checksums=False``: headers and sizes only, no tensor bytes read (``prune``, on
    every save). Else a CheckpointError naming the first bad file. A checkpoint written before
    mimo recorded checksums has none: its headers are checked, its bytes are not (logged once)."""
    meta = read_meta(path)
    records = meta.get("checksums")
    if records is None:
        _note_unverified(path)
    elif not isinstance(records, dict):
        raise CheckpointError(f"{os.path.join(path, META)}: its checksums are unreadable ({type(records).__name__}): "
                              f"use another checkpoint")
    with _crc_threads() if checksums and records else nullcontext() as pool:
        for name in meta.get("files", []):
            file = os.path.join(path, name)
            if name.endswith(".safetensors"):
                with open_tensors(file):
                    pass
            elif not os.path.isfile(file):
                raise CheckpointError(f"{file}: missing")
            if records is not None:
                problem = _file_problem(file, records.get(name), pool)
                if problem:
                    raise CheckpointError(f"{file}: damaged: {problem} (restore the file, or use an older checkpoint)")
    return meta


_unverified: set[str] = set()  # checkpoints without checksums already logged (once each)


def _note_unverified(path: str) -> None:
    if path not in _unverified:
        _unverified.add(path)
        log.info("%s: written without checksums (by an earlier mimo): its files' bytes are not verified", path)


def _file_problem(file: str, record: object, pool: ThreadPoolExecutor | None) -> str | None:
    """What is wrong with ``file`` against its checksum ``record`` ({"crc32", "bytes"}), or None:
    its size, then (given the threads to read it with, ``pool``) its crc32."""
    if not (isinstance(record, dict) and isinstance(record.get("bytes"), int) and isinstance(record.get("crc32"), str)):
        return f"no readable checksum for it in {META} (which records one for every file written): {record!r}"
    size = os.path.getsize(file)
    if size != record["bytes"]:
        return f"{size} bytes, {record['bytes']} were written"
    if pool is not None:
        crc = _file_crc32(file, pool)
        if crc != record["crc32"]:
            return f"its bytes are not those written (crc32 {crc}, written {record['crc32']})"
    return None


def _file_crc32(path: str, pool: ThreadPoolExecutor) -> str:
    """The crc32 of the file at ``path`` (8 hex digits), its pieces on ``pool``'s threads, over a
    read-only mapping of the file: no copy of it in memory beside the page cache's (reading it
    into buffers costs a copy more: 1.2-1.6x the time on the dev box)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return f"{0:08x}"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            if hasattr(mmap, "MADV_SEQUENTIAL"):  # read ahead (Linux, macOS)
                mapped.madvise(mmap.MADV_SEQUENTIAL)
            crc = _Crc32(pool)
            for start in range(0, size, _WRITE_CHUNK):
                crc.feed_mapped(mapped, start, min(start + _WRITE_CHUNK, size))
            return crc.value()  # every piece done before the mapping closes


def usable_checkpoint(directory: str) -> tuple[int, str] | None:
    """The newest complete checkpoint (step, path) that validates, or None when there is none at
    all; each newer one that does not is skipped with a warning naming its bad file. Checkpoints
    that are all unreadable are an error (training would otherwise start over beside them)."""
    found = complete_checkpoints(directory)
    problems = []
    for step, path in reversed(found):
        try:
            validate_checkpoint(path)
        except CheckpointError as e:
            problems.append(str(e))
            log.warning("checkpoint %s is not usable, skipped: %s", path, e)
            continue
        if problems:
            log.warning("falling back to %s (step %d), the newest usable checkpoint", path, step)
        return step, path
    if problems:
        raise CheckpointError(f"{directory}: no usable checkpoint (move the damaged ones away to start over): " + "; ".join(problems))
    return None


def weights_origin(meta: dict, modules: Iterable[str], accept: Callable[[str], bool] = lambda path: True,
                   depth: int = 8) -> str | None:
    """The Hugging Face directory a checkpoint's weights came from (``meta``: its meta.json), as
    its config records it: ``modules.<m>.init.hf`` of one of ``modules``, an ``import-hf``
    checkpoint's ``imported_from``, or the same of the checkpoint it was converted from
    (``converted_from``) or started from (``train.init_from``), up to ``depth`` checkpoints back;
    the first that ``accept`` takes. None when there is none (a warning where a checkpoint on
    the way cannot be read)."""
    for _ in range(depth):
        cfg = meta.get("config") or {}
        inits = [(((cfg.get("modules") or {}).get(m) or {}).get("init") or {}).get("hf") for m in modules]
        for candidate in [*inits, meta.get("imported_from")]:
            if candidate and accept(candidate):
                return candidate
        start = meta.get("converted_from") or (cfg.get("train") or {}).get("init_from")
        if not start:
            return None
        try:
            meta = read_meta(resolve_checkpoint(start))
        except CheckpointError as e:
            log.warning("%s (where the weights came from): %s", start, e)
            return None
    return None


def resolve_checkpoint(path: str) -> str:
    """A ``step-N`` folder as is, once validated; a folder of them: its newest usable one."""
    if os.path.isfile(os.path.join(path, META)):
        validate_checkpoint(path)
        return path
    found = usable_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint there (a step-NNNNNNNN folder with {META})")
    return found[1]


def remove_leftovers(directory: str) -> list[str]:
    """Delete what crashed saves and prunes left behind; returns the removed paths."""
    removed = []
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            if _LEFTOVER.match(name):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
                removed.append(os.path.join(directory, name))
    return removed


def prune(directory: str, keep: int | None, newest: int | None = None) -> list[str]:
    """Delete the checkpoints older than the newest ``keep`` usable ones; returns the deleted
    paths, oldest first. Runs once the checkpoint of step ``newest`` is committed, its files
    fsynced and their sizes and headers checked by the ranks that wrote them (``_write_tensors``).

    Only usable checkpoints count toward ``keep`` (``validate_checkpoint`` short of reading the
    tensor bytes: meta.json, every file there, its header, the size written), so a damaged one
    never takes a good one's place: with keep=3, one good checkpoint, two damaged newer ones and
    the new one, nothing is deleted. A damaged one among the kept stays (to look at; loading
    skips it); one older than the newest ``keep`` usable ones goes with the rest.

    Checkpoints of steps after ``newest`` are not this run's: ones it skipped as damaged when it
    resumed (bytes overwritten in place included, which the resume's full read found), or left
    behind resuming from an older one (``--resume-from``). They neither count nor are deleted:
    the run's own save of that step replaces them. So a run resumed past damaged checkpoints
    keeps the good one it resumed from until ``keep`` newer ones of its own are verified.

    What this does not see: bytes overwritten in place, at the same size, in a checkpoint older
    than the new one (only reading every byte finds that: the next resume does). It counts, but
    the new checkpoint, just committed, always stays beside it. Reading every kept checkpoint on
    every save would cost each save up to ``keep`` times its own writing, all on rank 0.
    ``newest=None``: every checkpoint counts."""
    if keep is None:
        return []
    found = [(step, path) for step, path in complete_checkpoints(directory) if newest is None or step <= newest]
    usable, doomed = 0, []
    for _, path in reversed(found):
        if usable >= keep:
            doomed.append(path)
        elif _intact(path):
            usable += 1
    for path in reversed(doomed):
        os.rename(path, path + ".old")  # no longer looks complete, even if the deletion is cut short
        shutil.rmtree(path + ".old", ignore_errors=True)
    return doomed[::-1]


def _intact(path: str) -> bool:
    """Whether the checkpoint at ``path`` passes ``validate_checkpoint`` without reading its
    tensor bytes; a warning naming the bad file where it does not."""
    try:
        validate_checkpoint(path, checksums=False)
    except CheckpointError as e:
        log.warning("checkpoint %s is damaged, not counted toward train.checkpoint.keep: %s", path, e)
        return False
    return True


# ---------------------------------------------------------------- what each rank holds


@dataclass
class _Part:
    """One module's parameters on this rank, by layout-independent name."""

    module: str
    table: dict[str, ParamInfo]
    # names whose copy here mirrors the first pipeline stage's (the last stage's tied head):
    # written by the first stage only, read back from its file
    first_stage_copies: frozenset[str] = frozenset()

    def writes(self, name: str) -> bool:
        return self.table[name].is_owner and name not in self.first_stage_copies

    def owner(self, name: str) -> int:
        return _owner(self.table[name], first_stage=name in self.first_stage_copies)

    def names_by_param(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for name, info in self.table.items():
            names.setdefault(id(info.param), name)
        return names


def _persistent_buffers(module: torch.nn.Module, ctx) -> dict[str, ParamInfo]:
    """The persistent buffers of ``module`` (the MoE routers' ``expert_bias`` / ``qb_beta``, FP8
    amax histories ``fp8_history``):
    replicated state, written once like a replicated parameter (coordinate 0 off pp)."""
    out = {}
    for name, t in persistent_buffers(module).items():
        owner, _, local = name.rpartition(".")
        out[name] = ParamInfo(t, replicated(tuple(t.shape)), ctx.view(()), module.get_submodule(owner), local)
    return out


def _local_parts(model: MimoModel, base_of: Iterable[str] = ()) -> list[_Part]:
    """What each module's checkpoint files hold on this rank. A module with ``lora``: its adapters
    and whatever else trains (the frozen base comes from the module's init again); ``base_of``
    names such modules read from a checkpoint without adapters: everything but the adapters."""
    parts = []
    for part in model.parts:
        if part.module is not None:
            table = part.param_table()
            if part.name in base_of:
                table = {name: info for name, info in table.items() if not is_adapter_tensor(name)}
            elif model.config.modules[part.name].lora is not None:
                table = {name: info for name, info in table.items() if info.param.requires_grad}
            table.update(_persistent_buffers(part.module, part.ctx))  # (MoE router state, FP8 amax histories)
            copy = part.first_stage_copy
            parts.append(_Part(part.name, table, frozenset(n for n, info in table.items() if info.param is copy)))
    return parts


def _owner(info: ParamInfo, first_stage: bool = False) -> int:
    """The rank that writes ``info``'s tensor as this rank holds it: this rank's coordinates on
    the axes that shard it and on pp (the first stage's for a tied copy), 0 on every axis of
    its view that holds it replicated (the rule of ``ParamInfo.is_owner``)."""
    grid = info.view.grid
    mine = grid.coords(info.view.rank)
    at = {d: mine[d] if d == "pp" or d in info.placement.axes else 0 for d in grid.dims}
    if first_stage and "pp" in at:
        at["pp"] = 0
    return grid.rank_at(**at)


def _file(module: str, rank: int, kind: str) -> str:
    """The file of ``module``'s tensors (``kind``: model or optim) that ``rank`` owns."""
    return f"{module}-rank{rank:05d}.{kind}.safetensors"


# ---------------------------------------------------------------- serialisation


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in CPU memory of their own (what a save writes: training may change ``t`` next)."""
    return t.detach().to("cpu", copy=True).contiguous()


# safetensors' name of each dtype it stores (the header's "dtype")
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.complex64: "C64",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
           torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e8m0fnu: "F8_E8M0"}
# the order of tensors in a safetensors file: by dtype in this order (its Dtype enum from the
# last), then by name, in safetensors 0.4-0.8; tests/test_checkpoint_integrity.py checks it
_DTYPE_ORDER = {name: i for i, name in enumerate((
    "U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E5M2FNUZ", "F8_E4M3FNUZ",
    "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL"))}
_WRITE_CHUNK = 64 << 20  # bytes per piece: what one helper thread checksums at a time, written beside it


def _safetensors_layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[memoryview]]:
    """The bytes of a safetensors file of ``tensors``: its header (the JSON's length, 8 bytes
    little-endian, then the JSON padded with spaces to a multiple of 8) and each tensor's bytes,
    as views of its memory, in ``save_file``'s order (``_DTYPE_ORDER``, then by name)."""
    header: dict[str, object] = {}
    if metadata is not None:
        odd = [k for k, v in metadata.items() if not isinstance(v, str)]
        if odd:
            raise TypeError(f"safetensors metadata holds strings only: {odd[0]!r} is a {type(metadata[odd[0]]).__name__}")
        header["__metadata__"] = metadata
    views, offset = [], 0
    unknown = [n for n, t in tensors.items() if t.dtype not in _DTYPES]
    if unknown:
        raise TypeError(f"{unknown[0]!r}: safetensors cannot store {tensors[unknown[0]].dtype}")
    for name in sorted(tensors, key=lambda n: (_DTYPE_ORDER[_DTYPES[tensors[n].dtype]], n)):
        t = tensors[name]
        data = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        views.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, views


_CRC_POLY = 0xEDB88320  # crc32's polynomial, bits reflected (as zlib has it)


def _gf2_times(a: int, b: int) -> int:
    """``a`` times ``b`` modulo crc32's polynomial (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X_POW2 = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31 (x^1 is bit 30, reflected)
for _ in range(31):
    _X_POW2.append(_gf2_times(_X_POW2[-1], _X_POW2[-1]))


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of A + B from crc32(A), crc32(B) and B's length: zlib's ``crc32_combine``,
    which Python's zlib lacks. What lets pieces of a file be checksummed on several threads."""
    p, k = 1 << 31, 3  # x^0; x^(8 len2): bytes to bits
    while len2:
        if len2 & 1:
            p = _gf2_times(_X_POW2[k & 31], p)
        len2 >>= 1
        k += 1
    return _gf2_times(p, crc1) ^ crc2


def _pieces(views: Iterable[memoryview], size: int) -> Iterator[list[memoryview]]:
    """``views`` in order, in pieces of about ``size`` bytes: a large view cut, small ones together."""
    piece, held = [], 0
    for view in views:
        for start in range(0, len(view), size):
            piece.append(view[start:start + size])
            held += len(piece[-1])
            if held >= size:
                yield piece
                piece, held = [], 0
    if piece:
        yield piece


def _crc32_of(piece: list[memoryview]) -> int:
    crc = 0
    for view in piece:
        crc = zlib.crc32(view, crc)
    return crc


def _crc32_of_mapped(mapped: mmap.mmap, start: int, end: int) -> int:
    with memoryview(mapped) as whole, whole[start:end] as part:  # let go of before the mapping closes
        return zlib.crc32(part)


class _Crc32:
    """The crc32 of the pieces fed to it, in order: each piece's computed on ``pool``'s threads
    while the caller goes on (writing it: zlib and file writes let go of the GIL), combined in
    order at the end. A save pays for the checksum only where no core is free for it (crc32 runs
    at 2-3.5 GB/s a thread: docs/performance.md, 2026-12-06)."""

    def __init__(self, pool: ThreadPoolExecutor):
        self._pool, self._pieces = pool, []

    def feed(self, piece: list[memoryview]) -> None:
        """Views in memory that stays put until ``value()``."""
        self._pieces.append((self._pool.submit(_crc32_of, piece), sum(len(v) for v in piece)))

    def feed_mapped(self, mapped: mmap.mmap, start: int, end: int) -> None:
        self._pieces.append((self._pool.submit(_crc32_of_mapped, mapped, start, end), end - start))

    def value(self) -> str:
        wait([f for f, _ in self._pieces])  # all of them, even where one failed: their memory may go next
        crc = 0
        for crc_of_piece, size in self._pieces:
            crc = _crc32_combine(crc, crc_of_piece.result(), size)
        return f"{crc:08x}"


@contextmanager
def _crc_threads() -> Iterator[ThreadPoolExecutor]:
    """The threads that checksum a save's or a check's pieces (up to 8: memory bandwidth)."""
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="checkpoint-crc32") as pool:
        yield pool


def _header_of(path: str) -> bytes:
    """The header of the safetensors file at ``path``: its length (8 bytes) and JSON, as written."""
    with open(path, "rb") as f:
        head = f.read(8)
        return head + f.read(struct.unpack("<Q", head)[0]) if len(head) == 8 else head


def _parsed(header: bytes) -> object:
    try:
        return json.loads(header[8:])
    except ValueError:
        return None


def _write_tensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None,
                   pool: ThreadPoolExecutor) -> dict:
    """``tensors`` and ``metadata`` written to ``path`` by ``save_file`` (not fsynced); returns
    its checksum record: the crc32 and number of its bytes. The crc32 of the tensor bytes is
    computed from the tensors' memory on ``pool``'s threads while ``save_file`` writes
    (``_Crc32``), that of the header from the file (safetensors orders the metadata as it
    pleases), the two combined. The file's header must lay the tensors out as
    ``_safetensors_layout`` does and its size be the one written: a size that differs is a
    CheckpointError (the storage did not take the bytes); a layout that differs (a safetensors
    that orders tensors otherwise) has the crc32 read from the file instead, with a warning."""
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    header, views = _safetensors_layout(tensors, metadata)
    crc = _Crc32(pool)
    for piece in _pieces(views, _WRITE_CHUNK):
        crc.feed(piece)
    save_file(tensors, path, metadata=metadata)
    data_crc, data_size = crc.value(), sum(len(v) for v in views)
    written = _header_of(path)
    on_disk = os.path.getsize(path)
    if _parsed(written) == _parsed(header):
        if on_disk != len(written) + data_size:
            raise CheckpointError(f"{path}: {on_disk} bytes on disk right after writing {len(written) + data_size} (a "
                                  f"failing disk or filesystem?); not committed, the previous checkpoint stays in force")
        return {"crc32": f"{_crc32_combine(zlib.crc32(written), int(data_crc, 16), data_size):08x}", "bytes": on_disk}
    log.warning("%s: safetensors %s lays files out otherwise than mimo expects; its checksum is read from the "
                "file (slower saves)", path, getattr(safetensors, "__version__", "?"))
    with open_tensors(path):  # the file parses and its header covers it
        pass
    return {"crc32": _file_crc32(path, pool), "bytes": on_disk}


def _state_file(part: _Part, opt: AdamW, copy: Callable[[torch.Tensor], torch.Tensor] = _host_copy
                ) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """The tensors and metadata of this rank's optimizer-state file of ``part`` (the one format,
    module doc): ``{name}.{field}`` 1-d pieces, and as ``shard`` each piece's range, step count
    (``bucket``: the index of its count in ``steps``) and placement record. None: nothing to write."""
    names = part.names_by_param()
    tensors, shard = opt.state_pieces(copy, lambda p: part.writes(names[id(p)]))
    if not shard["ranges"]:
        return None
    shard["placements"] = {n: part.table[n].record() for n in shard["ranges"]}
    return tensors, {"optimizer": type(opt).__name__, "shard": json.dumps(shard)}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    meta = {"python": json.dumps(random.getstate())}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        tensors["numpy_keys"] = torch.from_numpy(keys.astype("int64"))
        meta["numpy"] = json.dumps([kind, int(pos), int(has_gauss), float(cached)])
    except ImportError:
        pass
    return tensors, meta


def _restore_rng(path: str) -> None:
    with open_tensors(path) as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda"))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    version, state, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(state), gauss))
    if "numpy" in meta:
        import numpy as np

        kind, pos, has_gauss, cached = json.loads(meta["numpy"])
        np.random.set_state((kind, tensors["numpy_keys"].numpy().astype("uint32"), pos, has_gauss, cached))


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------- save / load


# one file of a checkpoint: its name in the folder, its tensors (host copies) and metadata
_File = tuple[str, dict[str, torch.Tensor], dict[str, str]]


def _part_files(part: _Part, opt: AdamW | None, rank: int, step: int,
                copy: Callable[[torch.Tensor], torch.Tensor] = _host_copy) -> Iterator[_File]:
    """This rank's files of ``part``, each copied when asked for (a synchronous save holds one
    file's copy at a time): the tensors it owns with their placement records, and its optimizer
    state (``_state_file``: that of those tensors, or its shards)."""
    names = [n for n in part.table if part.writes(n)]
    if not names:
        if opt is not None and (state := _state_file(part, opt, copy)) is not None:  # (a shard of replicas)
            yield (_file(part.module, rank, STATE_KIND), *state)
        return
    stray = [n for n in names if part.owner(n) != rank]
    if stray:  # a parameter whose context does not place this rank where the module's grid does
        raise CheckpointError(f"module {part.module!r}: rank {rank} owns {stray[0]!r} by its placement, but its grid "
                              f"puts the owner at rank {part.owner(stray[0])} (a parameter on the wrong ParallelContext?)")
    tensors = {n: copy(part.table[n].param) for n in names}
    records = {n: part.table[n].record() for n in names}
    yield _file(part.module, rank, "model"), tensors, {"module": part.module, "step": str(step), "rank": str(rank),
                                                       "placements": json.dumps(records)}
    if opt is not None and (state := _state_file(part, opt, copy)) is not None:
        yield (_file(part.module, rank, STATE_KIND), *state)


def _rank_files(model: MimoModel, optimizers: dict[str, AdamW], step: int,
                copy: Callable[[torch.Tensor], torch.Tensor] = _host_copy) -> Iterator[_File]:
    """Every file this rank writes into the checkpoint of ``step``, its RNG state last."""
    for part in _local_parts(model):
        yield from _part_files(part, optimizers.get(part.module), model.rank, step, copy)
    tensors, meta = _rng_state()
    yield f"rng-rank{model.rank:05d}.safetensors", tensors, meta


def _write_files(files: Iterable[_File], directory: str) -> dict[str, dict]:
    """``files`` written into ``directory`` and fsynced; the checksum record of each, by name
    ({"crc32", "bytes"} of the bytes written, ``_write_tensors``)."""
    records = {}
    with _crc_threads() as pool:
        for name, tensors, metadata in files:
            records[name] = _write_tensors(os.path.join(directory, name), tensors, metadata, pool)
    for name in records:
        _fsync(os.path.join(directory, name))
    return records


def _write_part(part: _Part, opt: AdamW | None, directory: str, rank: int, step: int) -> dict[str, dict]:
    """This rank's files of ``part`` (``_part_files``) written into ``directory``; their checksum records."""
    return _write_files(_part_files(part, opt, rank, step), directory)


def _seal(directory: str, rank: int, records: dict[str, dict]) -> None:
    """Rank ``rank``'s checksum records (``_write_tensors``; its files written and fsynced) left
    beside its files in ``directory`` (``checksums-rank<R>.json``, fsynced) for the commit to
    gather into meta.json."""
    path = os.path.join(directory, f"checksums-rank{rank:05d}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f)
        f.flush()
        os.fsync(f.fileno())


def _gather_checksums(tmp: str) -> dict[str, dict]:
    """Every rank's checksums in ``tmp`` (``_seal``), merged; their files removed (meta.json holds them)."""
    merged: dict[str, dict] = {}
    for name in sorted(os.listdir(tmp)):
        if _CHECKSUMS.match(name):
            path = os.path.join(tmp, name)
            with open(path, encoding="utf-8") as f:
                merged.update(json.load(f))
            os.remove(path)
    return merged


def _begin_save(model: MimoModel, optimizers: dict[str, AdamW], step: int, directory: str) -> tuple[str, str]:
    """Every rank, at the same point: the weights still in flight landed, ``step-N.tmp`` made
    afresh by rank 0 before any rank writes there. Returns (the tmp folder, the final one)."""
    final = step_dir(directory, step)
    tmp = final + ".tmp"
    finish_updates(optimizers)  # a sharded optimizer's weights still in flight
    if model.rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of the same step
        os.makedirs(tmp)
    _barrier()
    return tmp, final


def _about(model: MimoModel, step: int, extra_meta: dict | None) -> dict:
    """meta.json but its file list and time, taken when the save starts."""
    return {"format": FORMAT, "step": step, "layout": layout_of(model.config), "torch": torch.__version__,
            "config": model.config.as_dict(), **(extra_meta or {})}


def _commit(tmp: str, final: str, keep: int | None, about: dict) -> None:
    """Rank 0, once every rank's files are on disk in ``tmp`` and sealed (checked, their
    checksums beside them: ``_seal``): meta.json last, with every file's checksum, fsynced, the
    rename to ``final`` (the commit), then old checkpoints beyond ``keep`` usable ones pruned
    (``prune``). A file without a checksum is an error: nothing is committed."""
    directory = os.path.dirname(final)
    checksums = _gather_checksums(tmp)
    files = sorted(os.listdir(tmp))
    unsealed = [name for name in files if name not in checksums]
    if unsealed:
        raise CheckpointError(f"{os.path.join(tmp, unsealed[0])}: written without a checksum (not by _write_files, "
                              f"or its rank's checksums-rank file is missing); not committed, the previous checkpoint stays in force")
    meta = {**about, "files": files, "checksums": {name: checksums[name] for name in files},
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    if os.path.exists(final):  # the same step saved again (e.g. after a config change): replace it
        os.rename(final, final + ".old")
        shutil.rmtree(final + ".old", ignore_errors=True)
    os.rename(tmp, final)  # the commit
    _fsync(directory)
    for path in prune(directory, keep, newest=about["step"]):
        log.info("deleted old checkpoint %s (keep=%s)", path, keep)


def save_checkpoint(model: MimoModel, optimizers: dict[str, AdamW], step: int, directory: str,
                    keep: int | None = None, extra_meta: dict | None = None,
                    after_write: Callable[[], None] | None = None) -> str:
    """Write the checkpoint of ``step``; every rank calls it at the same point. Returns its path.
    (``mimo.training.async_save`` writes the same files in the background.)

    ``after_write`` runs on each rank after its files are written, before the commit (a test hook).
    """
    tmp, final = _begin_save(model, optimizers, step, directory)
    _seal(tmp, model.rank, _write_files(_rank_files(model, optimizers, step), tmp))
    if after_write is not None:
        after_write()
    _barrier()  # every rank's files are on disk
    if model.rank == 0:
        _commit(tmp, final, keep, _about(model, step, extra_meta))
    _barrier()
    return final


class _Files:
    """The files of a checkpoint, each opened once, with its placement records (a model file's)."""

    def __init__(self, path: str, stack: ExitStack):
        self.path, self._stack = path, stack
        self._open: dict[str, tuple[object, dict]] = {}

    def get(self, file: str) -> tuple[object, dict]:
        if file not in self._open:
            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                raise CheckpointError(f"{self.path}: no {file} (the checkpoint does not fit this model: another architecture?)")
            f = self._stack.enter_context(open_tensors(full))
            self._open[file] = f, json.loads(f.metadata().get("placements", "{}"))
        return self._open[file]


# state a run may add or drop across a resume (``train.fp8`` delayed turned on or off): absent
# from the checkpoint it starts empty, absent from the model it is left unread; stored at another
# shape (a setting changed: ``amax_history``) it is fitted to the model's by its function
OPTIONAL_STATE = {"fp8_history": fit_history}


def optional_state(name: str) -> bool:
    return name.rpartition(".")[2] in OPTIONAL_STATE


def _fit_optional(name: str, saved: torch.Tensor, shape, where: str) -> torch.Tensor:
    fitted = OPTIONAL_STATE[name.rpartition(".")[2]](saved, shape)
    if fitted is None:
        raise CheckpointError(f"{where}: {name!r} is {tuple(saved.shape)}, this model's is {tuple(shape)}: another architecture")
    return fitted


def _check_records(part: _Part, files: _Files) -> None:
    """At the checkpoint's own layout: each parameter of ``part`` is in its owner's file with this
    rank's placement record and shape, and a file of this rank's own stage holds nothing this
    module does not have (reads headers only; ``_read_weights`` then reads the tensors)."""
    own_stage: set[str] = set()
    for name, info in part.table.items():
        file = _file(part.module, part.owner(name), "model")
        if name not in part.first_stage_copies:
            own_stage.add(file)
        f, records = files.get(file)
        where = f"{os.path.join(files.path, file)}: does not fit module {part.module!r}"
        if optional_state(name):  # absent: starts empty; at another shape: fitted (``_read_weights``)
            continue
        if name not in records:
            raise CheckpointError(f"{where}: no tensor {name!r}")
        mine = info.record()
        if records[name] != mine:
            raise CheckpointError(f"{where}: {name!r} was written with placement {records[name]}, this rank holds {mine}")
        shape = tuple(f.get_slice(name).get_shape())
        if shape != tuple(info.param.shape):
            raise CheckpointError(f"{where}: {name!r} has shape {shape}, this rank holds {tuple(info.param.shape)}")
    for file in sorted(own_stage):
        extra = sorted(n for n in set(files.get(file)[1]) - set(part.table) if not optional_state(n))
        if extra:
            raise CheckpointError(f"{os.path.join(files.path, file)}: does not fit module {part.module!r}: "
                                  f"unexpected tensors {extra[:3]}{' ...' if len(extra) > 3 else ''}")


def _owner_files(part: _Part, rank: int) -> set[str]:
    """At the checkpoint's own layout, the files that hold what this rank reads of ``part``: its
    owners' model and optimizer-state files (either format), and its own state file (a shard)."""
    owners = {part.owner(n) for n in part.table} | {rank}
    return {_file(part.module, r, kind) for r in owners for kind in ("model", STATE_KIND, "optim")}


def holds_whole(meta: dict, module: str) -> bool:
    """Whether the checkpoint (its ``meta``) holds ``module`` whole: written without a ``lora``
    section, so its base weights are in it (a LoRA checkpoint's are not)."""
    theirs = ((meta.get("config") or {}).get("modules") or {})
    return module in theirs and not (theirs[module] or {}).get("lora")


def load_checkpoint(model: MimoModel, path: str, optimizers: dict[str, AdamW] | None = None,
                    rng: bool = True, start: bool = False) -> dict:
    """Restore this rank's model shards (and optimizer states, RNG) from the checkpoint at
    ``path``; returns its meta. Every tensor is assembled from the stored pieces that overlap it
    (``mimo.training.reshard.StoredModule``, the one reader): at the checkpoint's layout from its
    owners' files, after checking their placement records (``_check_records``); at another one
    from whichever files hold it. Missing or unfitting files are a CheckpointError. Every rank of
    the world calls it (a resharded load checks, world-wide, that every stored tensor found a reader)."""
    meta = read_meta(path)
    same = check_layout(meta, model.config, path)
    missing = [f for f in meta["files"] if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise CheckpointError(f"{path}: incomplete, missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    # ``start`` (a new run from the checkpoint's weights, train.init_from): a module with lora
    # that the checkpoint holds whole reads its base from it, its adapters start fresh
    base_of = {name for name, m in model.config.modules.items() if m.lora is not None and holds_whole(meta, name)} if start else set()
    parts = {part.module: part for part in _local_parts(model, base_of)}
    stored: dict[str, StoredModule] = {}
    with ExitStack() as stack:
        files = _Files(path, stack)
        for module, part in parts.items():
            stored[module] = _read_part(part, (optimizers or {}).get(module), files, meta["files"], model.rank, same)
    if not same:
        _check_all_read({m: set(p.table) for m, p in parts.items()}, {m: s.names() for m, s in stored.items()}, path)
    for part in model.parts:
        if part.name in base_of and part.module is not None and not model.config.modules[part.name].lora.init:
            init_magnitudes_(part.module)  # DoRA: from the base just read (lora.init: the adapter's own)
    if rng:
        rng_file = os.path.join(path, f"rng-rank{model.rank:05d}.safetensors")
        if same or os.path.isfile(rng_file):  # (training draws from seeded generators of its own: see reshard)
            _restore_rng(rng_file)
    model.weights_written()
    return meta


def _read_part(part: _Part, opt: AdamW | None, files: _Files, names: list[str], rank: int,
               same: bool) -> StoredModule:
    """``part``'s weights (and ``opt``'s state) from the checkpoint's files (``names``: its file
    list) through its module's reader, which it returns; ``same``: at the checkpoint's layout."""
    if same:
        _check_records(part, files)
    stored = StoredModule(files.path, names, part.module, files.get, first=_owner_files(part, rank) if same else None)
    _read_weights(part, stored)
    if opt is not None:
        _read_state(part, opt, stored, files.path)
    return stored


@torch.no_grad()
def _read_weights(part: _Part, stored: StoredModule) -> None:
    for name, info in part.table.items():
        if optional_state(name):
            shape = stored.full_shape(name)
            if shape is None:  # not in the checkpoint: starts empty
                continue
            if shape != info.placement.full_shape:  # stored at another shape: fitted
                whole = stored.read(name, "param", replace(info, placement=replicated(shape)))
                info.param.copy_(_fit_optional(name, whole, info.param.shape, stored.path))
                continue
        info.param.copy_(stored.read(name, "param", info))


@torch.no_grad()
def _read_state(part: _Part, opt: AdamW, stored: StoredModule, path: str) -> None:
    """``opt``'s state for ``part``'s parameters at this rank's layout, from the stored pieces
    (whichever optimizer and precision wrote them: the masters are the stored ones, else the
    stored weights); state of parameters not trained now, or none of ones that are, is a
    freezing change."""
    by_param = part.names_by_param()
    trained = {by_param[id(pc.param)] for s in opt.states for pc in s.pieces}
    untrained = sorted(n for n in part.table if n not in trained and stored.holds_state(n))
    absent = sorted(n for n in trained if n not in stored.fresh and not stored.has(n, "exp_avg"))
    if untrained or absent:
        raise CheckpointError(f"{path}: optimizer state is for other parameters (not in the checkpoint: {absent[:3]}, "
                              f"not trained now: {untrained[:3]}); did freezing change?")
    infos = {name: part.table[name] for name in by_param.values()}
    opt.load_local_states(lambda n, master: None if n in stored.fresh else stored.adam_state(n, infos[n], master),
                          lambda n: 0.0 if n in stored.fresh else stored.step(n), path)


def _check_all_read(loaded: dict[str, set[str]], stored: dict[str, set[str]], path: str) -> None:
    """Collective over the world: every tensor the checkpoint holds was read by some rank
    (else the model lacks it: another architecture, fewer layers)."""
    everyone = [loaded]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, loaded)
    for module, names in stored.items():
        read = set().union(*(got.get(module, set()) for got in everyone))
        extra = sorted(n for n in names - read if not optional_state(n))
        if extra:
            raise CheckpointError(f"{path}: module {module!r} of the checkpoint holds tensors this model does not have: "
                                  f"{extra[:3]}{' ...' if len(extra) > 3 else ''} (another architecture?)")
