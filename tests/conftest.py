"""Shared fixtures: ``pools(N)`` gives an N-rank gloo worker pool, started once per test module,
or once per session for the common sizes (``SHARED_SIZES``; ``session_pools(N)``: once per
session at every size, for the modules that share all theirs);
``write_demo_config`` writes the demo config over fresh demo shards (``write_native_example`` a
native-resolution example config over their native split), ``write_moe_configs``
tests/configs/moe_{tp,pp}.yaml over them; ``with indexes_here():`` builds their data indexes in
this process; ``mimo_here(*argv)`` runs a ``mimo`` command line in this process, and
``with lend_pools(pools):`` has the commands in it run their ranks on the test's worker pools
instead of fresh processes (for runs whose ranks' freshness is not what is checked). Helper modules
of this folder (``test_hf_llava``'s tiny LLaVAs, ``sequence_mixer_checks``) import by name: under
``--import-mode=importlib`` the folder is put on ``sys.path`` here (worker pools' processes
inherit it)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass

import pytest
import yaml

from mimo.training.launch import WorkerPool

sys.path.insert(0, os.path.dirname(__file__))


def _started_pools():
    """``get(N)`` starting each N-rank pool on first use, and a closer of all of them."""
    started: dict[int, WorkerPool] = {}

    def get(world_size: int, timeout_s: float = 120.0) -> WorkerPool:
        pool = started.get(world_size)
        if pool is None:
            pool = started[world_size] = WorkerPool(world_size, timeout_s=timeout_s)
        return pool

    def close() -> None:
        for pool in started.values():
            pool.close()

    get.started = started  # the pools started so far, by size
    return get, close


RECYCLE_THREADS = 256  # a shared pool whose rank holds more threads than this is restarted


def _threads(pool: WorkerPool) -> int:
    """The most threads a rank of ``pool`` holds (0 where /proc does not tell): the process
    groups that cases create stay for the life of the process, with their threads and sockets."""
    most = 0
    for p in pool._procs:
        try:
            most = max(most, len(os.listdir(f"/proc/{p.pid}/task")))
        except OSError:
            pass
    return most


SHARED_SIZES = (1, 2, 4)  # the pool sizes most modules use: started once for the session


@pytest.fixture(scope="module")
def pools(session_pools):
    """``pools(N)``: an N-rank pool for this module's cases. The sizes most modules use
    (``SHARED_SIZES``) are the session's (``session_pools``: their processes started once, not
    once per module, each rank importing torch and mimo); other sizes are started for the module
    and closed after it (a few such idle pools of 6 or 8 ranks would hold memory all session).
    After the module, a shared pool whose ranks hold many threads (the process groups cases
    made) is closed, to start afresh for the next module that takes it."""
    get, close = _started_pools()

    def pick(world_size: int, timeout_s: float = 120.0) -> WorkerPool:
        return (session_pools if world_size in SHARED_SIZES else get)(world_size, timeout_s)

    yield pick
    close()
    for pool in session_pools.started.values():  # restarted on next use: a bound on what they keep
        if _threads(pool) > RECYCLE_THREADS:
            pool.close()


@pytest.fixture(scope="session")
def session_pools():
    """``session_pools(N)``: as ``pools(N)``, but each N-rank pool is started once for the whole
    session, for the modules that take their pools from it (``def pools(session_pools)``): their
    cases run in the same processes one after another, as one module's cases do in ``pools``."""
    get, close = _started_pools()
    yield get
    close()


