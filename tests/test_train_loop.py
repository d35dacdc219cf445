"""`mimo train` end to end (real processes, CPU, fp32): progress and metrics, atomic checkpoints,
exact resume after a kill -9 during a save (synchronous or asynchronous) or a clean stop, colocated and non-colocated,
keep-last-N, a clear error at another layout, and failing / hung ranks ending the run.

Each `mimo train` here spawns its own ranks, so runs are few and short; its command line runs in a
subprocess where a test kills or signals it, else in this process (``train_here``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mimo.training.checkpoint import complete_checkpoints, describe_layout, latest_checkpoint, prune, remove_leftovers
from mimo.compose.config import load_config
from mimo.data.demo import make_demo_data
from mimo.compose.inputs import ensure_index
from mimo.training.train import FAULT_ENV, _short_failure

STEPS = 4
NON_COLOCATED = [  # vision on ranks 0:2 (dp 2), the LLM on ranks 2:4 as two pipeline stages
    "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2", "modules.language.parallel.tp=1",
    "modules.language.parallel.dp=1", "modules.language.parallel.pp=2", "modules.language.parallel.ranks=2:4",
    "modules.language.parallel.sequence_parallel=false",
]
TWO_RANKS = ["world_size=2", "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2",
             "modules.language.parallel.dp=1", "modules.language.parallel.ranks=0:2"]


@pytest.fixture(scope="module")
def config(tmp_path_factory, indexes_here) -> str:
    root = tmp_path_factory.mktemp("train_loop")
    data = root / "data"
    make_demo_data(str(data), train_samples=300, heldout_samples=10, shard_size=150, seed=2)
    with open(Path(__file__).parents[1] / "configs" / "demo.yaml") as f:
        cfg = yaml.safe_load(f)
    cfg["data"].update(shards=str(data / "train-{000000..000001}.tar"), tokenizer=str(data / "tokenizer"), tokens_per_microbatch=512)
    cfg["train"].update(steps=STEPS, checkpoint={"dir": str(root / "unused"), "every": 2, "keep": 2})
    path = root / "train.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with indexes_here():
        ensure_index(load_config(str(path)))
    return str(path)


def _env(fault: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    if fault:
        env[FAULT_ENV] = fault
    return env


def _command(config: str, run: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "mimo", "train", config, f"train.checkpoint.dir={run / 'ckpt'}", *args]


@pytest.fixture
def train_here(mimo_here, pools, lend_pools):
    """``train_here(config, run, *args, fault=None, timeout=280, lent=False) -> (ran, result)``:
    ``mimo train`` (``_command``), its command line in this process (``mimo_here``; the ranks are
    fresh processes every run, with ``fault`` in their environment), within ``timeout`` seconds
    (as a subprocess of it had). ``lent``: its ranks the session's pool (``lend_pools``, their
    output captured all the same), for a run whose ranks' freshness is not what the test checks:
    a run from step 0 (a reference), or one that only has to start and run (its messages and
    files are read, its losses compared with nothing). A run compared with a reference after
    resuming starts fresh ranks, as from a shell: only the checkpoint carries a run on."""

    def run(config: str, run_dir: Path, *args: str, fault: str | None = None, timeout: float = 280, lent: bool = False) -> tuple:
        assert not (lent and fault), "a lent pool's ranks do not see the command's environment"
        t0 = time.monotonic()
        with lend_pools(pools) if lent else contextlib.nullcontext():
            proc = mimo_here(*_command(config, run_dir, *args)[3:], env={FAULT_ENV: fault} if fault else None)  # after `python -m mimo`
        assert time.monotonic() - t0 < timeout
        lines = proc.stdout.strip().splitlines()
        assert lines, proc.stderr
        return proc, json.loads(lines[-1])

    return run


def metrics(run: Path) -> list[dict]:
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def losses(run: Path) -> list[float]:
    return [m["loss"] for m in metrics(run)]


def steps_of(run: Path) -> list[int]:
    return [step for step, _ in complete_checkpoints(str(run / "ckpt"))]


@dataclass
class Reference:
    run: Path
    stdout: str
    result: dict


@pytest.fixture(scope="module")
def _made() -> dict:
    """What the module makes once: its colocated reference run (``colocated``)."""
    return {}


@pytest.fixture
def colocated(config, tmp_path_factory, train_here, _made) -> Reference:
    """The uninterrupted reference of the demo layout (vision dp 4, LLM tp 2 x dp 2 with SP on
    the same 4 ranks), checkpointing every step and keeping the last 2; made once for the module,
    by the first test that asks for it. A run from step 0: its ranks are the session's 4-rank
    pool (``lent``; their output captured as fresh ranks' is); the runs compared with it that
    resume from a checkpoint start fresh ranks."""
    if "colocated" not in _made:
        run = tmp_path_factory.mktemp("colocated") / "run"
        proc, result = train_here(config, run, "train.checkpoint.every=1", lent=True)
        assert proc.returncode == 0, proc.stderr
        _made["colocated"] = Reference(run, proc.stdout, result)
    return _made["colocated"]


def test_progress_metrics_run_directory_and_keep_last_n(colocated):
    run, result = colocated.run, colocated.result
    assert result["ok"] and result["steps"] == STEPS and result["run_dir"] == str(run)
    progress = [line for line in colocated.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == [f"{s}/{STEPS}" for s in range(1, STEPS + 1)]  # once per step: one rank
    assert all(k in progress[-1] for k in ("loss", "tok/s", "samples/s", "ETA", "skipped"))
    recs = metrics(run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["samples_per_s"] > 0
        assert set(r["lr"]) == {"vision", "language"} and min(r["lr"].values()) > 0
        for kind in ("forward", "backward", "optimizer"):
            assert set(r["time_s"][kind]) == {"vision", "language"}
        assert r["time_s"]["forward"]["language"] > 0 and r["time_s"]["backward"]["language"] > 0
        assert "read failure" in r["skipped"]
    assert result["final_loss"] == recs[-1]["loss"]
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert steps_of(run) == [STEPS - 1, STEPS]  # every step saved, the last 2 kept
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == STEPS
    assert sorted(os.listdir(run / "logs")) == [f"rank{r}.log" for r in range(4)]


def test_kill_during_save_then_resume_is_exact(config, colocated, tmp_path, train_here):
    run = tmp_path / "run"
    ckpt = run / "ckpt"
    saving = ckpt / f"step-{STEPS:08d}.tmp"
    with open(tmp_path / "out", "w") as out:
        # rank 1 stalls after writing its files of the step-4 checkpoint: kill -9 lands mid-save
        proc = subprocess.Popen(_command(config, run), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=_env(f"stall-save:1:{STEPS}"))
        deadline = time.monotonic() + 240
        try:
            while not (saving / "rng-rank00001.safetensors").exists():
                assert proc.poll() is None, (tmp_path / "out").read_text()
                assert time.monotonic() < deadline, "the save of the last step never started"
                time.sleep(0.1)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank
            proc.wait()
    assert steps_of(run) == [2] and saving.is_dir()  # the previous checkpoint is complete; the cut one is not
    proc, result = train_here(config, run)
    assert proc.returncode == 0, proc.stderr
    assert result["resumed_from"] == 2 and result["steps_run"] == STEPS - 2
    assert losses(run) == losses(colocated.run)  # bit for bit
    assert steps_of(run) == [2, STEPS] and not saving.exists()


def test_kill_during_async_save_then_resume_is_exact(config, colocated, tmp_path, train_here):
    run = tmp_path / "run"
    ckpt = run / "ckpt"
    saving = ckpt / "step-00000003.tmp"
    args = ("train.checkpoint.every=1", "train.checkpoint.async_save=true")
    with open(tmp_path / "out", "w") as out:
        # rank 1's background writer stalls after writing its files of step 3, before its done
        # mark: step 3 cannot commit, training goes on (step 3 reported) until step 4's save waits
        proc = subprocess.Popen(_command(config, run, *args), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=_env("stall-save:1:3"))
        deadline = time.monotonic() + 240
        try:
            while not ((saving / "rng-rank00001.safetensors").exists() and (run / "metrics.jsonl").exists()
                       and '{"step": 3,' in (run / "metrics.jsonl").read_text()):
                assert proc.poll() is None, (tmp_path / "out").read_text()
                assert time.monotonic() < deadline, "the save of step 3 never started"
                time.sleep(0.1)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank, mid-write
            proc.wait()
    assert steps_of(run) == [1, 2] and saving.is_dir() and not (saving / "meta.json").exists()
    assert not (saving / "done-rank00001").exists()
    proc, result = train_here(config, run, *args)
    assert proc.returncode == 0, proc.stderr
    assert result["resumed_from"] == 2 and result["steps_run"] == STEPS - 2
    assert losses(run) == losses(colocated.run)  # bit for bit
    assert steps_of(run) == [STEPS - 1, STEPS] and not saving.exists() and result["checkpoint"] == str(ckpt / f"step-{STEPS:08d}")
    assert "written in the background" in (run / "logs" / "rank0.log").read_text()


def test_clean_stop_then_resume_is_exact_non_colocated(config, tmp_path, train_here):
    reference, run = tmp_path / "reference", tmp_path / "run"
    proc, _ = train_here(config, reference, *NON_COLOCATED, lent=True)  # the uninterrupted run: the stopped and resumed ones are fresh
    assert proc.returncode == 0, proc.stderr
    proc, result = train_here(config, run, *NON_COLOCATED, "--stop-at", "3")
    assert proc.returncode == 0, proc.stderr
    assert result["stopped"] and result["steps"] == 3 and steps_of(run) == [2, 3]
    proc, result = train_here(config, run, *NON_COLOCATED)
    assert proc.returncode == 0, proc.stderr
    assert result["resumed_from"] == 3 and not result["stopped"]
    assert losses(run) == losses(reference)
    assert [m["step"] for m in metrics(run)] == list(range(1, STEPS + 1))


def test_another_layout_is_resharded_with_a_warning(config, colocated, tmp_path, train_here):
    run = tmp_path / "run"
    shutil.copytree(colocated.run, run)
    # (its messages and result are what is read, no loss compared: its ranks may be the session's)
    proc, result = train_here(config, run, "modules.language.parallel.tp=1", "modules.language.parallel.dp=4",
                              f"train.steps={STEPS + 1}", timeout=120, lent=True)
    assert proc.returncode == 0 and result["ok"], proc.stderr[-3000:]
    assert "checkpoint written at layout [world_size=4; vision tp=1,dp=4,ranks=0:4; language tp=2,dp=2,ranks=0:4]" in proc.stderr
    assert ("the config asks for [world_size=4; vision tp=1,dp=4,ranks=0:4; language tp=1,dp=4,ranks=0:4]: resharding it on load"
            in proc.stderr)
    assert result["resumed_from"] == STEPS and result["steps_run"] == 1 and "Traceback" not in proc.stderr
    # (the layout keys are not "a config that differs": only train.steps is named)
    (differs,) = [line for line in proc.stderr.splitlines() if "with a config that differs at" in line]
    assert "differs at train.steps:" in differs and "parallel" not in differs, differs


def test_sigterm_stops_cleanly_with_a_checkpoint(config, tmp_path):
    run = tmp_path / "run"
    with open(tmp_path / "out", "w") as out:
        proc = subprocess.Popen(_command(config, run, *TWO_RANKS, "train.steps=40"), stdout=out, stderr=subprocess.PIPE,
                                text=True, env=_env())
        deadline = time.monotonic() + 240
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    result = json.loads((tmp_path / "out").read_text().strip().splitlines()[-1])
    assert proc.returncode == 0 and result["stopped"], err
    stopped_at = result["steps"]
    assert stopped_at < 40 and latest_checkpoint(str(run / "ckpt"))[0] == stopped_at
    assert [m["step"] for m in metrics(run)] == list(range(1, stopped_at + 1))


def test_failing_rank_ends_the_run_with_its_message(config, tmp_path, train_here):
    t0 = time.monotonic()
    proc, result = train_here(config, tmp_path / "run", *TWO_RANKS, fault="raise:1:2")
    assert proc.returncode == 2 and not result["ok"]
    (message,) = result["errors"]
    assert message.startswith("rank 1 failed: RuntimeError: injected failure") and "at step 2" in message
    assert time.monotonic() - t0 < 200


def test_hung_rank_ends_the_run_within_the_timeout(config, tmp_path, train_here):
    t0 = time.monotonic()
    proc, result = train_here(config, tmp_path / "run", *TWO_RANKS, "--timeout", "5", fault="hang:1:2")
    assert proc.returncode == 2 and not result["ok"]
    (message,) = result["errors"]
    assert "rank 0 failed: DistributedError: rank 0, step 2: a collective did not complete within 5 s" in message, message
    assert time.monotonic() - t0 < 200


# ---------------------------------------------------------------- without processes


def test_incomplete_checkpoints_are_never_loaded_and_pruning(tmp_path):
    def make(name: str, meta: bool):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.safetensors").write_text("")
        if meta:
            (tmp_path / name / "meta.json").write_text('{"format": 2}')  # usable: prune counts it toward keep

    make("step-00000002", True)
    make("step-00000003", True)
    make("step-00000004.tmp", True)  # a save cut short after meta.json, before the rename
    make("step-00000005", False)  # not a checkpoint (no meta.json)
    make("step-00000006.old", True)  # a prune cut short
    assert latest_checkpoint(str(tmp_path)) == (3, str(tmp_path / "step-00000003"))
    assert sorted(os.path.basename(p) for p in remove_leftovers(str(tmp_path))) == ["step-00000004.tmp", "step-00000006.old"]
    assert [os.path.basename(p) for p in prune(str(tmp_path), keep=1)] == ["step-00000002"]
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000005"]
    assert latest_checkpoint(str(tmp_path / "missing")) is None


def test_layout_description_and_short_failures():
    layout = {"world_size": 6, "modules": {"vision": {"ranks": "0:2", "tp": 1, "cp": 1, "dp": 2, "pp": 1, "ep": 1, "etp": 1},
                                           "language": {"ranks": "2:6", "tp": 2, "cp": 1, "dp": 1, "pp": 2, "ep": 1, "etp": 2}}}
    assert describe_layout(layout) == "[world_size=6; vision tp=1,dp=2,ranks=0:2; language tp=2,pp=2,ranks=2:6]"
    trace = "train_rank: rank 3 failed:\nTraceback (most recent call last):\n  File x\nmimo.errors.CheckpointError: bad\n"
    assert _short_failure(trace, "/r") == "rank 3 failed: CheckpointError: bad (traceback in /r/logs/rank3.log)"
    assert _short_failure("train_rank: rank 1 died (exit code -9)", "/r") == "train_rank: rank 1 died (exit code -9)"
