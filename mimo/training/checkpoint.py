"""Checkpoints: every rank's model shards, optimizer states and RNG, written atomically.

Layout on disk (``train.checkpoint.dir``)::

    step-00000004/                       a complete checkpoint (the name is only ever renamed into place)
      meta.json                          step, the layout it was written at, files, the resolved config
      language-tp0-pp0.model.safetensors one file per (module, model-parallel coordinates)
      language-tp0-pp0.optim.safetensors AdamW state of those parameters, by parameter name
      vision-tp0.model.safetensors
      rng-rank00003.safetensors          torch / Python / NumPy RNG of each rank
    step-00000006.tmp/                   a save in progress (or a crashed one): never loaded

Weights and optimizer states are each rank's *local* shards, saved as they are: no gathering,
exactly what the rank restores. Copies that are identical by construction (data- and
context-parallel replicas: their gradients are summed, so they take identical steps) are
written once, by the replica with dp = cp = 0; every replica reads that file back. A
checkpoint therefore records the layout it was written at, and loading it at another layout
is a ``CheckpointError`` until resharding exists.

Atomicity: all ranks write into ``step-N.tmp``; after a barrier rank 0 writes ``meta.json``
last, fsyncs, and renames the folder to ``step-N``. A crash at any point (kill -9 included)
leaves either no ``step-N`` or a complete one; a complete checkpoint is a ``step-N`` folder
with ``meta.json``. Old checkpoints beyond ``keep`` are renamed to ``.old`` before deletion,
so a crash while pruning never leaves a half-deleted folder that looks complete.

The checkpoint folder must be visible to every rank (a shared filesystem across nodes).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_model, save_file, save_model

from mimo.compose.config import MimoConfig
from mimo.core.errors import CheckpointError
from mimo.parallel.grid import ParallelGrid
from mimo.compose.model import MimoModel

log = logging.getLogger("mimo.training.checkpoint")

FORMAT = 1
META = "meta.json"
_COMPLETE = re.compile(r"^step-(\d{8})$")
_LEFTOVER = re.compile(r"^step-(\d{8})\.(tmp|old)$")
# grid dimensions over which parameters and optimizer states are identical copies
_REPLICA_DIMS = ("dp", "cp")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


# ---------------------------------------------------------------- layout


def layout_of(config: MimoConfig) -> dict:
    """What decides how parameters are split into local shards: sizes and rank ranges."""
    modules = {}
    for name, m in config.modules.items():
        par, ranks = m.parallel, config.rank_range(name)
        modules[name] = {"ranks": f"{ranks.start}:{ranks.stop}", **{d: getattr(par, d) for d in ("tp", "cp", "dp", "pp", "ep", "etp")}}
    return {"world_size": config.world_size, "modules": modules}


def describe_layout(layout: dict) -> str:
    """``[world_size=4; vision tp=1,dp=4,ranks=0:4; language tp=2,dp=2,ranks=0:4]`` (sizes of 1 left out but tp)."""
    parts = []
    for name, m in layout["modules"].items():
        sizes = [f"{d}={m[d]}" for d in ("tp", "cp", "dp", "pp", "ep", "etp") if d == "tp" or m.get(d, 1) != 1]
        parts.append(f"{name} {','.join(sizes)},ranks={m['ranks']}")
    return f"[world_size={layout['world_size']}; " + "; ".join(parts) + "]"


def check_layout(meta: dict, config: MimoConfig, path: str) -> None:
    want = layout_of(config)
    if meta.get("layout") != want:
        raise CheckpointError(
            f"{path}: checkpoint written at layout {describe_layout(meta['layout'])}, config asks for "
            f"{describe_layout(want)}; resharding is not supported yet (train at the checkpoint's layout, "
            f"or start a new run with another train.checkpoint.dir)"
        )


# ---------------------------------------------------------------- finding checkpoints


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, META), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a complete checkpoint ({META}: {e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, this mimo reads format {FORMAT}")
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


def resolve_checkpoint(path: str) -> str:
    """A ``step-N`` folder as is; a folder of them: its latest complete one."""
    if os.path.isfile(os.path.join(path, META)):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: no complete checkpoint there (a step-NNNNNNNN folder with {META})")
    return latest[1]


def remove_leftovers(directory: str) -> list[str]:
    """Delete what crashed saves and prunes left behind; returns the removed paths."""
    removed = []
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            if _LEFTOVER.match(name):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
                removed.append(os.path.join(directory, name))
    return removed


def prune(directory: str, keep: int | None) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints; returns the deleted paths."""
    found = complete_checkpoints(directory)
    if keep is None or len(found) <= keep:
        return []
    deleted = []
    for _, path in found[: len(found) - keep]:
        doomed = path + ".old"
        os.rename(path, doomed)  # no longer looks complete, even if the deletion is cut short
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(path)
    return deleted


# ---------------------------------------------------------------- what each rank holds


def _local_parts(model: MimoModel) -> list[tuple[str, ParallelGrid, torch.nn.Module]]:
    parts = [(name, p.grid, p.module) for name, p in model.encoders.items() if p.module is not None]
    if model.stage is not None:
        parts.append((model.llm_name, model.llm_grid, model.stage))
    return parts


def _shard_name(module: str, grid: ParallelGrid, rank: int) -> tuple[str, bool]:
    """The file stem of this rank's shard of ``module``, and whether this rank writes it."""
    coords = grid.coords(rank)
    key = "-".join(f"{d}{i}" for d, i in coords.items() if d not in _REPLICA_DIMS)
    writes = all(coords.get(d, 0) == 0 for d in _REPLICA_DIMS)
    return f"{module}-{key}", writes


