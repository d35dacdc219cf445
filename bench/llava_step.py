"""Single-GPU training step of "llava-1.3b" through mimo, beside the Hugging Face baseline.

Trains configs/llava-1.3b.yaml (the same model and the same seeded samples as
``../shared/bench/hf_llava_baseline.py``) through mimo's own pieces: ``build_run`` (MimoModel
on the device in the config's precision, the synthetic data pipeline packing THD, one AdamW per
module from ``mimo.training.optim``) and ``mimo.training.step.train_step``. Prints one JSON line: real tokens/s,
step time (median and spread over the timed steps), model TFLOP/s (``mimo.training.flops``: 6, 4
or 2 FLOPs per parameter and token as each module trains, is crossed by gradients or only runs
forward; the LLM over real tokens, the projector over image rows, the whole 24-block CLIP tower
over image tokens incl. [CLS]; ``baseline_mfu``: the baseline's real tokens/s at the same FLOPs
per real token, where its own script counts 6 for every module), MFU against the GPU's rated dense peak (``mfu``; and against
an 8192^3 bf16 matmul timed in the same process, ``mfu_measured_rate``), peak memory, the
precision policy, and, unless ``--no-baseline``, the
baseline's own JSON line (run as a subprocess in the same invocation) and the ratio of real
tokens/s. The baseline is the fastest of the configurations ``--baseline-configs`` names, each
run in turn on the same samples; ``baseline.config`` names it and ``baseline.runs`` holds every
one's numbers or error. By default: the padded anchor script with eager, sdpa and flex attention
(the MoE bench: with grouped_mm experts), then ``packed:...``: ``bench/hf_llava_packed.py``, the
same model and samples padding-free (one row, restarting positions) with SDPA or FlexAttention,
each also with its decoder layers compiled (``+COMPILE=1``).

    python bench/llava_step.py [--steps 13] [--warmup 3] [--no-baseline] [--baseline PATH] [key=value ...]
    python bench/llava_step.py --tiny --no-baseline     # a few-second CPU smoke run

An FP8 variant's ``fp8_gain`` is the FP8 goal's ratio: the mean step of the same variant without
FP8 in this process over its own (``fp8_gain_against`` names them; run the bf16 variant before
and after, e.g. ``compile,compile@rowwise,compile@none``, so that neither side gains from running
second).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BASELINE_CANDIDATES = (ROOT.parent / "shared/bench/hf_llava_baseline.py", ROOT / ".whl/hf_llava_baseline.py")
# a model small enough for a CPU smoke run: same structure, same data shape rules
TINY = [
    "modules.vision.arch.image_size=28", "modules.vision.arch.patch=14", "modules.vision.arch.hidden=32",
    "modules.vision.arch.layers=2", "modules.vision.arch.heads=2", "modules.vision.arch.mlp=64",
    "modules.language.arch.pattern='*-*-'", "modules.language.arch.hidden=64", "modules.language.arch.heads=4",
    "modules.language.arch.kv_heads=4", "modules.language.arch.ffn=128", "modules.language.arch.vocab=512",
    "data.synthetic.text_tokens=[8,60]", "data.tokens_per_microbatch=1024", "data.max_sample_tokens=128",
]


def matmul_rate(device: torch.device, n: int = 8192, iters: int = 20) -> float | None:
    """Measured bf16 matrix rate (TFLOP/s) of one n^3 product on random data, median of ``iters``."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


PACKED = Path(__file__).resolve().parent / "hf_llava_packed.py"  # the anchors' models and samples, padding-free
# the anchor configurations the dense bench tries: the padded script's attention implementations,
# then padding-free packing with SDPA and FlexAttention, each also with its decoder layers compiled
DENSE_BASELINE_CONFIGS = ",".join(["eager", "sdpa", "flex_attention"] + [
    f"packed:{a}{c}" for a in ("sdpa", "flex_attention") for c in ("", "+COMPILE=1")])


