"""Parameter, gradient, optimizer and activation bytes per rank: predicted from placements, measured.

**Predicted** (``predict``; no processes): the one-process model is built on the meta device
for its full shapes and placements; at a layout each parameter's local elements follow from its
placement — TP as it is, GTP as ``mimo.parallel.gtp.gtp_placement`` splits it, the routed experts
on the expert view (E over ep, F over etp). Bytes per rank (the largest rank's: rank 0 of the
first stage, the first stage holding the embedding): weights in the run's dtype; main gradients
in the wider of the weights' and ``train.grad_reduce``'s dtype, none where a gradient has nothing to
sum and is of the weights' dtype (a direct bucket: autograd's own gradients, transient, in the
step's peak); optimizer state (``mimo.training.bucket_optim.AdamW``) two fp32 moments, 8 bytes per element,
12 under bf16 (fp32 masters), 4 under bf16-pure (bf16 moments); offloaded, the host copies of
fp32 weights and of the gradients too; divided under ``train.distributed_optimizer`` by the size
of each parameter's data-parallel group (cp x gtp x dp for dense weights, cp x dp for GTP-split
ones, edp for experts; up to each bucket's padding). Activations are not predicted.

**Measured** (``--measure cpu``): the same layouts as gloo processes on the config shrunk by
``--shrink`` (fewer, narrower layers: what fits 2 cores), each rank counting the bytes of its
parameters, its ``GradSync`` main-gradient buffers (direct buckets have none), its optimizer states, and what one training
step keeps for backward (saved-tensor hooks: activations), and under ``train.fp8`` the float8
weights and scales kept between steps (``fp8_weight_cache``: ``train.fp8.cache_weights``, not
predicted); printed beside the prediction for that shrunk model. ``--measure cuda``: world-1 layouts of the full config on the GPU:
``torch.cuda.memory_allocated`` after the build (weights), after the gradient buffers, after the
first step (optimizer state), and the step's peak (``max_memory_allocated``), per recompute mode,
with the FP8 weight cache. ``--set KEY=VALUE`` overrides every run's config (e.g. an FP8 recipe).

    python bench/memory.py [--config configs/llava-1.3b.yaml ...] [--measure cpu|cuda|none] [--set ...]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LANG, VIS = "modules.language.", "modules.vision."
# the distributed optimizer reduce-scatters into fp32 main-gradient shards (the config check refuses bf16 with it)
DO = ["train.distributed_optimizer=true", "train.grad_reduce=fp32"]
LAYOUTS = {  # name -> overrides (world 8): the LLM on every rank, the tower data parallel on every rank
    "dp8": ["world_size=8", VIS + "parallel.dp=8", LANG + "parallel.dp=8"],
    "dp8, distributed optimizer": ["world_size=8", VIS + "parallel.dp=8", LANG + "parallel.dp=8", *DO],
    "tp2 dp4, distributed optimizer": ["world_size=8", VIS + "parallel.dp=8", LANG + "parallel.tp=2", LANG + "parallel.dp=4", *DO],
    "tp2 gtp2 dp2, distributed optimizer": ["world_size=8", VIS + "parallel.dp=4", VIS + "parallel.gtp=2", LANG + "parallel.tp=2",
                                            LANG + "parallel.gtp=2", LANG + "parallel.dp=2", *DO],
    "tp2 dp4 ep4, distributed optimizer (MoE)": ["world_size=8", VIS + "parallel.dp=8", LANG + "parallel.tp=2",
                                                 LANG + "parallel.dp=4", LANG + "parallel.ep=4", LANG + "parallel.etp=1", *DO],
}
# a shape small enough for 8 gloo processes on 2 cores (the structure kept)
SHRINK = [VIS + "arch.hidden=64", VIS + "arch.layers=3", VIS + "arch.heads=4", VIS + "arch.mlp=128", VIS + "arch.image_size=28",
          LANG + "arch.hidden=128", LANG + "arch.heads=8", LANG + "arch.kv_heads=4", LANG + "arch.head_dim=16",
          LANG + "arch.ffn=256", LANG + "arch.vocab=1024", "data.synthetic.text_tokens=[8,120]", "data.tokens_per_microbatch=2048",
          "data.max_sample_tokens=256"]
SHRINK_MOE = [LANG + "arch.pattern='*E*E'", LANG + "arch.moe.ffn=64", LANG + "arch.moe.experts=16", LANG + "arch.moe.topk=4"]


def _is_moe(config) -> bool:
    return getattr(config.llm.arch, "moe", None) is not None


def predict(config) -> dict:
    """Predicted bytes per rank (the first rank of each module's grid: its first pipeline stage,
    which holds the embedding) of each module and in all: the modules built on the meta device
    on ``ParallelContext.plan`` (their own placement rules: TP, GTP, the expert view)."""
    from mimo.encoders.model import VisionEncoder
    from mimo.llm.model import LLMStage
    from mimo.parallel.context import ParallelContext

    arch = config.llm.arch
    bf16 = config.train.precision.startswith("bf16")
    sharded = config.train.distributed_optimizer
    # bytes of optimizer state per element (mimo.training.bucket_optim.AdamW): 2 moments, fp32 (bf16
    # under bf16-pure), and under bf16 fp32 masters; offloaded, the masters of fp32 weights too (the
    # weights' host copy) and the gradients' host copy
    pure = config.train.precision == "bf16-pure"
    per = (4 if pure else 8) + (4 if bf16 and not pure else 0)
    if config.train.optimizer_offload:
        per += (2 if pure else 4) * (not bf16 or pure) + (2 if config.train.grad_reduce == "bf16" else 4)
    out, total = {}, {"params": 0, "grads": 0, "optimizer": 0}
    for name, m in config.modules.items():
        par = m.parallel
        expert = config.llm.expert_layout() if name == config.llm_name else None
        ctx = ParallelContext.plan(par.grid(config.world_size), sequence_parallel=par.sequence_parallel, expert=expert,
                                   gtp=par.gtp, egtp=par.egtp if expert is not None else 1)
        with torch.device("meta"):
            module = LLMStage(arch, ctx) if name == config.llm_name else VisionEncoder(m, arch.hidden, ctx)
        table = module.param_table()
        sums = {"params": 0, "grads": 0, "optimizer": 0}
        for info in table.values():
            p = info.param
            fp32 = not bf16 or type(info.module).__name__ == "Router"  # routers stay fp32 (mimo.llm.router)
            sums["params"] += p.numel() * (4 if fp32 else 2)
            if not p.requires_grad:
                continue
            view = info.view.grid.shape  # the data-parallel group of its gradient: edp on the expert view
            group = view.get("edp", 1) if "edp" in view else view.get("cp", 1) * view.get("dp", 1)
            width = 4 if fp32 else 2
            reduce = 2 if config.train.grad_reduce == "bf16" else 4
            summed = group > 1 or any(view.get(a, 1) > 1 for a in info.placement.partial)
            if summed or reduce != width:  # else a direct bucket (mimo.training.optim.GradSync): no buffer
                sums["grads"] += p.numel() * max(width, reduce)
            sums["optimizer"] += p.numel() * per / (group if sharded else 1)
        out[name] = {k: int(v) for k, v in sums.items()}
        for k in total:
            total[k] += sums[k]
    out["total"] = {k: int(v) for k, v in total.items()}
    return out


def _measure_rank(config_path: str, overrides: list[str]) -> dict:
    import torch.distributed as dist

    from mimo.compose.config import load_config
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    run = build_run(load_config(config_path, overrides), dist.get_rank())
    params = sum(p.numel() * p.element_size() for part in run.model.parts if part.module is not None
                 for p in part.module.parameters())
    grads = sum(b.flat.numel() * b.flat.element_size() for b in run.model.grad_sync._all if not b.direct)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        train_step(run.model, run.pipeline, 1, run.optimizers, run.policy)
    state = 0
    for opt in run.optimizers.values():
        state += opt.state_bytes()
    run.pipeline.close()
    return {"params": params, "grads": grads, "optimizer": state, "activations": sum(seen.values()),
            "fp8_weight_cache": _fp8_cache_bytes(run.model)}


def _fp8_cache_bytes(model) -> int:
    """The float8 weights and scales a step holds (``train.fp8.cache_weights``), refreshed as the
    next step's start would (a step's end drops the updated weights' copies)."""
    from mimo.parallel.fp8 import weight_cache_bytes

    model.refresh_fp8()
    return sum(weight_cache_bytes(part.module) for part in model.parts if part.module is not None)