def _names_by_param(model: MimoModel, module: str) -> dict[int, str]:
    names: dict[int, str] = {}
    for p in model.train_params():
        if p.module == module:
            names.setdefault(id(p.param), p.name)
    return names


def _ordered_names(opt: torch.optim.Optimizer, names_by_param: dict[int, str]) -> list[str]:
    # state_dict() numbers parameters consecutively over the param groups, in this order
    return [names_by_param[id(p)] for g in opt.param_groups for p in g["params"]]


# ---------------------------------------------------------------- serialisation


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_optimizer(opt: torch.optim.Optimizer, names: list[str], path: str) -> None:
    tensors, scalars = {}, {}
    for i, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                # a copy: entries may share memory (MasterWeightAdamW's group step count, buffer views)
                tensors[f"{names[i]}/{key}"] = value.detach().to("cpu", copy=True).contiguous()
            else:
                scalars[f"{names[i]}/{key}"] = value
    save_file(tensors, path, metadata={"optimizer": type(opt).__name__, "params": json.dumps(names), "scalars": json.dumps(scalars)})


def _load_optimizer(opt: torch.optim.Optimizer, names: list[str], path: str) -> None:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; no optimizer state for these parameters (were they frozen when the checkpoint was written?)")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("optimizer", type(opt).__name__) != type(opt).__name__:
        raise CheckpointError(
            f"{path}: optimizer state of a {meta['optimizer']}, this run uses a {type(opt).__name__} "
            "(train.precision changed between bf16 and bf16-pure?); resume with the precision it was written with, "
            "or start from its weights with train.init_from"
        )
    saved = json.loads(meta["params"])
    if saved != names:
        missing, unexpected = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
        raise CheckpointError(
            f"{path}: optimizer state is for other parameters (not in the checkpoint: {missing[:3]}, "
            f"not trained now: {unexpected[:3]}); did freezing change?"
        )
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict] = defaultdict(dict)
    for key, value in [*tensors.items(), *json.loads(meta["scalars"]).items()]:
        name, field = key.rsplit("/", 1)
        state[index[name]][field] = value
    sd = opt.state_dict()
    sd["state"] = dict(state)
    opt.load_state_dict(sd)


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
    with safe_open(path, "pt") as f:
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


def save_checkpoint(model: MimoModel, optimizers: dict[str, torch.optim.Optimizer], step: int, directory: str,
                    keep: int | None = None, extra_meta: dict | None = None,
                    after_write: Callable[[], None] | None = None) -> str:
    """Write the checkpoint of ``step``; every rank calls it at the same point. Returns its path.

    ``after_write`` runs on each rank after its files are written, before the commit (a test hook).
    """
    rank, final = model.rank, step_dir(directory, step)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of the same step
        os.makedirs(tmp)
    _barrier()
    written = []
    for module, grid, part in _local_parts(model):
        stem, writes = _shard_name(module, grid, rank)
        if not writes:
            continue
        written.append(os.path.join(tmp, f"{stem}.model.safetensors"))
        save_model(part, written[-1], metadata={"module": module, "step": str(step)})
        opt = optimizers.get(module)
        if opt is not None:
            written.append(os.path.join(tmp, f"{stem}.optim.safetensors"))
            _save_optimizer(opt, _ordered_names(opt, _names_by_param(model, module)), written[-1])
    tensors, meta = _rng_state()
    written.append(os.path.join(tmp, f"rng-rank{rank:05d}.safetensors"))
    save_file(tensors, written[-1], metadata=meta)
    for path in written:
        _fsync(path)
    if after_write is not None:
        after_write()
    _barrier()  # every rank's files are on disk
    if rank == 0:
        meta = {
            "format": FORMAT, "step": step, "layout": layout_of(model.config), "files": sorted(os.listdir(tmp)),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
            "config": model.config.as_dict(), **(extra_meta or {}),
        }
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
        for path in prune(directory, keep):
            log.info("deleted old checkpoint %s (keep=%s)", path, keep)
    _barrier()
    return final


def load_checkpoint(model: MimoModel, path: str, optimizers: dict[str, torch.optim.Optimizer] | None = None,
                    rng: bool = True) -> dict:
    """Restore this rank's model shards (and optimizer states, RNG) from the checkpoint at
    ``path``; returns its meta. Raises CheckpointError for another layout or missing files."""
    meta = read_meta(path)
    check_layout(meta, model.config, path)
    missing = [f for f in meta["files"] if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise CheckpointError(f"{path}: incomplete, missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    grids = {}
    for module, grid, part in _local_parts(model):
        grids[module] = grid
        stem, _ = _shard_name(module, grid, model.rank)
        file = os.path.join(path, f"{stem}.model.safetensors")
        try:
            load_model(part, file, strict=True)
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{file}: does not fit module {module!r}: {' '.join(str(e).split())[:400]}") from None
    for module, opt in (optimizers or {}).items():
        stem, _ = _shard_name(module, grids[module], model.rank)
        _load_optimizer(opt, _ordered_names(opt, _names_by_param(model, module)), os.path.join(path, f"{stem}.optim.safetensors"))
    if rng:
        _restore_rng(os.path.join(path, f"rng-rank{model.rank:05d}.safetensors"))
    return meta