@pytest.fixture(scope="session")
def write_demo_config():
    """``write(root, seed, edit=None)``: configs/demo.yaml over 400 fresh demo samples in two
    shards under ``root``, 1024-token microbatches, its index prepared; ``edit(cfg)`` may change
    the config dict first. Returns the config's path."""
    from mimo.compose.config import load_config
    from mimo.data.demo import make_demo_data
    from mimo.compose.inputs import ensure_index

    def write(root, seed: int, edit=None) -> str:
        data = root / "data"
        make_demo_data(str(data), train_samples=400, heldout_samples=20, shard_size=200, seed=seed)
        with open(os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")) as f:
            cfg = yaml.safe_load(f)
        cfg["data"].update(shards=str(data / "train-{000000..000001}.tar"), tokenizer=str(data / "tokenizer"), tokens_per_microbatch=1024)
        cfg["train"]["checkpoint"]["dir"] = str(root / "ckpt")
        if "eval" in cfg:  # the held-out split written beside the train shards
            cfg["eval"]["shards"] = str(data / "heldout-{000000..000000}.tar")
        if edit is not None:
            edit(cfg)
        path = root / "demo.yaml"
        path.write_text(yaml.safe_dump(cfg))
        ensure_index(load_config(str(path)))
        return str(path)

    return write


@contextlib.contextmanager
def _indexes_here():
    """Within it, data indexes (``ensure_index``) are built in this process, by one reader:
    at ``data.workers`` >= 2 the builder starts a pool of fresh processes for it (seconds each
    on a busy machine) where the shards are more than ``SMALL_SHARDS_BYTES`` in all
    (``mimo.compose.inputs``; smaller ones it builds in this process itself). The index is the
    same file either way (nothing in it depends on the readers); only its building is moved."""
    from mimo.data import index

    build = index.build_index

    def one_reader(pattern, spec, workers=2, *args, **kwargs):
        return build(pattern, spec, 1, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(index, "build_index", one_reader)
        yield


@pytest.fixture(scope="session")
def indexes_here():
    """``with indexes_here(): ...``: ``_indexes_here`` (e.g. around ``write_demo_config``)."""
    return _indexes_here


def _write_native_example(example, root, seed: int, native_samples: int, shards: int = 1, **data) -> str:
    """The config ``example`` over fresh demo data under ``root`` (its native split:
    ``native_samples`` samples in ``shards`` shards of 80), ``data``'s keys set (e.g.
    ``tokens_per_microbatch``), checkpoints under ``root``, its index built here. Returns the path."""
    from pathlib import Path

    from mimo.compose.config import load_config
    from mimo.compose.inputs import ensure_index
    from mimo.data.demo import make_demo_data

    make_demo_data(str(root / "data"), train_samples=4, heldout_samples=1, shard_size=80, seed=seed,
                   native_samples=native_samples)
    cfg = yaml.safe_load(Path(example).read_text())
    cfg["data"].update(shards=str(root / "data" / f"native-{{000000..{shards - 1:06d}}}.tar"),
                       tokenizer=str(root / "data" / "tokenizer"), **data)
    cfg["train"]["checkpoint"]["dir"] = str(root / "ckpt")
    path = root / Path(example).name
    path.write_text(yaml.safe_dump(cfg))
    with _indexes_here():
        ensure_index(load_config(str(path)))
    return str(path)


@pytest.fixture(scope="session")
def write_native_example():
    """``write(example, root, seed, native_samples, shards=1, **data) -> config path``
    (``_write_native_example``: a native-resolution example config over fresh demo data)."""
    return _write_native_example


@dataclass
class Ran:
    """What a ``mimo`` command line left: its exit status, and its (and its ranks') output."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def mimo_here(capfd):
    """``mimo_here(*argv, env=None) -> Ran``: ``mimo ARGV`` as from a shell, but its command line
    run in this process (``main``), which saves starting an interpreter and importing torch for
    each command; the ranks it starts are fresh processes every command, as always. As in a
    fresh interpreter: outside torchrun's environment and the fault hook (``env``: variables set
    for the command and its ranks), no handler on the root logger (a warning of a logger without
    one reaches stderr through Python's last resort, not pytest's log capture). Its output and
    its ranks' are captured at the file descriptors (capfd)."""
    from mimo.commands.cli import main
    from mimo.training.train import FAULT_ENV, TORCHRUN_ENV

    def run(*argv: str, env: dict[str, str] | None = None) -> Ran:
        with pytest.MonkeyPatch.context() as patch:
            for name in (FAULT_ENV, *TORCHRUN_ENV):
                patch.delenv(name, raising=False)
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            patch.setattr(logging.getLogger(), "handlers", [])
            capfd.readouterr()
            code = main(list(argv))
            out, err = capfd.readouterr()
        return Ran(code, out, err)

    return run


def _lent_rank(out_dir: str, cwd: str, ref, args: tuple, kwargs: dict):
    """Rank function of a lent pool (``lend_pools``): a command's rank function (``ref``, as
    ``WorkerPool`` sends it), this rank's output (fds 1 and 2) going to ``out_dir``'s files
    meanwhile, run in the caller's working directory ``cwd`` (as a fresh rank starts in it: relative
    paths of a config), and what the function changes for the rest of its process (the working
    directory, the default timeout of the groups it creates, the ``mimo`` logger's level) set back
    after it."""
    import logging

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from mimo.training.launch import _resolve

    timeouts = {n: getattr(c10d, n) for n in ("default_pg_timeout", "default_pg_nccl_timeout") if hasattr(c10d, n)}
    level = logging.getLogger("mimo").level
    rank = dist.get_rank()
    here = os.getcwd()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(os.path.join(out_dir, f"{rank}.out"), "wb") as out, open(os.path.join(out_dir, f"{rank}.err"), "wb") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                os.chdir(cwd)
                return _resolve(ref, {})(*args, **kwargs)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.chdir(here)
        os.close(saved[0])
        os.close(saved[1])
        for name, value in timeouts.items():
            setattr(c10d, name, value)
        logging.getLogger("mimo").setLevel(level)


class _LentPool:
    """What a command started within ``lend_pools`` gets for its ``WorkerPool``: the test's pool of
    that size, its processes up already (torch and mimo imported), left open at the command's end.
    Its ranks' output reaches this process's stdout and stderr (so ``capfd`` and ``mimo_here``
    see it, as a fresh rank's), each rank's after the case, in rank order."""

    def __init__(self, pool: WorkerPool, timeout_s: float):
        self.pool, self.world_size, self.timeout_s, self.device = pool, pool.world_size, timeout_s, "cpu"

    def __enter__(self) -> "_LentPool":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass

    def run(self, fn, *args, timeout_s: float | None = None, **kwargs):
        import tempfile

        from mimo.training.launch import _fn_ref

        with tempfile.TemporaryDirectory(prefix="mimo-lent-") as out_dir:
            try:
                return self.pool.run(_lent_rank, out_dir, os.getcwd(), _fn_ref(fn), args, kwargs,
                                     timeout_s=self.timeout_s if timeout_s is None else timeout_s)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                for stream, fd in (("out", 1), ("err", 2)):
                    for rank in range(self.world_size):
                        path = os.path.join(out_dir, f"{rank}.{stream}")
                        if os.path.exists(path):
                            with open(path, "rb") as f:
                                os.write(fd, f.read())


@pytest.fixture(scope="session")
def lend_pools():
    """``with lend_pools(pools): mimo_here(...)``: a command run within it (``mimo train``,
    ``convert-checkpoint``, ``verify-bridge``: whatever starts a ``WorkerPool``, CPU) runs its
    ranks on ``pools(N)``, the test's processes, instead of N fresh ones (each importing torch,
    mimo and transformers: seconds a rank on a busy machine); their output is captured as a fresh
    rank's (``_LentPool``). For a run whose ranks' freshness is not what the test checks (an
    uninterrupted reference, a conversion): a run that must carry on from a checkpoint alone, or
    that takes ``env`` (the pool's ranks do not see it), stays outside it."""
    from mimo.training import launch

    @contextlib.contextmanager
    def lend(pools):
        def borrowed(world_size: int, timeout_s: float = 120.0, start_timeout_s: float = 120.0,
                     collective_timeout_s: float | None = None, device: str = "cpu") -> _LentPool:
            assert device == "cpu", device
            return _LentPool(pools(world_size), min(timeout_s, 280.0))

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(launch, "WorkerPool", borrowed)
            yield

    return lend


@pytest.fixture(scope="session")
def write_moe_configs():
    """``write(root, train_samples, seed, names=("moe_tp", "moe_pp"))``: those tests/configs/*.yaml
    over fresh demo shards (two) under ``root``, their index prepared: {name: path}."""
    from mimo.compose.config import load_config
    from mimo.compose.inputs import ensure_index
    from mimo.data.demo import make_demo_data

    def write(root, train_samples: int, seed: int, names=("moe_tp", "moe_pp")) -> dict[str, str]:
        data = root / "data"
        make_demo_data(str(data), train_samples=train_samples, heldout_samples=4, shard_size=train_samples // 2, seed=seed)
        out = {}
        for name in names:
            with open(os.path.join(os.path.dirname(__file__), "configs", f"{name}.yaml")) as f:
                cfg = yaml.safe_load(f)
            cfg["data"].update(shards=str(data / "train-{000000..000001}.tar"), tokenizer=str(data / "tokenizer"))
            cfg["train"]["checkpoint"]["dir"] = str(root / name / "ckpt")
            path = root / f"{name}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            ensure_index(load_config(str(path)))
            out[name] = str(path)
        return out

    return write


def _resume_case(config_path: str, overrides: list[str], root: str, other: list[str] | None = None) -> dict:
    """Rank function: 4 training steps straight through, and 2 steps, a checkpoint, a fresh run
    loading it (weights, optimizer states, balancing buffers, RNG), 2 more steps; both save step
    4 (``root/straight``, ``root/cut``). ``other``: overrides of a run that then tries to load
    the step-2 checkpoint (its error message, or "")."""
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.training.checkpoint import load_checkpoint, save_checkpoint
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    config = load_config(config_path, overrides)

    def steps(run, numbers):
        return [train_step(run.model, run.pipeline, s, run.optimizers, run.policy).loss for s in numbers]

    whole = build_run(config, dist.get_rank())
    straight = steps(whole, range(1, 5))
    save_checkpoint(whole.model, whole.optimizers, 4, os.path.join(root, "straight"))
    first = build_run(config, dist.get_rank())
    head = steps(first, range(1, 3))
    path = save_checkpoint(first.model, first.optimizers, 2, os.path.join(root, "cut"))
    resumed = build_run(config, dist.get_rank())
    load_checkpoint(resumed.model, path, resumed.optimizers)
    tail = steps(resumed, range(3, 5))
    save_checkpoint(resumed.model, resumed.optimizers, 4, os.path.join(root, "cut"))
    runs, refused = [whole, first, resumed], ""
    if other is not None:
        runs.append(build_run(load_config(config_path, other), dist.get_rank()))
        try:
            load_checkpoint(runs[-1].model, path, runs[-1].optimizers)
        except Exception as e:
            refused = str(e)
    for run in runs:
        run.pipeline.close()
    return {"straight": straight, "resumed": head + tail, "refused": refused}


@pytest.fixture(scope="session")
def resume_case():
    """The rank function ``_resume_case`` (for a worker pool)."""
    return _resume_case


def _verify_layout(pools, config: str, overrides: list[str], steps: int, world: int = 4, tol: float = 1e-5) -> dict:
    """``mimo verify-train``'s report for ``overrides`` of ``config`` on a ``world``-rank pool
    against the one-process run (of the overrides that are not about the layout)."""
    from mimo.commands.verify_train import compare, references, train_case

    layout = pools(world).run(train_case, config, overrides, steps, False)
    model = [o for o in overrides if "parallel" not in o and not o.startswith("world_size")]
    ref32, ref64 = references(pools(1), config, model, steps)
    return compare(layout, ref32, tol, fp64=ref64)


@pytest.fixture(scope="session")
def verify_layout():
    """``verify(pools, config, overrides, steps, world=4, tol=1e-5) -> report`` (``_verify_layout``)."""
    return _verify_layout


def _misfits_named(tmp_path, good: dict, config: dict, arch, cases: dict) -> None:
    """Each ``cases[what](state)`` edit of the Hugging Face state ``good`` (saved with ``config``)
    fails loading into an ``LLMStage(arch)`` with a MimoError naming ``what``."""
    from mimo.core.errors import MimoError
    from mimo.llm.hf import load_hf_checkpoint, save_hf_checkpoint
    from mimo.llm.model import LLMStage

    for i, (what, edit) in enumerate(cases.items()):
        state = dict(good)
        edit(state)
        save_hf_checkpoint(str(tmp_path / str(i)), state, config)
        with pytest.raises(MimoError, match=what.replace(".", r"\.")):
            load_hf_checkpoint(LLMStage(arch), str(tmp_path / str(i)))


@pytest.fixture(scope="session")
def misfits_named():
    """``check(tmp_path, good_state, config, arch, cases)``: every edited checkpoint a named error (``_misfits_named``)."""
    return _misfits_named
