"""Resuming as a user meets it (issue 20, points 9-11): a damaged checkpoint is named and skipped
for the newest usable one, ``--resume-from DIR``, ``kill -9`` of the launcher (its ranks stop at
once, write nothing more, print nothing; the next ``mimo train`` resumes exactly), and what the
launcher says before step 1.

Each ``mimo train`` here runs 2 ranks (tiny demo config, CPU, fp32): runs are few. Its command line
runs in a subprocess where a test kills it, else in this process (``train_here``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mimo.commands.cli import main
from mimo.training.checkpoint import latest_checkpoint
from mimo.training.metrics import read_metrics
from mimo.training.train import FAULT_ENV, TORCHRUN_ENV

STEPS = 6  # checkpoints at 2, 4, 6


@pytest.fixture(scope="module")
def config(tmp_path_factory, write_demo_config, indexes_here) -> str:
    def edit(cfg):
        cfg["world_size"] = 2
        cfg["modules"]["vision"]["parallel"].update(dp=2, ranks="0:2")
        cfg["modules"]["language"]["parallel"].update(dp=1, ranks="0:2")
        cfg["data"]["tokens_per_microbatch"] = 512
        cfg["train"].update(steps=STEPS, checkpoint={"dir": "unused", "every": 2, "keep": 3})

    with indexes_here():
        return write_demo_config(tmp_path_factory.mktemp("resume_user"), 5, edit)


def _command(config: str, run: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "mimo", "train", config, f"train.checkpoint.dir={run / 'ckpt'}", "--run-dir", str(run), *options]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, *TORCHRUN_ENV)}


@pytest.fixture
def train_here(mimo_here, pools, lend_pools):
    """``train_here(config, run, *options, lent=False) -> (ran, result)``: ``mimo train``
    (``_command``) that succeeded, its command line in this process (``mimo_here``; the ranks are
    fresh processes every run), within the time a subprocess of it had. ``lent``: a run from
    step 0 (the reference), its ranks the session's pool (``lend_pools``, their output captured
    all the same); every run that resumes starts fresh ranks: only the checkpoint carries it on."""

    def run(config: str, run_dir: Path, *options: str, lent: bool = False) -> tuple:
        t0 = time.monotonic()
        with lend_pools(pools) if lent else contextlib.nullcontext():
            proc = mimo_here(*_command(config, run_dir, *options)[3:])  # the words after `python -m mimo`
        assert time.monotonic() - t0 < 240
        lines = proc.stdout.strip().splitlines()
        assert lines and proc.returncode == 0, proc.stderr
        return proc, json.loads(lines[-1])

    return run


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(str(run / "metrics.jsonl"))}


def tensors(run: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """The weights and optimizer states of a checkpoint, by file (its RNG files hold the global
    generators, which nothing seeds or draws from: they differ between any two runs)."""
    folder = run / "ckpt" / f"step-{step:08d}"
    return {name: load_file(folder / name) for name in sorted(os.listdir(folder)) if name.endswith((".model.safetensors", ".dopt.safetensors"))}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name]), name


@dataclass
class Reference:
    run: Path
    stderr: str


@pytest.fixture(scope="module")
def _made() -> dict:
    """What the module makes once: its reference run (``reference``)."""
    return {}


@pytest.fixture
def reference(config, tmp_path_factory, train_here, _made) -> Reference:
    """The uninterrupted run, made once for the module, by the first test that asks for it."""
    if "reference" not in _made:
        run = tmp_path_factory.mktemp("reference") / "run"
        proc, result = train_here(config, run, lent=True)
        assert result["steps_run"] == STEPS
        _made["reference"] = Reference(run, proc.stderr)
    return _made["reference"]


def test_progress_before_step_1(reference):
    said = reference.stderr
    for line in ("indexing data", "data index", "starting 2 ranks (cpu)", "2 ranks up; building the model", "model and data pipeline built",
                 f"training steps 1..{STEPS}"):
        assert line in said, said
    assert said.index("starting 2 ranks") < said.index("building the model") < said.index("training steps")


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is gone
    except OSError:
        return False


def _listing(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")}


_POOL_LAUNCHER = """
import sys, threading, time
from mimo.training.launch import WorkerPool

def tick(path):
    import torch.distributed as dist
    with open(f"{path}.{dist.get_rank()}", "w") as f:
        while True:
            f.write(f"{time.time()!r}\\n")
            f.flush()
            time.sleep(0.01)

if __name__ == "__main__":
    pool = WorkerPool(2, timeout_s=600)
    starting = threading.Thread(target=pool._start)  # a short-lived thread: its ranks must outlive it
    starting.start()
    starting.join()
    print(" ".join(str(p.pid) for p in pool._procs), flush=True)
    pool.run(tick, sys.argv[1])