def measure_cpu(config_path: str, layouts: dict, overrides: list[str] = ()) -> dict:
    from mimo.compose.config import load_config
    from mimo.training.launch import WorkerPool

    shrink = SHRINK + (SHRINK_MOE if _is_moe(load_config(config_path)) else [])
    out = {}
    with WorkerPool(8, timeout_s=1800) as pool:
        for name, layout in layouts.items():
            got = pool.run(_measure_rank, config_path, shrink + [*overrides, *layout])
            want = predict(load_config(config_path, shrink + [*overrides, *layout]))["total"]
            out[name] = {"rank0": got[0], "max": {k: max(r[k] for r in got) for k in got[0]}, "predicted": want,
                         "measured_over_predicted": {k: round(got[0][k] / want[k], 4) for k in want if want[k]}}
    return out


def measure_cuda(config_path: str, modes: list[str], overrides: list[str] = ()) -> dict:
    from mimo.compose.config import load_config
    from mimo.training.run import build_run
    from mimo.training.step import train_step

    dev = torch.device("cuda", torch.cuda.current_device())
    out = {}
    for mode in modes:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        config = load_config(config_path, [f"train.recompute={mode}", "train.compile=false", *overrides])
        run = build_run(config, 0, device=dev)
        weights = torch.cuda.memory_allocated(dev) - base
        grads = sum(b.flat.numel() * b.flat.element_size() for b in run.model.grad_sync._all if not b.direct)
        before = torch.cuda.memory_allocated(dev)
        train_step(run.model, run.pipeline, 1, run.optimizers, run.policy).loss
        opt = torch.cuda.memory_allocated(dev) - before
        torch.cuda.reset_peak_memory_stats(dev)
        steady = torch.cuda.memory_allocated(dev)
        train_step(run.model, run.pipeline, 2, run.optimizers, run.policy).loss
        peak = torch.cuda.max_memory_allocated(dev)
        out[mode] = {"weights_and_grads_gib": weights / 2**30, "grads_gib": grads / 2**30, "optimizer_gib": opt / 2**30,
                     "fp8_weight_cache_gib": _fp8_cache_bytes(run.model) / 2**30,
                     "steady_gib": steady / 2**30, "step_peak_gib": peak / 2**30,
                     "activations_peak_gib": (peak - steady) / 2**30, "predicted": predict(config)["total"]}
        run.close()
        del run
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", nargs="+", default=[str(ROOT / "configs/llava-1.3b.yaml"), str(ROOT / "configs/llava-moe.yaml")])
    ap.add_argument("--measure", choices=("none", "cpu", "cuda"), default="none")
    ap.add_argument("--modes", default="none,selective,full", help="recompute modes measured on the GPU")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every measured run, e.g. 'train.fp8={recipe: rowwise}' (repeatable)")
    args = ap.parse_args()
    from mimo.compose.config import load_config
    from mimo.core.errors import ConfigError

    res = {"bench": "memory", "torch": torch.__version__, "host": platform.node(), "set": args.set, "configs": {}}
    for path in args.config:
        base = load_config(path, args.set)
        layouts, refused = {}, {}
        for n, o in LAYOUTS.items():
            if "MoE" not in n or _is_moe(base):
                try:  # a layout the overrides do not go with (FP8 and GTP) is named, not measured
                    load_config(path, [*args.set, *o])
                    layouts[n] = o
                except ConfigError as e:
                    refused[n] = str(e).splitlines()[0]
        entry = {"predicted_gib": {}, **({"refused": refused} if refused else {})}
        for name, overrides in layouts.items():
            got = predict(load_config(path, [*args.set, *overrides]))
            entry["predicted_gib"][name] = {k: round(v / 2**30, 3) for k, v in got["total"].items()}
        if args.measure == "cpu":
            entry["measured_cpu_shrunk"] = measure_cpu(path, layouts, args.set)
        elif args.measure == "cuda":
            entry["measured_cuda_world1"] = measure_cuda(path, args.modes.split(","), args.set)
        res["configs"][Path(path).name] = entry
    print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