def run_baseline(path: Path, steps: int, args: list[str] | str, env_extra: list[str] = ()) -> dict:
    """One run of the anchor script: its JSON line, or ``{"error": ...}`` when it failed (out of
    memory, an attention implementation that does not run there)."""
    env = dict(os.environ, STEPS=str(steps), **dict(kv.split("=", 1) for kv in env_extra))
    args = [args] if isinstance(args, str) else args
    out = subprocess.run([sys.executable, str(path), *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1][-400:] if out.stderr.strip() else ''}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def search_baseline(path: Path, steps: int, configs: list[str], env_extra: list[str] = (), packed_model: str = "dense") -> dict:
    """The anchor in each of ``configs`` (``ARG[+KEY=VALUE...]``: the script's argument and
    environment, e.g. ``sdpa`` or ``grouped_mm+ATTN=sdpa``; ``packed:ATTN[:EXPERTS][+KEY=VALUE...]``:
    the same model and samples padding-free, ``hf_llava_packed.py`` with ``packed_model``), in
    turn; the fastest that ran (real tokens/s) is the anchor, with ``config`` naming it and
    ``runs`` every configuration's numbers or error."""
    runs = {}
    for config in configs:
        head, *env = config.split("+")
        if head.startswith("packed:"):
            runs[config] = run_baseline(PACKED, steps, [packed_model, *head[len("packed:"):].split(":")],
                                        list(env_extra) + env)
        else:
            runs[config] = run_baseline(path, steps, head, list(env_extra) + env)
    ran = {c: r for c, r in runs.items() if "error" not in r}
    if not ran:
        raise SystemExit(f"no configuration of the baseline ran: {runs}")
    best = max(ran, key=lambda c: ran[c]["real_tokens_per_s"])
    summary = {c: r if "error" in r else {k: r.get(k) for k in ("step_s", "real_tokens_per_s", "peak_mem_gib", "padded_fraction")}
               for c, r in runs.items()}
    return dict(ran[best], config=best, runs=summary)


def profile_steps(run, policy, steps: list[int], path: str) -> dict:
    """torch.profiler over ``steps`` (after the timed ones): the kernel table goes to ``path``;
    returns GPU busy time (sum of kernel times) against the wall time of those steps."""
    from torch.profiler import ProfilerActivity, profile

    from mimo.training.step import train_step

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in steps:
            train_step(run.model, run.pipeline, step, run.optimizers, policy)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    averages = prof.key_averages()
    with open(path, "w") as f:  # by kernel time, then by host time (where the GPU waits on the host)
        f.write(averages.table(sort_by="self_cuda_time_total", row_limit=80, max_name_column_width=90))
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))
    trace = str(Path(path).with_suffix(".trace.json"))
    prof.export_chrome_trace(trace)  # one file per profile, gzipped: the step's timeline, host gaps included
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)
    # kernels only: GPU-side user annotations (``Optimizer.step#...``) span kernels already counted
    kernels = sum(e.self_device_time_total for e in prof.events()
                  if e.device_type.name == "CUDA" and not e.is_user_annotation) / 1e6
    return {"profiled_steps": len(steps), "wall_s": wall, "kernel_s": kernels, "gpu_busy_fraction": kernels / wall,
            "kernel_shares": kernel_shares(prof)}


# the step's kernel time by the aten op that launched it (forward and backward alike)
SHARE_CLASSES = (
    ("grouped_gemm", ("_grouped_mm", "_scaled_grouped_mm")),
    ("dense_gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::linear", "aten::matmul")),
    ("attention", ("flash", "attention", "sdpa", "_efficient")),
    ("router", ("aten::topk", "aten::sigmoid")),
    ("permutation", ("aten::sort", "aten::argsort", "aten::index", "aten::gather", "aten::scatter", "aten::index_add",
                     "aten::index_select", "aten::bucketize", "aten::cumsum", "aten::bincount", "aten::histc")),
    ("optimizer", ("_foreach", "_fused_adam", "adam", "aten::lerp", "aten::addcdiv", "aten::addcmul")),
    ("fp8_quantize", ("aten::abs", "aten::amax", "aten::clamp", "aten::reciprocal", "aten::_to_copy")),
    ("compiled_fused", ("triton_", "CompiledFxGraph")),  # inductor's kernels: norms, activations, casts
)
# profiler markers that are not ops (CUPTI's launch-queue stalls carry bogus device times)
NOT_OPS = ("Command Buffer Full",)