"""


def test_pool_workers_end_the_moment_their_launcher_dies(tmp_path):
    script, ticks = tmp_path / "launcher.py", tmp_path / "tick"
    script.write_text(_POOL_LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(script), str(ticks)], stdout=subprocess.PIPE, text=True, env=_env())
    ranks = [int(pid) for pid in proc.stdout.readline().split()]
    files = [Path(f"{ticks}.{r}") for r in range(2)]
    deadline = time.monotonic() + 120
    while not all(f.exists() and len(f.read_text().splitlines()) > 20 for f in files):  # working, after their starter thread ended
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    died = time.time()
    t0 = time.monotonic()
    while any(map(_running, ranks)) and time.monotonic() - t0 < 2:
        time.sleep(0.01)
    assert len(ranks) == 2 and not any(map(_running, ranks))
    for f in files:  # not one tick after the launcher's death (a rank polling for it would tick on for a while)
        assert float(f.read_text().splitlines()[-1]) < died + 0.05, f


def test_kill_9_of_the_launcher_stops_every_rank_at_once_then_resumes_exactly(config, reference, tmp_path, train_here):
    run = tmp_path / "run"
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(_command(config, run), stdout=out, stderr=err, env=_env())
        deadline = time.monotonic() + 240
        while max(losses(run), default=0) < 2:  # step 2 reported: its checkpoint is committed
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
            time.sleep(0.02)
        ranks = _descendants(proc.pid)
        proc.kill()
        proc.wait()
        written = _listing(run)
        t0 = time.monotonic()
        while any(map(_running, ranks)) and time.monotonic() - t0 < 2:
            time.sleep(0.01)
    assert len(ranks) >= 2 and not any(map(_running, ranks)), f"still running 2 s after the launcher died: {list(filter(_running, ranks))}"
    time.sleep(0.3)
    assert _listing(run) == written  # no rank wrote anything after the launcher's death
    said = (tmp_path / "out").read_text() + (tmp_path / "err").read_text()
    assert "Traceback" not in said and "BrokenPipe" not in said, said
    last = latest_checkpoint(str(run / "ckpt"))[0]
    assert last < STEPS and max(losses(run)) < STEPS  # it was cut mid-run

    proc, result = train_here(config, run)
    assert result["resumed_from"] == last and result["steps_run"] == STEPS - last
    assert "loading weights, optimizer states and RNG" in proc.stderr
    assert losses(run) == losses(reference.run)  # bit for bit
    assert_same(tensors(run, STEPS), tensors(reference.run, STEPS))


def _cli_error(capture, *argv: str) -> str:
    """``main(argv)``'s error message (exit status 2); ``capture``: capsys or capfd."""
    assert main(list(argv)) == 2
    captured = capture.readouterr()
    assert "Traceback" not in captured.err
    (message,) = json.loads(captured.out.strip().splitlines()[-1])["errors"]
    return message


def test_a_damaged_checkpoint_is_named_and_the_newest_usable_one_taken(config, reference, tmp_path, capfd, train_here):
    run = tmp_path / "run"
    shutil.copytree(reference.run, run)
    damaged = run / "ckpt" / f"step-{STEPS:08d}" / "language-rank00001.model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # cut short, as by a full disk
    lacking = tmp_path / "lacking"
    shutil.copytree(reference.run / "ckpt" / "step-00000004", lacking)
    (lacking / "rng-rank00001.safetensors").unlink()
    train_args = ["train", config, f"train.checkpoint.dir={run / 'ckpt'}"]
    run_dir = ["--run-dir", str(run)]

    # --resume-from a damaged checkpoint: a clear error naming its file, before any process starts
    message = _cli_error(capfd, *train_args, *run_dir, "--resume-from", str(damaged.parent))
    assert message.startswith(f"{damaged}: unreadable, the file is damaged") and "SafetensorError" in message, message
    message = _cli_error(capfd, *train_args, *run_dir, "--resume-from", str(lacking))
    assert message == f"{lacking / 'rng-rank00001.safetensors'}: missing"
    message = _cli_error(capfd, *train_args, *run_dir, "--resume-from", str(tmp_path))
    assert message.startswith(f"{tmp_path}: no complete checkpoint there")

    # without --resume-from: the damaged one is skipped with a warning naming the file
    proc, result = train_here(config, run)
    assert f"checkpoint {damaged.parent} is not usable, skipped: {damaged}: unreadable" in proc.stderr
    assert f"falling back to {run / 'ckpt' / 'step-00000004'} (step 4)" in proc.stderr
    assert result["resumed_from"] == 4 and result["steps_run"] == STEPS - 4 and "Traceback" not in proc.stderr
    assert losses(run) == losses(reference.run)
    assert_same(tensors(run, STEPS), tensors(reference.run, STEPS))  # the damaged step rewritten


def test_resume_from_a_given_checkpoint(config, reference, tmp_path, train_here):
    run = tmp_path / "run"
    proc, result = train_here(config, run, "--resume-from", str(reference.run / "ckpt" / "step-00000004"))
    assert result["resumed_from"] == 4 and result["steps_run"] == STEPS - 4
    assert losses(run) == {s: loss for s, loss in losses(reference.run).items() if s > 4}
    assert_same(tensors(run, STEPS), tensors(reference.run, STEPS))
