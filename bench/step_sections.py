"""Host time of a training step, by part: ``train_step``'s pieces (the step's data and plan,
delivered from the data thread; encoder and LLM forward and backward, bridges, gradient sync,
norm and clipping, optimizers) wrapped with host timers, no
profiler. Run back to back (the host may run ahead of the device or wait on its launch queue) and
with every step waited for (the host's own work). On a GPU the wall time per step against the
host's shows whether the host sets the pace. Prints one JSON line.

    python bench/step_sections.py [--config configs/llava-1.3b.yaml] [--steps 10] [--tiny] [key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llava_step import TINY  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    parser.add_argument("--config", default=str(ROOT / "configs/llava-1.3b.yaml"))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="bench/llava_step.py's tiny model (CPU smoke run)")
    args = parser.parse_args(argv)

    import mimo.training.schedule_run as schedule_run
    import mimo.training.step as step_module
    from mimo.compose.config import load_config
    from mimo.llm.stage_runner import StageRunner
    from mimo.training.run import build_run

    config = load_config(args.config, (TINY if args.tiny else []) + args.overrides
                         + [f"train.steps={args.warmup + 2 * args.steps}"])
    device = torch.device(args.device)
    torch.manual_seed(0)
    run = build_run(config, 0, device=device)  # compiled as the config says (train.compile, train.cuda_graphs)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    timing = [False]

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            if not timing[0]:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
                calls[name] += 1
        return wrapped

    for name in ("run_schedule", "grad_norm", "clip_", "lr_for"):
        setattr(step_module, name, timed(name, getattr(step_module, name)))
    for name in ("encode_and_bridge", "bridge_backward"):
        setattr(schedule_run, name, timed(name, getattr(schedule_run, name)))
    for name in ("forward", "backward"):
        setattr(StageRunner, name, timed(f"llm.{name}", getattr(StageRunner, name)))
    run.pipeline.step = timed("data", run.pipeline.step)
    grad_sync = step_module.grad_sync_for(run.model, run.policy)
    for name in ("zero_grad", "accumulate", "finish"):
        setattr(grad_sync, name, timed(f"grad_sync.{name}", getattr(grad_sync, name)))
    for module, opt in run.optimizers.items():
        opt.step = timed(f"optimizer.{module}", opt.step)
    for part in run.model.encoder_parts:
        if part.module is not None:
            part.module.forward = timed("encoder.forward", part.module.forward)
    step = [0]

    def one():
        step[0] += 1
        return step_module.train_step(run.model, run.pipeline, step[0], run.optimizers, run.policy)

    try:
        for _ in range(args.warmup):
            one().loss
        sync()
        out = {"bench": "step_sections", "config": str(Path(args.config).name), "overrides": args.overrides,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
        for mode in ("back_to_back", "waited"):
            spent.clear()
            calls.clear()
            timing[0] = True
            results, host = [], 0.0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                t = time.perf_counter()
                results.append(one())
                host += time.perf_counter() - t
                if mode == "waited":
                    results[-1].loss
            sync()
            wall = time.perf_counter() - t0
            timing[0] = False
            [r.loss for r in results]
            out[mode] = {"wall_ms_per_step": 1e3 * wall / args.steps, "host_ms_per_step": 1e3 * host / args.steps,
                         "parts_ms_per_step": {k: round(1e3 * v / args.steps, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
                         "calls_per_step": {k: v / args.steps for k, v in calls.items()}}
    finally:
        run.close()
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
