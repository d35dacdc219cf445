"""The command line as a new user meets it (issue 20, points 2, 5, 6 and 8): what the README
says works, a run directory per run, overrides anywhere on the line, every config problem at
once. In-process through ``mimo.commands.cli.main``; one tiny synthetic-data training run."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from mimo.commands.cli import build_parser, main
from mimo.compose.config import load_config
from mimo.training.train import default_run_dir

ROOT = Path(__file__).resolve().parents[1]

TINY = """\
world_size: 1
modules:
  vision:
    kind: vit
    arch: {image_size: 16, patch: 8, hidden: 16, layers: 1, heads: 2, mlp: 32}
    feature_layer: -1
  language:
    kind: hybrid
    arch: {pattern: "*-", hidden: 16, heads: 2, vocab: 64, max_seq_len: 64}
data:
  source: synthetic
  tokens_per_microbatch: 64
  max_sample_tokens: 32
train:
  steps: 3
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> str:
    """tiny.yaml (no train.checkpoint.dir) in an otherwise empty working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    return "tiny.yaml"


def run(capsys, *argv: str) -> tuple[int, list[str], dict, str]:
    """(exit code, the human lines of stdout, its final JSON, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    return code, lines[:-1], json.loads(lines[-1]), err


# ---------------------------------------------------------------- point 2: the README and --help


def test_readme_commands_and_references_hold(capsys, tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert "../shared/" not in readme and "`docs/design.md`" in readme and (ROOT / "docs" / "design.md").is_file()
    assert "import-hf-llava DIR --yaml modules.yaml" in readme and "--out modules.yaml" not in readme
    pattern_row = next(line for line in readme.splitlines() if line.startswith("| `arch.pattern`"))
    assert "`E` (MoE)" in pattern_row and "`arch.moe`" in pattern_row and "not supported yet" not in pattern_row
    assert "image_mean" in readme and "preprocessor_config.json" in readme
    # what a user tries from an older README: told which flag writes the modules section
    code, _, result, _ = run(capsys, "import-hf-llava", str(tmp_path / "hf-llava"), "--out", "modules.yaml")
    assert code == 2 and "use --yaml modules.yaml" in result["errors"][0]


def test_every_argument_has_help(capsys):
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    bare = [f"{name} {a.option_strings or a.dest}" for name, sub in commands.items() for a in sub._actions if not a.help]
    assert not bare, f"arguments without help: {bare}"
    with pytest.raises(SystemExit):
        main(["verify-train", "--help"])
    assert "training steps to run and compare" in capsys.readouterr().out


def test_verify_train_refuses_fp8_and_says_what_to_verify(capsys, tiny):
    """A layout under FP8 cannot be told from the reference by any tolerance (rounding flips):
    refused before any rank starts, with the way to verify it."""
    code, _, result, _ = run(capsys, "verify-train", tiny, "train.fp8={recipe: rowwise}")
    assert code == 2 and "train.fp8=null" in result["errors"][0] and "rounding flips" in result["errors"][0]


# ---------------------------------------------------------------- point 5: a run directory per run


def test_a_run_gets_its_own_directory_and_a_finished_run_says_so(capsys, tiny, tmp_path):
    # options, then an override (point 6): the run trains 2 steps, not the config's 3
    code, lines, result, _ = run(capsys, "train", tiny, "--device", "cpu", "train.steps=2")
    run_dir = tmp_path / "runs" / "tiny"
    assert code == 0 and result["steps"] == 2 and result["run_dir"] == str(run_dir)
    assert result["checkpoint"] == str(run_dir / "checkpoints" / "step-00000002")
    assert sorted(os.listdir(tmp_path)) == ["runs", "tiny.yaml"]  # nothing in the working directory itself
    assert {"config.yaml", "metrics.jsonl", "logs", "checkpoints"} <= set(os.listdir(run_dir))
    assert lines[-1].startswith("train: finished at step 2")

    code, lines, result, _ = run(capsys, "train", tiny, "train.steps=2", "--device", "cpu")
    assert code == 0 and result["steps_run"] == 0
    assert lines[-1].startswith(f"train: already finished at step 2: {run_dir / 'checkpoints' / 'step-00000002'}")
    assert "nothing to do" in lines[-1]


def test_run_dir_and_the_shipped_configs_keep_their_directories(capsys, tiny, monkeypatch):
    assert load_config(tiny).train.checkpoint.dir == os.path.join("runs", "tiny", "checkpoints")
    assert load_config(tiny, run_dir="elsewhere").train.checkpoint.dir == os.path.join("elsewhere", "checkpoints")
    # set in the config: kept, and its parent stays the run directory (runs/<config name> as before)
    demo = load_config(ROOT / "configs" / "demo.yaml", ["data.source=synthetic", "data.tokenizer=null"], run_dir="elsewhere")
    assert demo.train.checkpoint.dir == "runs/demo/ckpt" and default_run_dir(demo) == os.path.abspath("runs/demo")
    # `mimo eval --run-dir R` evaluates what `mimo train --run-dir R` wrote
    import mimo.commands.eval as eval_command

    asked = []

    def evaluate(config, overrides, checkpoint, *rest):
        asked.append(checkpoint)
        return {"checkpoint": checkpoint, "shards": "-", "samples": 0, "loss": 0.0, "exact_match": None, "captions": 0, "read_failures": 0}

    monkeypatch.setattr(eval_command, "evaluate", evaluate)
    assert main(["eval", tiny, "--run-dir", "elsewhere"]) == 0 and main(["eval", tiny]) == 0
    assert asked == [os.path.join("elsewhere", "checkpoints"), None]  # None: evaluate's default, train.checkpoint.dir


# ---------------------------------------------------------------- point 6: overrides anywhere


def test_overrides_after_options_and_unknown_flags(capsys, tiny):
    code, _, result, _ = run(capsys, "eval", tiny, "--checkpoint", "X", "eval.samples=0")
    assert code == 2 and result["errors"] == ["eval.samples: must be >= 1, got 0"]  # the override was read
    code, _, result, _ = run(capsys, "train", tiny, "--device", "cpu", "train.steps=0", "train.lr=2e-3")
    assert code == 2 and result["errors"] == ["train.steps: must be >= 1, got 0"]
    code, _, result, _ = run(capsys, "train", tiny, "--device", "cpu", "--nope", "train.steps=2")
    assert code == 2 and result["errors"] == ["mimo train: unrecognized arguments: --nope"]
    code, _, result, _ = run(capsys, "verify-bridge", "--world", "1", "--src", "tp=1", "--dst", "tp=1", "train.steps=2")
    assert code == 2 and "takes no key=value overrides" in result["errors"][0]


# ---------------------------------------------------------------- point 8: every problem at once


def test_check_config_reports_every_problem(capsys, tiny, tmp_path):
    code, _, result, err = run(capsys, "check-config", tiny, "train.steps=-1", "train.lr=-1", "data.template=llama3")
    assert code == 2 and result["errors"] == [
        "data.template: must be 'plain', 'vicuna', 'chatml' or 'tokenizer'; got string 'llama3'",
        "train.steps: must be >= 1, got -1",
        "train.lr: must be > 0, got -1.0",
    ]
    assert err.splitlines() == result["errors"]

    (tmp_path / "s-000001.tar").write_bytes(b"")
    code, _, result, _ = run(capsys, "check-config", tiny, "data.source=webdataset", "data.shards=s-{000000..000003}.tar",
                             "data.tokenizer=no-tokenizer")
    assert code == 2
    assert "data.shards: 3 of 4 shards of 's-{000000..000003}.tar' are missing: 's-000000.tar', 's-000002.tar', 's-000003.tar'" in result["errors"]

    code, _, result, _ = run(capsys, "check-config", tiny, "modules.vison.parallel.tp=2", "train.steps=-1")
    assert code == 2 and result["errors"] == [
        "override 'modules.vison.parallel.tp=2': unknown module 'vison' — did you mean 'vision'?",
        "train.steps: must be >= 1, got -1",
    ]
    # a module the line itself creates is not a typo
    code, _, result, _ = run(capsys, "check-config", tiny, "modules.audio.kind=vit", "modules.audio.parallel.tp=1")
    assert code == 2 and not any("unknown module" in e for e in result["errors"]) and "modules.audio.arch: missing required key" in result["errors"]
