"""`mimo demo` end to end in a fast mode (2 steps, a few held-out samples), its resume, and the
LLaVA stage-1 -> stage-2 config pair (stage 2 starts from stage 1's weights via train.init_from).
Each command runs as from a shell in its folder, its command line in this process (``mimo_here``:
no interpreter to start, torch imported once). A command that loads what an earlier one trained
spawns its own ranks, fresh processes, so that only the checkpoint carries the run on; one that
does not (`mimo demo` from nothing and its evaluations, stage 1) runs them on the session's pool
(``lend_pools``: their output captured as fresh ranks' is).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mimo.data.demo import demo_data_ready, make_demo_data

ROOT = Path(__file__).resolve().parents[1]
FAST = ["train.steps=2", "train.checkpoint.every=1", "data.tokens_per_microbatch=1024", "eval.samples=8", "eval.max_new_tokens=4"]


@pytest.fixture
def mimo(mimo_here, monkeypatch, pools, lend_pools):
    """``mimo(*args, cwd, lent=False) -> Ran``: ``mimo ARGS`` run from ``cwd`` (``mimo_here``), within
    the 280 s a subprocess of it had; ``lent``: its ranks the session's pool (``lend_pools``)."""

    def run(*args: str, cwd: Path, lent: bool = False):
        monkeypatch.chdir(cwd)
        t0 = time.monotonic()
        with lend_pools(pools) if lent else contextlib.nullcontext():
            ran = mimo_here(*args)
        assert time.monotonic() - t0 < 280, args
        return ran

    return run


def last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_demo_runs_end_to_end_then_resumes(tmp_path, mimo):
    # the default config: configs/demo.yaml of the source tree; from nothing (its training, its evaluation: lent ranks)
    first = mimo("demo", "--log-every", "1", *FAST, cwd=tmp_path, lent=True)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    assert "demo data: writing demo-data/" in out and demo_data_ready(str(tmp_path / "demo-data"))
    assert "step 1/2 | loss" in out and "step 2/2 | loss" in out
    assert "held-out: loss" in out and "run directory:" in out
    result = last_json(first)
    run_dir = Path(result["run_dir"])
    assert result["ok"] and result["command"] == "demo" and result["steps"] == 2
    assert run_dir == tmp_path / "runs" / "demo" and (run_dir / "metrics.jsonl").is_file()
    assert result["first_loss"] > 0 and result["final_loss"] > 0
    ev = result["eval"]
    assert ev["checkpoint_step"] == 2 and ev["samples"] == 8 and 0.0 <= ev["exact_match"] <= 1.0
    assert ev["scored"] + ev["captions"] + ev["read_failures"] == 8
    # again: the data is kept, training is already complete (resumed at step 2), the eval runs again
    again = mimo("demo", *FAST, cwd=tmp_path, lent=True)  # (no rank trains: only the evaluation's start)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "demo data: demo-data/ (present)" in again.stdout and "resumed from step 2; ran 0 more steps" in again.stdout
    second = last_json(again)
    assert second["resumed_from"] == 2 and second["eval"] == ev


def test_fresh_refuses_a_folder_that_is_not_a_run(tmp_path, mimo):
    make_demo_data(str(tmp_path / "demo-data"))
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "precious.txt").write_text("keep me")
    proc = mimo("demo", "--fresh", *FAST, cwd=tmp_path)
    assert proc.returncode == 2 and "not a mimo run directory" in last_json(proc)["errors"][0]
    assert (tmp_path / "runs" / "demo" / "precious.txt").is_file()


TWO_RANKS = ["world_size=2", "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2",
             "modules.language.parallel.dp=1", "modules.language.parallel.ranks=0:2", "data.tokens_per_microbatch=1024"]


def shard(run: Path, step: int, name: str) -> dict:
    return load_file(str(run / f"step-{step:08d}" / name))


def test_llava_stage2_starts_from_stage1_weights(tmp_path, mimo):
    make_demo_data(str(tmp_path / "demo-data"), train_samples=200, heldout_samples=20, shard_size=25, seed=4)
    stage1, stage2 = (str(ROOT / "configs" / "examples" / f"llava-stage{i}.yaml") for i in (1, 2))
    one = mimo("train", stage1, *TWO_RANKS, "train.steps=2", cwd=tmp_path, lent=True)  # from nothing: lent ranks
    assert one.returncode == 0, one.stderr[-3000:]
    # stage 2 with another seed: only init_from can make its frozen tower equal stage 1's
    two = mimo("train", stage2, *TWO_RANKS, "train.steps=1", "train.seed=7", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert re.search(r"loading weights \(\S*llava-stage1/ckpt/step-00000002, train\.init_from\)", two.stderr), two.stderr[-3000:]
    s1, s2 = tmp_path / "runs" / "llava-stage1" / "ckpt", tmp_path / "runs" / "llava-stage2" / "ckpt"
    # the tower is data-parallel: rank 0 owns (and writes) all of it
    tower1, tower2 = shard(s1, 2, "vision-rank00000.model.safetensors"), shard(s2, 1, "vision-rank00000.model.safetensors")
    tower_keys = [k for k in tower1 if not k.startswith("projector.")]
    assert tower_keys and all((tower1[k] == tower2[k]).all() for k in tower_keys)
    # stage 1 trained only the projector: its LLM shards are still the initial ones, its optimizer
    # state covers the projector alone
    assert os.path.exists(s1 / "step-00000002" / "language-rank00000.model.safetensors")
    assert not os.path.exists(s1 / "step-00000002" / "language-rank00000.optim.safetensors")
    # at another layout (the LLM dp 2 instead of tp 2), stage 2 starts from stage 1's weights resharded
    other = tmp_path / "other"
    moved = mimo("train", stage2, *TWO_RANKS, "train.steps=1", "train.seed=7", "modules.language.parallel.tp=1",
                 "modules.language.parallel.dp=2", "modules.language.parallel.sequence_parallel=false",
                 f"train.checkpoint.dir={other}", cwd=tmp_path)
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert "resharding it on load" in moved.stderr
    tower3 = shard(other, 1, "vision-rank00000.model.safetensors")
    assert all((tower1[k] == tower3[k]).all() for k in tower_keys)


def test_init_from_nothing_is_a_clear_error(tmp_path, mimo):
    make_demo_data(str(tmp_path / "demo-data"), train_samples=200, heldout_samples=20, shard_size=25, seed=4)
    stage2 = str(ROOT / "configs" / "examples" / "llava-stage2.yaml")
    proc = mimo("train", stage2, *TWO_RANKS, f"train.init_from={tmp_path / 'none'}", cwd=tmp_path)
    assert proc.returncode == 2 and "no complete checkpoint" in last_json(proc)["errors"][0]