def kernel_shares(prof) -> dict:
    """Fractions of the profiled steps' kernel time per class of launching op (SHARE_CLASSES:
    first match of the op's name wins; the rest is ``other``)."""
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name != "CPU" or not e.self_device_time_total or e.key in NOT_OPS:
            continue
        name = e.key
        cls = next((c for c, keys in SHARE_CLASSES if any(k in name for k in keys)), "other")
        totals[cls] = totals.get(cls, 0.0) + e.self_device_time_total
    all_ = sum(totals.values()) or 1.0
    return {c: round(v / all_, 4) for c, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def set_recompute(model, mode: str) -> None:
    """``train.recompute = mode`` on a built model: the LLM stage's layers and each tower's blocks."""
    if mode not in ("none", "selective", "full"):
        raise SystemExit(f"unknown recompute mode {mode!r} (none, selective, full)")
    if model.llm.module is not None:
        model.llm.module.set_recompute(mode)
    for part in model.encoder_parts:
        if part.module is not None:
            part.module.tower.set_recompute(mode)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def step_timer(device: torch.device):
    """(mark, seconds): a time mark on ``device``'s stream (a CUDA event, else the host clock) and
    the seconds between two marks, so that timed steps run back to back without syncs."""
    cuda = device.type == "cuda"

    def mark():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(a, b):
        return a.elapsed_time(b) / 1e3 if cuda else b - a

    return mark, seconds


def run_mimo(config, device: torch.device, steps: int, warmup: int, variants: list[str], profile_to: str | None = None,
             sync_steps: bool = False) -> dict:
    """Build the run once; train steps 1..steps for each variant in turn (``eager``: as built;
    ``compile``: then ``mimo.training.run.compile_blocks``), timing the steps after ``warmup``. Timed
    steps run back to back as the baseline's do (each loss read after the last one), unless
    ``sync_steps``: then each step's loss is read before the next step starts."""
    from mimo.compose.config import Fp8Config
    from mimo.core.errors import MimoError
    from mimo.training.run import build_run, compile_blocks
    from mimo.training.step import train_step

    torch.manual_seed(0)
    t0 = time.perf_counter()
    run = build_run(config, 0, device=device)  # in the config's precision policy
    build_s = time.perf_counter() - t0
    policy = run.policy
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda *a: None)
    mark, seconds = step_timer(device)

    data_s = []  # CPU time of each step's pipeline.step (reading, packing, moving to the device)
    step_data = run.pipeline.step

    def timed_step(step):
        t = time.perf_counter()
        try:
            return step_data(step)
        finally:
            data_s.append(time.perf_counter() - t)

    run.pipeline.step = timed_step
    out = {}
    compiled = False
    try:
        for n, variant in enumerate(variants):
            data_s.clear()
            variant, _, fp8 = variant.partition("@")
            # each variant states its GEMMs: @RECIPE (FP8), @none (the run's dtype), or nothing:
            # train.fp8 as configured, whatever the variant before it ran
            recipe, _, backend = fp8.partition("+")  # RECIPE+torchao: torchao's grouped products
            f8 = config.train.fp8 if not fp8 else None if fp8 == "none" else Fp8Config(recipe=recipe, backend=backend or "mimo")
            if f8 != run.model.fp8:
                try:
                    run.model.set_fp8(f8)
                except MimoError as e:  # (torchao without a GPU, compiled FP8 on a GPU): reported, the rest measured
                    out[f"{variant}@{fp8}"] = {"error": str(e)}
                    continue
            fp8 = fp8 or (f8.recipe if f8 is not None else "")
            variant, _, recompute = variant.partition(":")
            if variant == "compile" and not compiled:
                try:
                    compile_blocks(run.model)
                except MimoError as e:
                    out[f"{variant}@{fp8}" if fp8 else variant] = {"error": str(e)}
                    continue
                compiled = True
            elif variant not in ("eager", "compile") or (variant == "eager" and compiled):
                raise SystemExit(f"unknown variant {variant!r} (eager, compile; eager before compile)")
            if recompute:  # every module's layers from now on (mimo.parallel.recompute)
                set_recompute(run.model, recompute)
                variant = f"{variant}:{recompute}"
            if fp8:
                variant = f"{variant}@{fp8}"
            if variant in out:  # the same variant again: a second measurement in this process
                variant = f"{variant}#{n + 1}"
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            try:  # a variant that fails (out of memory, a kernel refused) is reported, the others still run
                results, marks, warm = [], [], []
                for step in range(1, steps + 1):
                    t = time.perf_counter()
                    if step == warmup + 1:
                        graphs = compiled_graphs()
                    if step > warmup:
                        marks.append(mark())
                    results.append(train_step(run.model, run.pipeline, step, run.optimizers, policy))
                    if step <= warmup or sync_steps:
                        results[-1].loss  # reading the loss waits for the step
                    if step <= warmup:
                        warm.append(time.perf_counter() - t)  # compile time shows here
                marks.append(mark())
                sync()
                losses = [r.loss for r in results]  # as the baseline: no read between timed steps
                out[variant] = {"times": [seconds(a, b) for a, b in zip(marks[:-1], marks[1:])], "warmup_s": warm,
                                "losses": losses, "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                                "data_s_median": statistics.median(data_s[warmup:]),
                                "graphs_compiled_in_timed_steps": compiled_graphs() - graphs}
                if profile_to and cuda:
                    name = variant.replace("@", "-").replace("#", "-")
                    out[variant]["profile"] = profile_steps(run, policy, [steps - 1, steps], f"{profile_to}.{name}.txt")
            except Exception as e:  # noqa: BLE001
                out[variant] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        run.close()
    timed = [s for step in range(warmup + 1, steps + 1) for mbs in run.pipeline.plan.step(step, config.train.micro_batches) for s in mbs]
    return {"variants": out, "real_tokens": sum(s.tokens for s in timed), "samples": timed, "policy": policy, "build_s": build_s}


