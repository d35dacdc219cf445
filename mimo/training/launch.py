"""Local multi-process worker pools over a real process group (gloo, or NCCL on GPUs).

A ``WorkerPool`` starts N processes once, each joining one process group, and then runs
many cases in them: ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank and returns
the per-rank results. Tests use it through a fixture; the ``verify-*`` commands use it too.

Failure handling is what makes it safe in CI: an exception on any rank, or a case that
exceeds its deadline (a hung collective), ends the case within seconds with that rank's
message; the pool is then torn down and restarted on the next ``run``, because the other
ranks may be stuck inside a collective that will never complete.

``fn`` must be a module-level function. It travels as (source file, qualified name) and
the worker loads that file itself, so functions defined in test modules (imported by
pytest under names a fresh process could not import) work too.

``device="cuda"``: one process per GPU (rank r drives GPU r, ``LOCAL_RANK`` set as torchrun
would), and the group is ``cpu:gloo,cuda:nccl`` as under ``mimo train``: CUDA tensors travel
over NCCL, CPU tensors (statistics, data routing) over gloo. The group is bound to the rank's
GPU, so NCCL communicators of every group are created eagerly, when the group is made; a
first point-to-point batch on a group then needs no collective before it.

A worker whose launcher dies (kill -9 included) ends at once and silently, before it computes
or writes anything more: on Linux the kernel kills it (``PR_SET_PDEATHSIG``), and on any
system a thread of it waits on its parent's sentinel (a pipe the parent holds open) and exits
when that closes. The kernel's signal follows the *thread* that started the process, so the
pool starts its processes from one daemon thread that lives as long as the launcher.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import io
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from mimo.core.errors import DistributedError


@dataclass(frozen=True)
class _FnRef:
    module: str  # importable module name, or "" when loaded from ``path``
    path: str
    qualname: str


def _fn_ref(fn: Callable) -> _FnRef:
    qualname = fn.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"{qualname} must be a module-level function to run on a worker pool")
    path = fn.__code__.co_filename
    # mimo's own modules are imported by name; anything else (test modules, which pytest's
    # importlib mode imports under names a fresh process cannot resolve) is loaded from its file.
    importable = fn.__module__ == "mimo" or fn.__module__.startswith("mimo.")
    return _FnRef(fn.__module__ if importable else "", path, qualname)


def _resolve(ref: _FnRef, cache: dict) -> Callable:
    key = (ref.module, ref.path)
    mod = cache.get(key)
    if mod is None:
        if ref.module:
            mod = importlib.import_module(ref.module)
        else:
            name = f"_mimo_pool_{abs(hash(ref.path))}"
            spec = importlib.util.spec_from_file_location(name, ref.path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        cache[key] = mod
    obj = mod
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _dumps(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


DEVICES = ("cpu", "cuda")


def check_device(device: str, world_size: int) -> None:
    """A clear error, before any process starts, when ``device`` cannot host ``world_size`` ranks."""
    if device not in DEVICES:
        raise DistributedError(f"device {device!r}: use one of {', '.join(DEVICES)}")
    if device == "cuda":
        import torch

        have = torch.cuda.device_count()  # does not initialise CUDA in this process
        if have < world_size:
            # NCCL cannot put two ranks of one communicator on one GPU
            raise DistributedError(f"--device cuda runs one rank per GPU: {world_size} ranks need {world_size} GPUs, {have} visible")


def resolve_device(device: str, world_size: int) -> str:
    """``auto``: one GPU per rank when this machine has enough, else the CPU; then checked."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.device_count() >= world_size else "cpu"
    check_device(device, world_size)
    return device


def rank_compute_device(device: str):
    """The ``torch.device`` a rank computes on, inside a worker (or torchrun process) started
    for ``device``: the CPU, or the GPU the launcher bound the rank to."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def kill_with_parent() -> None:
    """Linux: the kernel kills this process (SIGKILL) when the thread that started it ends."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _die_with_parent() -> None:
    """End this process the moment its parent does, without a word (see the module doc)."""
    kill_with_parent()
    sentinel = mp.parent_process().sentinel  # also ready when the parent died before the prctl

    def watch():
        wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="mimo-parent-watch", daemon=True).start()


