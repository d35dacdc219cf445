"""bf16 against fp32 over a whole training run (issue 13: "speed did not cost correctness").

Trains the demo task scaled to one GPU — configs/demo.yaml (its data and its lr schedule) at
world 1 with a wider hybrid (Mamba-2 / attention) LLM and ViT and 4x the tokens per step — through
``mimo train``, identical but for ``train.precision`` (fp32; bf16: bf16 parameters and
activations, fp32 master weights and AdamW state, fp32 loss and gradient reduction), and compares
the losses. ``--fp32-seed N`` adds an fp32 run with other initial weights: how far fp32 lands from
itself. ``--fp8 RECIPE`` adds a bf16 run with ``train.fp8={recipe: RECIPE}`` (issue 26: its loss
should stay within the bf16-vs-fp32 spread). ``--seeds N`` runs each for ``train.seed`` 0..N-1 and
compares FP8 with the spread of bf16's distances over the seeds. One JSON line: each run's first and last loss, the mean of its last 10 steps and wall
time; the relative differences at the last step, of the last-10 means and the largest over all
steps; the two curves every tenth of the run.

    python bench/precision_train.py [--steps 200] [--device auto|cpu|cuda] [--together] [--fp32-seed N] [--fp8 rowwise] [--seeds N] [--data demo-data] [key=value ...]
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
# the demo model, scaled for one GPU (about 10M LLM parameters, 4x the tokens per step)
SCALED = [
    "modules.vision.arch.hidden=256", "modules.vision.arch.layers=4", "modules.vision.arch.heads=4",
    "modules.vision.arch.mlp=1024",
    "modules.language.arch.hidden=512", "modules.language.arch.heads=8", "modules.language.arch.kv_heads=4",
    "modules.language.arch.pattern='M*-M*-'", "modules.language.arch.mamba_head_dim=64",
    "data.tokens_per_microbatch=8192", "train.micro_batches=2",  # lr, warmup and schedule: the demo's own
]


def start(name: str, steps: int, data: str, device: str, overrides: list[str], out: Path) -> tuple:
    """Starts ``mimo train`` for run ``name`` (its precision, ``fp32-seedN``: fp32 with another
    ``train.seed``, or ``fp8-RECIPE``: bf16 with FP8 GEMMs); ``finish`` waits for it and reads its losses."""
    run_dir = out / name
    precision, _, seed = name.partition("-seed")
    if precision.startswith("fp8-"):
        precision, overrides = "bf16", [*overrides, f"train.fp8={{recipe: {precision[4:]}}}"]
    args = [
        sys.executable, "-m", "mimo", "train", str(ROOT / "configs/demo.yaml"), *WORLD_1, *overrides,
        f"train.precision={precision}", *([f"train.seed={seed}"] if seed else []), f"train.steps={steps}", f"train.checkpoint.dir={run_dir / 'ckpt'}",
        f"train.checkpoint.every={steps}", f"data.shards={data}/train-{{000000..000007}}.tar", f"data.tokenizer={data}/tokenizer",
        f"eval.shards={data}/heldout-{{000000..000000}}.tar",
        "--run-dir", str(run_dir), "--device", device, "--log-every", "50",
    ]
    log = open(out / f"{name}.log", "w", encoding="utf-8")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True), log, time.perf_counter(), name, steps, run_dir


def finish(proc, log, t0: float, name: str, steps: int, run_dir: Path) -> dict:
    code = proc.wait()
    wall = time.perf_counter() - t0
    log.close()
    if code != 0:
        with open(log.name, encoding="utf-8") as f:
            raise SystemExit(f"mimo train ({name}) failed ({code}):\n{f.read()[-4000:]}")
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    last = [losses[s] for s in range(max(1, steps - 9), steps + 1)]
    return {"loss_first": losses[1], "loss_last": losses[steps], "loss_last10_mean": sum(last) / len(last), "wall_s": wall,
            "losses": losses}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--data", default="demo-data", help="demo data folder (made if missing)")
    p.add_argument("--out", default="runs/precision", help="where the two run directories go")
    p.add_argument("--together", action="store_true", help="run fp32 and bf16 at the same time (wall times then overlap)")
    p.add_argument("--fp32-seed", type=int, metavar="N", help="also an fp32 run with train.seed=N (fp32's own spread)")
    p.add_argument("--fp8", metavar="RECIPE", choices=("tensorwise", "rowwise", "delayed", "blockwise"),
                   help="also a bf16 run with FP8 GEMMs of this recipe")
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="each run for train.seed 0..N-1 (the spread over seeds: see fp8_within_bf16_spread)")
    p.add_argument("--tiny", action="store_true", help="demo size instead of the scaled model (smoke run)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.data, "manifest.json")):
        from mimo.data.demo import make_demo_data

        make_demo_data(args.data)
    overrides = ([] if args.tiny else SCALED) + args.overrides
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seeded = f"fp32-seed{args.fp32_seed}" if args.fp32_seed is not None else None
    fp8 = f"fp8-{args.fp8}" if args.fp8 else None
    names = ["fp32", "bf16"] + [n for n in (seeded, fp8) if n]
    suffixes = [""] + [f"-seed{seed}" for seed in range(1, args.seeds)]  # seed 0: the config's own
    names += [f"{n}{sfx}" for sfx in suffixes[1:] for n in ("fp32", "bf16", fp8) if n]
    if args.together:  # the runs at once (one GPU holds them; the small model leaves it idle much of the time)
        started = [start(n, args.steps, os.path.abspath(args.data), args.device, overrides, out) for n in names]
        runs = {n: finish(*s_) for n, s_ in zip(names, started)}
    else:
        runs = {n: finish(*start(n, args.steps, os.path.abspath(args.data), args.device, overrides, out)) for n in names}
    losses = {n: r.pop("losses") for n, r in runs.items()}
    fp32, bf16 = runs["fp32"], runs["bf16"]
    a, b = losses["fp32"], losses["bf16"]
    every = max(1, args.steps // 10)
    curve = {s_: [round(a[s_], 5), round(b[s_], 5)] for s_ in range(every, args.steps + 1, every)}
    result = {
        "bench": "precision_train", "steps": args.steps, "device": args.device, "overrides": overrides, **runs,
        "rel_diff_last": abs(bf16["loss_last"] - fp32["loss_last"]) / abs(fp32["loss_last"]),
        "rel_diff_last10_mean": abs(bf16["loss_last10_mean"] - fp32["loss_last10_mean"]) / abs(fp32["loss_last10_mean"]),
        "rel_diff_max": max(abs(b[s_] - a[s_]) / abs(a[s_]) for s_ in a), "curve_fp32_bf16": curve,
    }
    for name in (seeded, fp8):  # seeded: the yardstick, how far fp32 lands from fp32 with other initial weights
        if name:
            c, run = losses[name], runs[name]
            result[f"{name}_rel_diff_last"] = abs(c[args.steps] - a[args.steps]) / abs(a[args.steps])
            result[f"{name}_rel_diff_last10_mean"] = abs(run["loss_last10_mean"] - fp32["loss_last10_mean"]) / abs(fp32["loss_last10_mean"])
            result[f"curve_{name}"] = {s_: round(c[s_], 5) for s_ in curve}
    if args.seeds > 1:  # each seed's distance from the fp32 run of the same seed (last-10 means)
        for name in ("bf16", fp8):
            if name:
                result[f"{name}_rel_diff_last10_mean_by_seed"] = [
                    abs(runs[f"{name}{sfx}"]["loss_last10_mean"] - runs[f"fp32{sfx}"]["loss_last10_mean"])
                    / abs(runs[f"fp32{sfx}"]["loss_last10_mean"])
                    for sfx in suffixes]
    if fp8:  # within the spread: no further from fp32 than bf16 is (last-10 means); over seeds, no
        # seed's FP8 further than the furthest bf16 (one run's bf16 distance is GPU noise: 0.01-0.6%)
        if args.seeds > 1:
            result["fp8_within_bf16_spread"] = (max(result[f"{fp8}_rel_diff_last10_mean_by_seed"])
                                                <= max(result["bf16_rel_diff_last10_mean_by_seed"]))
        else:
            result["fp8_within_bf16_spread"] = result[f"{fp8}_rel_diff_last10_mean"] <= result["rel_diff_last10_mean"]
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
