"""bf16 against fp32 over a whole training run (issue 13: "speed did not cost correctness").

Trains the demo task scaled to one GPU — configs/demo.yaml at world 1 with a wider, deeper
hybrid (Mamba-2 / attention) LLM and ViT, larger microbatches — twice through ``mimo train``,
identical but for ``train.precision`` (fp32, then bf16: bf16 parameters, activations and AdamW
state, fp32 loss and gradient reduction), and compares the losses. One JSON line: the loss at the
last step of each run, their relative difference, the same for the mean of the last 10 steps, and
each run's wall time.

    python bench/precision_train.py [--steps 200] [--device auto|cpu|cuda] [--data demo-data] [key=value ...]
    python bench/precision_train.py --tiny --device cpu     # a CPU smoke run (few steps, demo size)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORLD_1 = [
    "world_size=1",
    "modules.vision.parallel.dp=1", "modules.vision.parallel.ranks=0:1",
    "modules.language.parallel.tp=1", "modules.language.parallel.dp=1", "modules.language.parallel.ranks=0:1",
    "modules.language.parallel.sequence_parallel=false",
]
# the demo model, scaled for one GPU (about 30M LLM parameters)
SCALED = [
    "modules.vision.arch.hidden=256", "modules.vision.arch.layers=4", "modules.vision.arch.heads=4",
    "modules.vision.arch.mlp=1024",
    "modules.language.arch.hidden=512", "modules.language.arch.heads=8", "modules.language.arch.kv_heads=4",
    "modules.language.arch.pattern='M*-M*-M*-M*-'", "modules.language.arch.mamba_head_dim=64",
    "data.tokens_per_microbatch=8192", "train.micro_batches=2", "train.lr=1.0e-3", "train.warmup_steps=20",
]


def train(precision: str, steps: int, data: str, device: str, overrides: list[str], out: Path) -> dict:
    run_dir = out / precision
    args = [
        sys.executable, "-m", "mimo", "train", str(ROOT / "configs/demo.yaml"), *WORLD_1, *overrides,
        f"train.precision={precision}", f"train.steps={steps}", f"train.checkpoint.dir={run_dir / 'ckpt'}",
        f"train.checkpoint.every={steps}", f"data.shards={data}/train-{{000000..000007}}.tar", f"data.tokenizer={data}/tokenizer",
        f"eval.shards={data}/heldout-{{000000..000000}}.tar",
        "--run-dir", str(run_dir), "--device", device, "--log-every", "50",
    ]
    t0 = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"mimo train ({precision}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    last = [losses[s] for s in range(max(1, steps - 9), steps + 1)]
    return {"loss_first": losses[1], "loss_last": losses[steps], "loss_last10_mean": sum(last) / len(last), "wall_s": wall}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--data", default="demo-data", help="demo data folder (made if missing)")
    p.add_argument("--out", default="runs/precision", help="where the two run directories go")
    p.add_argument("--tiny", action="store_true", help="demo size instead of the scaled model (smoke run)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.data, "manifest.json")):
        from mimo.data.demo import make_demo_data

        make_demo_data(args.data)
    overrides = ([] if args.tiny else SCALED) + args.overrides
    out = Path(args.out).resolve()
    runs = {p_: train(p_, args.steps, os.path.abspath(args.data), args.device, overrides, out) for p_ in ("fp32", "bf16")}
    fp32, bf16 = runs["fp32"], runs["bf16"]
    result = {
        "bench": "precision_train", "steps": args.steps, "device": args.device, "overrides": overrides, **runs,
        "rel_diff_last": abs(bf16["loss_last"] - fp32["loss_last"]) / abs(fp32["loss_last"]),
        "rel_diff_last10_mean": abs(bf16["loss_last10_mean"] - fp32["loss_last10_mean"]) / abs(fp32["loss_last10_mean"]),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
