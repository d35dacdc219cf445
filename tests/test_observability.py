"""What a run reports (issue 20, point 13): learning-rate schedules (``train.lr_schedule``,
``warmup_ratio``, ``min_lr``, ``decay_ratio``), model TFLOP/s, MFU and per-module peak memory
in metrics.jsonl and the progress line, Weights & Biases (``train.log.wandb``), and held-out
evaluation during training (``eval.every``)."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch

from mimo.commands.cli import main
from mimo.compose.config import TrainConfig, load_config
from mimo.core.errors import ConfigError
from mimo.data.plan import PlannedSample
from mimo.training.flops import device_peak_flops, model_flops, module_factors, param_counts, throughput
from mimo.training.metrics import check_reporting, module_peaks
from mimo.training.optim import lr_at, lr_for

TWO_RANKS = ["world_size=2", "modules.vision.parallel.dp=2", "modules.vision.parallel.ranks=0:2",
             "modules.language.parallel.dp=1", "modules.language.parallel.ranks=0:2"]


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory, write_demo_config, indexes_here) -> str:
    with indexes_here():
        return write_demo_config(tmp_path_factory.mktemp("observability"), seed=5)


# ---------------------------------------------------------------- learning-rate schedules


def test_default_schedule_is_unchanged():
    """No new key set: linear warmup, then cosine down to 10% of the base (as before)."""
    train = TrainConfig(steps=100, lr=0.01, warmup_steps=10)
    for step in (1, 5, 10, 11, 55, 99, 100):
        assert lr_for(train, step, 0.01) == lr_at(step, 0.01, 10, 100)
    assert lr_for(train, 55, 0.01) == pytest.approx(0.0055) and lr_for(train, 100, 0.01) == pytest.approx(0.001)


@pytest.mark.parametrize("schedule, expected", [
    # steps 100, warmup 10 (warmup_ratio 0.1), lr 1.0, min_lr 0.2; at steps 5, 10, 55, 85, 95, 100
    ("cosine", [0.5, 1.0, 0.6, 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 75 / 90)), None, 0.2]),
    ("linear", [0.5, 1.0, 0.6, 0.2 + 0.8 * 15 / 90, None, 0.2]),
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    # wsd, decay_ratio 0.2: stable until step 80, then linear to min_lr at 100
    ("wsd", [0.5, 1.0, 1.0, 0.2 + 0.8 * 15 / 20, 0.2 + 0.8 * 5 / 20, 0.2]),
])
def test_schedules(schedule, expected):
    train = TrainConfig(steps=100, lr=1.0, warmup_ratio=0.1, min_lr=0.2, lr_schedule=schedule, decay_ratio=0.2)
    for step, want in zip((5, 10, 55, 85, 95, 100), expected):
        if want is not None:
            assert lr_for(train, step, 1.0) == pytest.approx(want), (schedule, step)
    # a module with its own lr follows the same shape, ending at the same fraction of its lr
    assert lr_for(train, 100, 0.5) == pytest.approx(0.5 * (0.2 if schedule != "constant" else 1.0))


def test_warmup_ratio_rounds_up():
    train = TrainConfig(steps=30, lr=1.0, warmup_ratio=0.05)  # 1.5 steps -> 2
    assert [lr_for(train, s, 1.0) for s in (1, 2)] == [0.5, 1.0]


@pytest.mark.parametrize("override, message", [
    ("train.warmup_ratio=-0.1", "train.warmup_ratio: must be in [0, 1), got -0.1"),
    ("train.min_lr=0.5", "train.min_lr: 0.5 is more than train.lr=0.003"),
    ("train.min_lr=-1", "train.min_lr: must be >= 0"),
    ("train.lr_schedule=cosin", "train.lr_schedule: must be 'cosine', 'linear', 'constant' or 'wsd'; got string 'cosin'; "
                                "did you mean 'cosine'?"),
    ("train.warmup_ratio=0.1", "train.warmup_ratio: set either warmup_steps or warmup_ratio, not both"),
    ("train.decay_ratio=0", "train.decay_ratio: must be in (0, 1]"),
    ("eval.every=0", "eval.every: must be >= 1"),
    ("train.log.peak_tflops=0", "train.log.peak_tflops: must be > 0"),
])
def test_bad_values_are_config_errors(demo_config, capsys, override, message):
    assert main(["check-config", demo_config, override]) == 2
    assert message in capsys.readouterr().err


def test_config_errors_spanning_keys(demo_config):
    with pytest.raises(ConfigError, match=r"train.decay_ratio: 10 warmup and 248 decay steps are more than train.steps=250"):
        load_config(demo_config, ["train.lr_schedule=wsd", "train.decay_ratio=0.99"])
    with pytest.raises(ConfigError, match="eval.every: evaluating during training needs eval.shards"):
        load_config(demo_config, ["eval.shards=null", "eval.every=5"])


# ---------------------------------------------------------------- FLOPs, MFU, memory


def test_model_flops_and_mfu_with_a_fake_peak(demo_config, monkeypatch):
    config = load_config(demo_config)
    counts = param_counts(config)
    llm, vision = counts["language"], counts["vision"]
    assert llm > 0 and vision > 0
    # demo tower: 32x32 images in 8x8 patches -> 16 patches and [CLS]
    samples = [PlannedSample(0, 100, 1, {"<image>": [3]}), PlannedSample(1, 50, 0, {})]
    projector = counts["vision.projector"]
    flops = model_flops(config, samples, counts)
    assert flops == 6 * llm * 150 + 6 * vision * 1 * 17 + 6 * projector * 1 * 16  # the projector: per image row
    # frozen modules (LLaVA stage 1): the tower forward only, the LLM forward and its activations'
    # backward (the projector before it trains), the projector all three
    stage1 = load_config(demo_config, ["modules.vision.freeze=[tower]", "modules.language.freeze=true"])
    assert module_factors(stage1) == {"vision": 2, "vision.projector": 6, "language": 4}
    assert model_flops(stage1, samples, counts) == 4 * llm * 150 + 2 * vision * 17 + 6 * projector * 16
    frozen_all_but_llm = load_config(demo_config, ["modules.vision.freeze=[tower, projector]"])
    assert module_factors(frozen_all_but_llm) == {"vision": 2, "vision.projector": 2, "language": 6}
    assert throughput(flops, 0.0, 4, 1e12) == (None, None)
    tflops, mfu = throughput(2e12, 2.0, 4, None)  # no known peak: TFLOP/s, no MFU
    assert tflops == 1.0 and mfu is None
    assert throughput(2e12, 2.0, 4, 0.5e12) == (1.0, 0.5)  # 1 TFLOP/s over 4 devices of 0.5
    assert device_peak_flops("cpu", "bf16") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert device_peak_flops("cuda:0", "bf16") == 989e12 and device_peak_flops("cuda:0", "fp32") == 67e12
    assert device_peak_flops("cuda:0", "bf16", fp8=True) == 1979e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert device_peak_flops("cuda:0", "bf16") == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert device_peak_flops("cuda:0", "bf16") is None


def test_module_peaks_from_the_ranks():
    nan = math.nan
    ranges = {"vision": range(0, 2), "language": range(2, 4)}
    assert module_peaks([1.5, 2.5, 10.0, 9.0], ranges) == {"vision": 2.5, "language": 10.0}
    assert module_peaks([nan] * 4, ranges) is None  # CPU ranks: no memory reading
    colocated = {"vision": range(0, 2), "language": range(0, 2)}
    assert module_peaks([3.0, 4.0], colocated) == {"vision": 4.0, "language": 4.0}


def test_wandb_asked_for_but_not_installed(demo_config, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"train.log.wandb: the wandb package is not installed \(pip install 'mimo\[wandb\]'"):
        check_reporting(load_config(demo_config, ["train.log.wandb.project=p"]))


# ---------------------------------------------------------------- a training run


FAKE_WANDB = '''
"""A stand-in for the wandb package: records init and log calls as JSON lines in WANDB_CALLS."""
import json, os


def _record(**call):
    with open(os.environ["WANDB_CALLS"], "a") as f:
        f.write(json.dumps(call) + "\\n")


class _Run:
    def log(self, data, step=None):
        _record(call="log", data=data, step=step)

    def finish(self):
        _record(call="finish")


def init(**kwargs):
    _record(call="init", **{k: v for k, v in kwargs.items() if k != "config"}, has_config="train" in kwargs["config"])
    return _Run()
'''


def test_train_reports_tflops_mfu_eval_lines_and_wandb(demo_config, tmp_path, monkeypatch, capfd):
    """A 2-rank run, 4 steps, eval.every=2 on 4 held-out samples, a fake device peak and a fake
    wandb package (the ranks are spawned processes: it reaches them on sys.path)."""
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text(textwrap.dedent(FAKE_WANDB))
    calls = tmp_path / "wandb-calls.jsonl"
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.setenv("WANDB_CALLS", str(calls))
    run = tmp_path / "run"
    assert main(["train", demo_config, *TWO_RANKS, "train.steps=4", "eval.every=2", "eval.samples=4", "eval.max_new_tokens=2",
          "train.log.peak_tflops=0.5", "train.log.wandb.project=mimo-test", f"train.checkpoint.dir={run / 'ckpt'}"]) == 0
    out = capfd.readouterr().out.splitlines()  # rank 0's progress lines too (another process)
    assert json.loads(out[-1])["steps"] == 4
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if not r.get("eval")]
    evals = [r for r in recs if r.get("eval")]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"] / (2 * 0.5))  # 2 devices of 0.5 TFLOP/s
        assert r["mem_peak_gib"] is None  # CPU ranks
    # eval lines after steps 2 and 4, as `mimo eval` computes them: loss over the answer tokens, exact match
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["eval_samples"] == 4 and r["eval_scored"] + r["eval_captions"] == 4 and r["eval_loss"] > 0
        assert r["eval_exact_match"] == r["eval_matched"] / r["eval_scored"]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]  # it trains
    progress = [line for line in out if line.startswith("step ")]
    assert len(progress) == 4 and all("TFLOP/s" in line and "MFU" in line for line in progress)
    assert sum(line.startswith("eval at step ") for line in out) == 2
    # W&B: one run in this project with the config, every step's numbers and both evaluations
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    assert logged[0]["call"] == "init" and logged[0]["project"] == "mimo-test" and logged[0]["has_config"]
    assert logged[0]["id"] == (run / "wandb-run-id").read_text().strip()
    logs = [c for c in logged if c["call"] == "log"]
    assert [c["step"] for c in logs if "train/loss" in c["data"]] == [1, 2, 3, 4]
    assert [c["data"]["eval/loss"] for c in logs if "eval/loss" in c["data"]] == [r["eval_loss"] for r in evals]
    assert all(c["data"]["train/tflops"] == r["tflops"] for c, r in zip((c for c in logs if "train/loss" in c["data"]), steps))
    assert logged[-1]["call"] == "finish"
