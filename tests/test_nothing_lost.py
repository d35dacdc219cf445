"""Nothing lost silently (issue 53): data a run drops is counted where the user looks and stops
the run past ``data.max_skipped_fraction``; a non-finite step stops the run without a checkpoint
of it (or is skipped, ``train.on_nonfinite: skip_step``); output stays strict JSON; a closed
stdout (``| head -1``) ends the run as Ctrl-C does.

``mimo train`` runs here are subprocesses on 2 ranks (the tiny demo config, CPU, fp32); the
data checks stop before any rank starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mimo.compose.config import load_config
from mimo.compose.inputs import data_plan, ensure_index
from mimo.data.demo import make_demo_data
from mimo.data.index import LOST
from mimo.data.skipped import SkipReport
from mimo.training.metrics import read_metrics
from mimo.training.train import FAULT_ENV, SKIPPED_FILE, TORCHRUN_ENV


def _strict(text: str):
    """json.loads that refuses NaN / Infinity, as jq and JavaScript do."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def config(tmp_path, write_demo_config):
    """The demo config at 2 ranks over 4 shards of 100 samples (index not built)."""
    def edit(cfg):
        cfg["world_size"] = 2
        cfg["modules"]["vision"]["parallel"].update(dp=2, ranks="0:2")
        cfg["modules"]["language"]["parallel"].update(dp=1, ranks="0:2")
        cfg["data"].update(tokens_per_microbatch=512)
        cfg["train"].update(steps=3, micro_batches=1, checkpoint={"dir": str(tmp_path / "run" / "ckpt"), "every": 1, "keep": 2})
        cfg.pop("eval", None)

    path = Path(write_demo_config(tmp_path, 3, edit))
    data = tmp_path / "data4"
    make_demo_data(str(data), train_samples=400, heldout_samples=4, shard_size=100, seed=3)
    text = path.read_text().replace(str(tmp_path / "data" / "train-{000000..000001}.tar"), str(data / "train-{000000..000003}.tar"))
    path.write_text(text)
    return path


def _truncate(shard: Path, share: float) -> None:
    with open(shard, "r+b") as f:
        f.truncate(int(os.path.getsize(shard) * share))


def _corrupt_images(shard: Path, count: int) -> None:
    """Overwrite the first pixel data of ``count`` PNGs (sizes unchanged): corrupt images."""
    data = bytearray(shard.read_bytes())
    for m in list(re.finditer(rb"IDAT", data))[:count]:
        data[m.start() + 8: m.start() + 40] = b"\0" * 32
    shard.write_bytes(bytes(data))


def _train(config: Path, *args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, *TORCHRUN_ENV)}
    run = config.parent / "run"
    cmd = [sys.executable, "-m", "mimo", "train", str(config), "--run-dir", str(run), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**clean, **(env or {})})