def fp8_gains(res: dict) -> None:
    """Each FP8 variant (``NAME[:MODE]@RECIPE``) gets ``fp8_gain``: the mean step of the variants of
    the same NAME[:MODE] without FP8 (``@none`` included) in this process, over its own; and the
    names it was taken against (``fp8_gain_against``)."""
    measured = {name: name.split("#")[0].partition("@")[::2] for name, v in res.items()
                if isinstance(v, dict) and "step_s_mean" in v}  # name -> (NAME[:MODE], recipe)
    plain: dict[str, list[str]] = {}
    for name, (stem, recipe) in measured.items():
        if recipe in ("", "none"):
            plain.setdefault(stem, []).append(name)
    for name, (stem, recipe) in measured.items():
        if recipe not in ("", "none") and plain.get(stem):
            v = res[name]
            v["fp8_gain"] = statistics.mean(res[n]["step_s_mean"] for n in plain[stem]) / v["step_s_mean"]
            v["fp8_gain_against"] = plain[stem]


def main(argv=None, bench: str = "llava_step", config_path: Path = ROOT / "configs/llava-1.3b.yaml", tiny: list[str] = TINY,
         baselines=BASELINE_CANDIDATES, baseline_configs: str = DENSE_BASELINE_CONFIGS,
         baseline_env: tuple[str, ...] = (), quiet: bool = False, packed_model: str = "dense") -> dict:
    """The bench (see module doc); ``bench/llava_moe_step.py`` runs it with its own model,
    anchor (``packed_model``: the padding-free anchor's) and tiny model; ``bench/moe_llm_step.py`` with ``quiet`` (no JSON line printed: it
    prints its own)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    parser.add_argument("--config", default=str(config_path))
    parser.add_argument("--steps", type=int, default=13, help="steps in all (the baseline's STEPS)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (the baseline's 3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-baseline", action="store_true", help="skip the Hugging Face baseline")
    parser.add_argument("--baseline", help="path of hf_llava_baseline.py (default: ../shared/bench or .whl/)")
    parser.add_argument("--baseline-configs", "--baseline-arg", default=baseline_configs,
                        help="the baseline's configurations to try, comma-separated, each ARG[+KEY=VALUE...] (the script's "
                        f"argument and environment); the fastest is the anchor (default {baseline_configs})")
    parser.add_argument("--baseline-env", action="append", default=list(baseline_env), metavar="KEY=VALUE",
                        help=f"environment of the baseline's run (default {list(baseline_env)})")
    parser.add_argument("--batch", type=int, help="samples per step of both runs (the baseline's B and mimo's "
                        "data.synthetic.samples_per_microbatch, one microbatch): the same samples at the same batch; "
                        "default: each its own (the config's, the baseline's default)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, help="the compile variant with "
                        "train.cuda_graphs (the vision blocks replayed as CUDA graphs); default: the config's")
    parser.add_argument("--profile", metavar="PREFIX", help="profile two more steps per variant; kernel tables to PREFIX.<variant>.txt (@ and # as -)")
    parser.add_argument("--sync-steps", action="store_true", help="read each step's loss before starting the next "
                        "(the default reads them after the timed steps, as the baseline does)")
    parser.add_argument("--variants", default="eager", help="comma-separated, run in turn on one model: eager, compile "
                        "(a repeated name measures again); NAME:MODE also sets activation recompute (none, selective, full); "
                        "NAME[:MODE]@RECIPE FP8 GEMMs (tensorwise, rowwise, delayed, blockwise; @rowwise+torchao: the "
                        "experts' through torchao; @none: the run's dtype; no @: train.fp8 as configured)")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    if args.batch is not None:  # (later overrides win: after the config's, before the user's own)
        args.baseline_env.append(f"B={args.batch}")
        args.overrides = [f"data.synthetic.samples_per_microbatch={args.batch}", "train.micro_batches=1"] + args.overrides

    from mimo.compose.config import load_config
    from mimo.training.flops import device_peak_flops, model_flops, param_counts

    # checked as the compile variant runs it (train.compile, train.cuda_graphs), then built eager: the
    # "compile" variant compiles the same model afterwards (train.compile's work, compile_blocks)
    graphs = [] if args.cuda_graphs is None else [f"train.cuda_graphs={str(args.cuda_graphs).lower()}"]
    config = load_config(args.config, (tiny if args.tiny else []) + args.overrides + ["train.compile=true"] + graphs)
    config.train.compile = False
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    baseline = None
    if not args.no_baseline:
        path = Path(args.baseline) if args.baseline else next((p for p in baselines if p.is_file()), None)
        if path is None or not path.is_file():
            parser.error(f"no baseline script at {args.baseline or [str(p) for p in baselines]}; use --baseline or --no-baseline")
        # before ours: a clean GPU for each
        baseline = search_baseline(path, args.steps, args.baseline_configs.split(","), args.baseline_env, packed_model)
    rate = matmul_rate(device)
    rated = device_peak_flops(device, config.train.precision, fp8=config.train.fp8 is not None)
    rated = rated / 1e12 if rated else None  # TFLOP/s: MFU's denominator; the measured rate beside it
    got = run_mimo(config, device, args.steps, args.warmup, args.variants.split(","), args.profile, args.sync_steps)

    counts = param_counts(config)
    n_llm = counts[config.llm_name]
    n_vis = sum(counts[name] for name in config.encoders)
    flops = model_flops(config, got["samples"], counts)  # the baseline's count (mimo.training.flops)
    p = got["policy"]
    res = {
        "bench": bench, "config": os.path.relpath(args.config, ROOT),
        "overrides": (["--tiny"] if args.tiny else []) + (["--cuda-graphs"] if config.train.cuda_graphs else []) + args.overrides,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "params_llm": n_llm, "params_vision": n_vis,
        "precision": {"params": str(p.params), "compute": str(p.compute), "grad_reduce": str(p.grad_reduce),
                      "optimizer_state": str(p.optimizer_state), "master_params": str(p.master_params)},
        "build_s": got["build_s"], "peak_tflops_rated": rated, "matmul_tflops_measured": rate,
        "sync_steps": args.sync_steps,
        "batch": args.batch, "samples_per_step": len(got["samples"]) / (args.steps - args.warmup),
        "real_tokens_per_step": got["real_tokens"] / (args.steps - args.warmup),
        "model_tflop_per_step": flops / (args.steps - args.warmup) / 1e12,
    }
    if baseline is not None:
        res["baseline"] = baseline
        # its real tokens per step beside mimo's: equal when both ran the same samples at the same batch
        # and timed the same steps (the anchor warms up on its first 3: --warmup 3 matches it)
        res["baseline_real_tokens_per_step"] = baseline["real_tokens_per_s"] * baseline["step_s"]
        res["same_timed_steps"] = args.warmup == 3
        if rated and got["real_tokens"]:  # its real tokens/s at mimo's FLOPs per real token: one count for both
            res["baseline_mfu"] = baseline["real_tokens_per_s"] * flops / got["real_tokens"] / 1e12 / rated
        if rate:
            res["baseline_mfu_measured_rate"] = baseline["model_tflops_per_s"] / rate
    for name, v in got["variants"].items():
        if "error" in v:
            res[name] = v
            continue
        total = sum(v["times"])
        tflops = flops / total / 1e12
        r = {"timed_steps": len(v["times"]), "step_s_median": statistics.median(v["times"]), "step_s_min": min(v["times"]),
             "step_s_max": max(v["times"]), "step_s_mean": total / len(v["times"]), "warmup_step_s": v["warmup_s"],
             "real_tokens_per_s": got["real_tokens"] / total, "model_tflops_per_s": tflops, "mfu": tflops / rated if rated else None,
             "mfu_measured_rate": tflops / rate if rate else None,
             "peak_mem_gib": v["peak_mem_gib"], "data_s_median": v["data_s_median"], "loss_first": v["losses"][0], "loss_last": v["losses"][-1], "losses": v["losses"],
             "graphs_compiled_in_timed_steps": v["graphs_compiled_in_timed_steps"]}
        if "profile" in v:
            r["profile"] = v["profile"]
        if baseline is not None:
            r["ratio_tokens_per_s"] = r["real_tokens_per_s"] / baseline["real_tokens_per_s"]
        res[name] = r
    fp8_gains(res)
    if not quiet:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
