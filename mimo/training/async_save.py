"""Asynchronous checkpoint saves (``train.checkpoint.async_save``): the step pays for a snapshot only.

On the training thread a save takes its snapshot: every tensor the checkpoint holds copied off
the training path (a CPU tensor cloned; a CUDA tensor copied into a pinned host buffer without
blocking, all of a save's copies in flight at once and waited for by one synchronize, the
buffers kept for the next save), the RNG state, and the ``step-N.tmp`` folder made with the
barrier of a synchronous save. A background thread per rank then writes the same files as
``save_checkpoint``, each with the crc32 of its bytes computed as they are written, fsyncs them,
reads them back against those checksums, leaves the checksums beside them
(``checksums-rank<R>.json``) and then a mark ``done-rank<R>`` in the folder. Rank 0's thread
waits for every rank's mark by listing the folder, not by a collective (torch.distributed is not
safe to call from a second thread while training calls it), deletes the marks and commits as a
synchronous save does: every rank's checksums gathered into meta.json, fsync, rename, prune
(only after the commit, counting usable checkpoints only: ``checkpoint.prune``). The
checksums are computed on the writer's threads, so an asynchronous save's step pays for none of them.
A writer that fails (a file whose size on disk is not what was written included) leaves
``error-rank<R>`` with its message instead, so rank 0 stops waiting at once; a rank that has not
marked its files after ``timeout_s`` is an error naming it.

The next save waits for the previous one on every rank, as ``wait()`` does (the end of training,
a stop, anything reading the newest checkpoint), and re-raises a writer's error on the training
thread of every rank. A crash mid-write (kill -9 included) leaves no ``step-N``: the last complete
checkpoint stays in force, and the next run deletes the ``.tmp`` folder (``remove_leftovers``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from mimo.compose.model import MimoModel
from mimo.core.errors import CheckpointError
from mimo.training.checkpoint import (_about, _begin_save, _commit, _File, _host_copy, _rank_files, _seal, _write_files,
                                      save_checkpoint)

log = logging.getLogger("mimo.training.async_save")

POLL_S = 0.1  # how often rank 0's writer looks for the other ranks' marks


class CheckpointSaver:
    """The checkpoints of one run, written synchronously (``save_checkpoint``) or, with
    ``async_save``, in the background. Every rank calls ``save`` and ``wait`` at the same points.
    ``timeout_s``: how long rank 0 waits for the other ranks' files after writing its own."""

    def __init__(self, directory: str, keep: int | None = None, async_save: bool = False, timeout_s: float = 900.0):
        self.directory, self.keep, self.async_save, self.timeout_s = directory, keep, async_save, timeout_s
        self._staging = _Staging()
        self._writer: _Writer | None = None

    def save(self, model: MimoModel, optimizers: dict[str, torch.optim.Optimizer], step: int,
             extra_meta: dict | None = None, after_write: Callable[[], None] | None = None) -> str:
        """The checkpoint of ``step``; returns its path, which exists once the save is committed:
        on return for a synchronous save, after ``wait()`` for an asynchronous one. ``after_write``
        runs after this rank's files are written, before its mark (on the writer thread)."""
        if not self.async_save:
            return save_checkpoint(model, optimizers, step, self.directory, self.keep, extra_meta, after_write)
        self.wait()  # its buffers and its folder are the previous save's until it is done
        t0 = time.perf_counter()
        tmp, final = _begin_save(model, optimizers, step, self.directory)
        files = list(_rank_files(model, optimizers, step, self._staging.copy))
        self._staging.ready()  # from here on training may change every tensor
        about = _about(model, step, extra_meta) if model.rank == 0 else None
        world = dist.get_world_size() if dist.is_initialized() else 1
        self._writer = _Writer(files, tmp, final, model.rank, world, self.keep, about, self.timeout_s, after_write,
                               snapshot_s=time.perf_counter() - t0)
        self._writer.start()
        return final

    def wait(self) -> None:
        """Every rank: until the previous save is written everywhere and committed; a writer's
        error is raised on every rank (its own on the rank it happened on)."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        writer.join()
        failed = _failed_ranks(writer.error is not None)  # also: no rank goes on before rank 0 committed
        if writer.error is not None:
            raise writer.error
        if failed:
            raise CheckpointError(f"{writer.final}: not saved: writing it in the background failed on rank(s) "
                                  f"{failed} (their logs say why); the previous checkpoint stays in force")


class _Writer(threading.Thread):
    """One rank's background write of one save (see the module doc); ``error`` once it failed."""

    def __init__(self, files: list[_File], tmp: str, final: str, rank: int, world: int, keep: int | None,
                 about: dict | None, timeout_s: float, after_write: Callable[[], None] | None, snapshot_s: float):
        # a daemon: a rank that fails or stops meanwhile ends mid-write, as a crash would
        super().__init__(name=f"checkpoint-writer {os.path.basename(final)}", daemon=True)
        self.files, self.tmp, self.final, self.rank, self.world, self.keep = files, tmp, final, rank, world, keep
        self.about, self.timeout_s, self.after_write, self.snapshot_s = about, timeout_s, after_write, snapshot_s
        self.error: BaseException | None = None

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            records = _write_files(self.files, self.tmp)
            self.files = None  # the host copies (not the pinned buffers: the staging keeps those)
            _seal(self.tmp, self.rank, records)  # their checksums beside them
            if self.after_write is not None:
                self.after_write()
            _mark(self.tmp, "done", self.rank)
            if self.rank == 0:
                await_marks(self.tmp, self.world, self.timeout_s)
                for r in range(self.world):  # not part of the checkpoint: meta.json lists the folder
                    os.remove(os.path.join(self.tmp, _mark_name("done", r)))
                _commit(self.tmp, self.final, self.keep, self.about)
            log.info("%s %s in the background in %.2f s (the training step paid %.2f s)", self.final,
                     "committed: written" if self.rank == 0 else "this rank's files written", time.perf_counter() - t0,
                     self.snapshot_s)
        except BaseException as e:  # raised on the training thread by wait()
            self.error = e
            log.error("%s: the background write failed: %s: %s", self.final, type(e).__name__, e)
            try:
                _mark(self.tmp, "error", self.rank, f"{type(e).__name__}: {e}")
            except OSError:
                pass