def test_two_damaged_shards_stop_the_run_before_step_1_naming_them(config):
    data = config.parent / "data4"
    _truncate(data / "train-000001.tar", 0.4)
    _corrupt_images(data / "train-000002.tar", 50)
    proc = _train(config)
    assert proc.returncode == 2, proc.stderr
    result = _strict(proc.stdout.strip().splitlines()[-1])
    error = result["errors"][0]
    assert "more than data.max_skipped_fraction=0.01" in error and str(data / "train-000001.tar") in error, error
    corrupt, lost = (int(re.search(rf"{kind} (\d+)", error).group(1)) for kind in ("corrupt image", LOST))
    assert 30 <= corrupt <= 50 and 50 <= lost <= 70, error  # 50 images hit (a few survive), 60% of a shard cut off
    # the launcher listed the reasons with their first samples, and the damaged shard by name
    assert f"corrupt image: {corrupt} sample(s), e.g. {data / 'train-000002.tar'}:" in proc.stderr, proc.stderr
    assert f"damaged shard {data / 'train-000001.tar'}: truncated tar: no end-of-archive marker; about {lost} sample(s) lost" \
        in proc.stderr
    assert "training steps" not in proc.stderr  # no rank trained
    listed = [json.loads(line) for line in open(config.parent / "run" / SKIPPED_FILE)]
    assert sum(r["reason"].startswith("corrupt image") for r in listed) == corrupt
    assert [r["lost_estimate"] for r in listed if r["key"] is None] == [lost]

    # allowed to drop that much: it trains, and metrics.jsonl carries the counts
    proc = _train(config, "data.max_skipped_fraction=0.5", "--stop-at", "1")
    assert proc.returncode == 0, proc.stderr
    rec = _strict((config.parent / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["skipped"]["corrupt image"] == corrupt and rec["skipped"][LOST] == lost, rec["skipped"]
    assert "will not be trained on" in proc.stderr


def test_a_shard_truncated_after_indexing_is_named_with_what_it_lost(config):
    cfg = load_config(str(config))
    ensure_index(cfg)
    shard = config.parent / "data4" / "train-000003.tar"
    _truncate(shard, 0.5)
    index, status = ensure_index(cfg)
    assert status == f"rebuilt: shard(s) changed since it was written: {shard}", status
    report = SkipReport.of(data_plan(cfg, index), cfg.data.max_sample_tokens)
    lost = 100 - sum(1 for e in index.entries if index.shards[e.shard] == str(shard))
    assert report.lost == {str(shard): lost} and 40 <= lost <= 60, report.lost  # from the old index's 100
    assert any(line.startswith(f"damaged shard {shard}: truncated") and f"about {lost} sample(s) lost" in line
               for line in report.lines())


def test_a_placeholder_typo_stops_the_run_naming_the_reason(config):
    proc = _train(config, "modules.vision.placeholder=<img>")
    assert proc.returncode == 2
    error = _strict(proc.stdout.strip().splitlines()[-1])["errors"][0]
    assert re.search(r"would be dropped .*mainly placeholder and image counts differ \(\d+; e\.g\. .*0 x '<img>' for 1 image",
                     error), error


def _weights(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    folder = ckpt / f"step-{step:08d}"
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".model.safetensors"):
            out.update({f"{name}:{k}": v for k, v in load_file(folder / name).items()})
    return out


def test_a_nan_step_stops_the_run_without_a_checkpoint_and_strict_json(config):
    proc = _train(config, env={FAULT_ENV: "nan:1:2"})
    assert proc.returncode == 2, proc.stderr
    result = _strict(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is False and result["errors"][0].startswith("step 2: loss nan, gradient norm nan"), result
    assert "newest is" in result["errors"][0] and "step-00000001" in result["errors"][0]
    ckpt = config.parent / "run" / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["step-00000001"]  # no checkpoint of the NaN update, the good one kept
    records = [_strict(line) for line in (config.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[1]["loss"] is None and records[0]["loss"] > 0


def test_skip_step_leaves_the_weights_as_they_were_and_counts_it(config):
    proc = _train(config, "train.on_nonfinite=skip_step", "train.checkpoint.keep=3", env={FAULT_ENV: "nan:1:2"})
    assert proc.returncode == 0, proc.stderr
    result = _strict(proc.stdout.strip().splitlines()[-1])
    assert result["skipped_steps"] == [2] and result["steps_run"] == 3
    ckpt = config.parent / "run" / "ckpt"
    one, two, three = (_weights(ckpt, s) for s in (1, 2, 3))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)  # step 2 changed nothing
    assert any(not torch.equal(two[k], three[k]) for k in two) and all(torch.isfinite(v).all() for v in three.values())
    records = read_metrics(str(config.parent / "run" / "metrics.jsonl"))
    assert [r["skipped_step"] for r in records] == [False, True, False] and records[-1]["skipped_steps"] == 1


def test_a_closed_stdout_stops_the_run_like_ctrl_c(config):
    clean = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, *TORCHRUN_ENV)}
    run = config.parent / "run"
    cmd = (f"{sys.executable} -m mimo train {config} --run-dir {run} train.steps=40 train.checkpoint.every=100 "
           f"| head -1")
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=240, env=clean)
    assert proc.stdout.startswith("step 1/40"), proc.stdout
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    log = (run / "logs" / "rank0.log").read_text()
    assert "stdout was closed" in log, log
    steps = sorted(os.listdir(run / "ckpt"))
    assert len(steps) == 1 and steps[0] < "step-00000040", steps  # stopped early, checkpointed
    last = read_metrics(str(run / "metrics.jsonl"))[-1]
    assert last["checkpoint"] and last["step"] == int(steps[0][5:])
