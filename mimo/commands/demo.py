"""``mimo demo``: the embedded default, from nothing to an evaluated model on local CPU processes.

1. makes the demo data (``mimo make-demo-data``) in ``demo-data/`` unless a complete copy is
   there already (its ``manifest.json`` says so);
2. trains ``configs/demo.yaml`` (a tiny ViT + Mamba-2 / attention LLM; the vision tower data
   parallel over 4 ranks, the LLM tp2 x dp2 with sequence parallelism on the same ranks),
   printing the loss as it falls;
3. evaluates the last checkpoint on the held-out split (``mimo eval``: loss, exact match);
4. says where the run directory is.

Run again, it resumes: training continues from the latest checkpoint in the run directory
(nothing to do when it is complete) and the evaluation runs again. ``--fresh`` deletes the run
directory first.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from mimo.core.errors import ConfigError

DEMO_CONFIG = os.path.join("configs", "demo.yaml")
DEMO_DATA_DIR = "demo-data"  # configs/demo.yaml points here


def find_demo_config() -> str:
    """``configs/demo.yaml`` of the working directory, else of the source tree mimo runs from."""
    for path in (DEMO_CONFIG, str(Path(__file__).resolve().parents[2] / DEMO_CONFIG)):
        if os.path.isfile(path):
            return path
    raise ConfigError(f"{DEMO_CONFIG}: not found here or in the mimo source tree; pass --config PATH")


def demo(config_path: str | None, overrides: list[str], fresh: bool = False, log_every: int = 10,
         timeout_s: float = 900.0) -> dict:
    from mimo.compose.config import load_config
    from mimo.data.demo import demo_data_ready, make_demo_data
    from mimo.commands.eval import evaluate
    from mimo.training.metrics import read_metrics
    from mimo.training.train import TrainOptions, default_run_dir, train

    t0 = time.perf_counter()
    config_path = config_path or find_demo_config()
    if demo_data_ready(DEMO_DATA_DIR):
        print(f"demo data: {DEMO_DATA_DIR}/ (present)", flush=True)
    else:
        print(f"demo data: writing {DEMO_DATA_DIR}/ ...", flush=True)
        make_demo_data(DEMO_DATA_DIR)
    config = load_config(config_path, overrides)
    run_dir = default_run_dir(config)
    if fresh and os.path.isdir(run_dir):
        if not os.path.isfile(os.path.join(run_dir, "config.yaml")):
            raise ConfigError(f"{run_dir}: not a mimo run directory (no config.yaml); not deleting it for --fresh")
        shutil.rmtree(run_dir)
        print(f"--fresh: deleted {run_dir}", flush=True)
    print(f"training {config_path} on {config.world_size} local processes for {config.train.steps} steps "
          f"(run directory {run_dir}; run `mimo demo` again to resume, `mimo demo --fresh` to start over)", flush=True)
    trained = train(config_path, overrides, TrainOptions(run_dir=run_dir, timeout_s=timeout_s, log_every=log_every))
    t_train = time.perf_counter() - t0
    if trained.get("resumed_from"):
        print(f"resumed from step {trained['resumed_from']}; ran {trained['steps_run']} more steps", flush=True)
    losses = [r["loss"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]
    print(f"evaluating {trained['checkpoint']} on {config.eval.shards} ...", flush=True)
    evaluated = evaluate(config_path, overrides, checkpoint=config.train.checkpoint.dir, timeout_s=timeout_s)
    em = evaluated["exact_match"]
    print(f"held-out: loss {evaluated['loss']:.4f}, exact match {em:.3f} ({evaluated['matched']}/{evaluated['scored']} "
          f"answers; {evaluated['captions']} captions scored by loss only)" if em is not None else
          f"held-out: loss {evaluated['loss']:.4f}; no question to score", flush=True)
    for ex in evaluated["examples"]:
        print(f"  {'ok ' if ex['match'] else 'BAD'} reference {ex['reference']!r:>16}  generated {ex['generated']!r}")
    elapsed = time.perf_counter() - t0
    print(f"done in {elapsed:.0f} s; run directory: {run_dir} (metrics.jsonl, logs/, checkpoints in "
          f"{config.train.checkpoint.dir})", flush=True)
    return {
        "ok": True, "command": "demo", "run_dir": run_dir, "config": config_path, "steps": trained["steps"],
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "resumed_from": trained.get("resumed_from"), "train_s": round(t_train, 1), "elapsed_s": round(elapsed, 1),
        "eval": {k: evaluated[k] for k in ("loss", "exact_match", "scored", "matched", "captions", "samples",
                                           "read_failures", "checkpoint", "checkpoint_step")},
    }