def await_marks(tmp: str, world: int, timeout_s: float) -> None:
    """Until every rank of ``world`` marked its files done in ``tmp``. A rank's error mark, or a
    mark still missing after ``timeout_s``, is a CheckpointError naming the ranks."""
    deadline = time.monotonic() + timeout_s
    while True:
        present = set(os.listdir(tmp))
        failed = [r for r in range(world) if _mark_name("error", r) in present]
        if failed:
            with open(os.path.join(tmp, _mark_name("error", failed[0])), encoding="utf-8") as f:
                raise CheckpointError(f"{tmp}: rank(s) {failed} could not write their checkpoint files "
                                      f"(rank {failed[0]}: {f.read()}); the previous checkpoint stays in force")
        missing = [r for r in range(world) if _mark_name("done", r) not in present]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"{tmp}: rank(s) {missing} did not finish writing their checkpoint files within "
                                  f"{timeout_s:g} s (stopped, or not writing to a folder every rank shares?); "
                                  f"the previous checkpoint stays in force")
        time.sleep(POLL_S)


def _mark_name(kind: str, rank: int) -> str:
    return f"{kind}-rank{rank:05d}"


def _mark(tmp: str, kind: str, rank: int, text: str = "") -> None:
    """Rank ``rank``'s ``done`` / ``error`` mark in ``tmp``, on disk (after its files: fsynced first)."""
    with open(os.path.join(tmp, _mark_name(kind, rank)), "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _failed_ranks(failed: bool) -> list[int]:
    """The ranks whose writer failed (a collective of every rank, on the training thread)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return []  # (this rank's own error is raised first)
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)  # a CPU tensor: gloo, whatever the device
    flags[dist.get_rank()] = int(failed)
    dist.all_reduce(flags)
    return flags.nonzero().flatten().tolist()


class _Staging:
    """Host copies of what an asynchronous save writes. A CUDA tensor goes into a pinned host
    buffer by a non-blocking copy (``ready`` waits for them all at once); the buffers are kept
    for the next save, which copies the same tensors in the same order (and starts only once the
    previous save's writer is done with them). A CPU tensor is cloned."""

    def __init__(self):
        self._buffers: list[torch.Tensor] = []
        self._used = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return _host_copy(t)
        i, self._used = self._used, self._used + 1
        if i == len(self._buffers):
            self._buffers.append(torch.empty(0))
        if self._buffers[i].shape != t.shape or self._buffers[i].dtype != t.dtype:
            self._buffers[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._buffers[i].copy_(t.detach(), non_blocking=True)
        return self._buffers[i]

    def ready(self) -> None:
        """The copies of this save all landed (one synchronize)."""
        if self._used:
            torch.cuda.synchronize()
        self._used = 0