def _worker_main(rank: int, world_size: int, init_file: str, conn: Connection, pg_timeout_s: float, device: str = "cpu") -> None:
    _die_with_parent()  # first: nothing below may outlive the launcher
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        kwargs = {}
        backend = "gloo"
        if device == "cuda":
            os.environ["LOCAL_RANK"] = str(rank)
            torch.cuda.set_device(rank)
            backend, kwargs = "cpu:gloo,cuda:nccl", {"device_id": torch.device("cuda", rank)}
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
            **kwargs,
        )
        conn.send(("ready", rank, b""))
    except Exception:
        conn.send(("error", rank, traceback.format_exc().encode()))
        return
    cache: dict = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        ref, payload = msg
        try:
            fn = _resolve(ref, cache)
            args, kwargs = _loads(payload)
            result = fn(*args, **kwargs)
            conn.send(("ok", rank, _dumps(result)))
        except BaseException:
            conn.send(("error", rank, traceback.format_exc().encode()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


_starter: tuple[int, queue.SimpleQueue] | None = None  # (the pid it serves, its requests)
_starter_lock = threading.Lock()


def _on_lasting_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on one daemon thread that lives as long as this process (a short-lived caller's
    thread would take its children's PR_SET_PDEATHSIG with it when it ends). Not a
    ThreadPoolExecutor: its thread is joined at interpreter exit, before atexit handlers, which
    would kill the ranks before a pool closed there could end them cleanly."""
    global _starter
    with _starter_lock:
        if _starter is None or _starter[0] != os.getpid():  # none yet, or inherited through a fork without its thread
            requests: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(requests,), name="mimo-process-starter", daemon=True).start()
            _starter = os.getpid(), requests
    done: cf.Future = cf.Future()
    _starter[1].put((fn, done))
    return done.result()


def _serve(requests: queue.SimpleQueue) -> None:
    while True:
        fn, done = requests.get()
        try:
            done.set_result(fn())
        except BaseException as e:
            done.set_exception(e)


class WorkerPool:
    """N local ranks in one process group, reused across many ``run`` calls."""

    def __init__(self, world_size: int, timeout_s: float = 120.0, start_timeout_s: float = 120.0,
                 collective_timeout_s: float | None = None, device: str = "cpu"):
        """``timeout_s``: a case's deadline (``math.inf``: none, e.g. a whole training run);
        ``collective_timeout_s``: how long one collective may wait before it raises on its rank
        (default: ``timeout_s``, at least 30 s); ``device``: ``cpu`` (gloo) or ``cuda`` (one
        GPU per rank, NCCL)."""
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        check_device(device, world_size)
        self.device = device
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._tmpdir: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- lifecycle ----
    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.TemporaryDirectory(prefix="mimo-pool-")
        init_file = os.path.join(self._tmpdir.name, "rendezvous")
        # Children inherit the environment at spawn: one intra-op thread per rank.
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for rank in range(self.world_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=_worker_main,
                    args=(rank, self.world_size, init_file, child, self.collective_timeout_s or max(min(self.timeout_s, 86400.0), 30.0), self.device),
                    daemon=True,
                    name=f"mimo-rank{rank}",
                )
                _on_lasting_thread(p.start)
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        self._collect("start", deadline=time.monotonic() + self.start_timeout_s)

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=5)
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    # ---- running cases ----
    def run(self, fn: Callable, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self._procs:
            self._start()
        ref = _fn_ref(fn)
        payload = _dumps((args, kwargs))
        for c in self._conns:
            c.send((ref, payload))
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return self._collect(fn.__qualname__, deadline=time.monotonic() + timeout)

    def _collect(self, what: str, deadline: float) -> list[Any]:
        results: dict[int, Any] = {}
        pending = {c: r for r, c in enumerate(self._conns)}
        while pending:
            left = deadline - time.monotonic()
            # waits are capped (poll() rejects timeouts of weeks): an infinite deadline just loops
            ready = wait(list(pending), timeout=min(left, 3600.0)) if left > 0 else []
            if not ready and time.monotonic() < deadline:
                continue
            if not ready:
                stuck = sorted(pending.values())
                self._kill()
                raise DistributedError(
                    f"{what}: timed out; ranks {stuck} did not finish (a hung collective, or "
                    f"a rank waiting for one that failed)"
                )
            for c in ready:
                rank = pending.pop(c)
                try:
                    status, _, data = c.recv()
                except (EOFError, OSError):
                    code = self._procs[rank].exitcode
                    self._kill()
                    raise DistributedError(f"{what}: rank {rank} died (exit code {code})") from None
                if status == "error":
                    self._kill()
                    raise DistributedError(f"{what}: rank {rank} failed:\n{data.decode()}")
                if status == "ok":
                    results[rank] = _loads(data)
        return [results.get(r) for r in range(self.world_size)]
