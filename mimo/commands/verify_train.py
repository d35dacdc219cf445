"""``mimo verify-train``: a config's layout against the one-process reference, step by step.

Both runs start from the same weights (layout-independent init) and see the same global
microbatches (the plan depends on the data config alone). Per step they report the loss, the
global gradient norm and every gradient gathered to full tensors *before* clipping; after
the last step every parameter. Errors are ||a-b|| / ||b||.

The reference runs twice on one process, in fp32 and in fp64 (the same code, a dtype of its
precision policy). The verdict is the yardstick of ``mimo.core.testing`` (docs/design.md §9): each
tensor of the layout must be within ``max(tol, k * e1)`` of the fp64 run, ``e1`` being the
fp32 reference's own error against fp64. The report's ``max_*_rel_err`` keys stay the errors
against the fp32 reference; ``yardstick`` and ``max_*_rel_err_vs_fp64`` carry the verdict.
Every run of a verification steps AdamW with eps ``VERIFY_ADAM_EPS`` (why: there). The layout
run also checks the bridge plans training made for every microbatch on every rank against the
reference builders, and the elements they send and all-gather against the reference's minimum
(``bridge_plans`` in the report: any difference fails the verification).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from mimo.compose.config import MimoConfig, load_config, one_process_module
from mimo.core.testing import Yardstick, rel_err
from mimo.llm.moe import dispatchers
from mimo.training.bucket_optim import finish_updates

KINDS = ("loss", "grad_norm", "grads", "params")
REFERENCE_PRECISIONS = ("fp32", "fp64")
# AdamW's eps in every verification run (layout and references; `mimo train` keeps 1e-8). At 1e-8
# an element whose gradient is ~1e-8 (a near-cancelling sum) moves by lr * g / (|g| + eps): its
# rounding noise, amplified lr / eps = 1e5-fold at lr 1e-3, becomes a parameter difference of a
# good part of lr, and every later step's gradients follow it. That is ill-conditioning of the
# update, not a layout error; 1e-5 keeps updates nearly scale-free (|g| >> 1e-5) and well
# conditioned. A gradient-scale bug still shows in the gradients, which are compared directly.
VERIFY_ADAM_EPS = 1e-5


def one_process(config: MimoConfig) -> MimoConfig:
    """The same model and data on one rank, computed plainly: every module tp=cp=dp=pp=1, no
    activation recompute, AdamW stepping whole buckets (a layout's recompute and sharded or
    offloaded optimizer are checked against the computation they stand for; on the CPU the fp32
    update is torch's AdamW's bit for bit, ``tests/test_optim.py``)."""
    ref = copy.deepcopy(config)
    ref.world_size = 1
    ref.train.recompute = "none"
    ref.train.distributed_optimizer = ref.train.optimizer_offload = False
    for module in ref.modules.values():
        module.parallel = one_process_module(module).parallel
        module.recompute = None
    return ref


def _reporter(model, grid) -> bool:
    """One rank per (module, pipeline stage) reports full tensors: TP, CP and DP rank 0."""
    c = grid.coords(model.rank)
    return all(c.get(d, 0) == 0 for d in ("tp", "cp", "dp"))


def policy_for(precision: str):
    """The run's precision policy: a config precision, or ``fp64`` (references only: weights,
    activations, reductions and AdamW state all fp64)."""
    from mimo.training.precision import PrecisionPolicy

    if precision == "fp64":
        return PrecisionPolicy(*(torch.float64,) * 4)
    return PrecisionPolicy.named(precision)


class _CheckedPipeline:
    """The run's data pipeline, every delivered microbatch's bridge plans (training's, made on the
    data thread) checked on this rank against the reference builders (``mimo.bridges.verify.
    placement_problems``: the placements both sides and the rank's plans both ways), and the
    elements its plans send and all-gather counted beside the reference's minimum (a property of
    the placements: counted by the bridge's first rank only)."""

    def __init__(self, pipeline):
        self._pipeline = pipeline
        self._feeds = {f.name: f for f in pipeline.feeds}
        self.checked, self.problems = 0, []
        self.numel = dict.fromkeys(("sent", "minimum", "gathered", "gather_minimum"), 0)

    def step(self, step: int):
        from mimo.bridges.plan_reference import minimum_numel
        from mimo.bridges.verify import placement_problems, reference_bridge

        plan, pipe = self._pipeline.step(step), self._pipeline
        for mb in plan:
            for name, (src, dst, plans) in mb.plan.bridges.items():
                f = self._feeds[name]
                ref = reference_bridge(*mb.plan.arrays.image_layout(f.placeholder, f.rows_per_image), f.bridge_width, f.grid,
                                       mb.plan.encoder_blocks[name], pipe.llm_grid, mb.plan.llm_blocks,
                                       pipe.sequence_parallel)
                self.problems += [f"step {step} {name}: {p}" for p in placement_problems(src, dst, plans, *ref, pipe.rank)]
                self.checked += 1
                self.numel["sent"] += sum(p.sent_numel(pipe.rank) for p in plans)
                self.numel["gathered"] += sum(g.received_numel for p in plans for g in p.gathers)
                if pipe.rank == min(min(f.grid.ranks), min(pipe.llm_grid.ranks)):
                    for m in (minimum_numel(*ref), minimum_numel(*reversed(ref))):
                        self.numel["minimum"] += m["cross"]
                        self.numel["gather_minimum"] += m["allgather"]
        return plan

    def __getattr__(self, name):
        return getattr(self._pipeline, name)


def train_case(config_path: str, overrides: list[str], steps: int, reference: bool, device: str = "cpu",
               precision: str = "fp32") -> dict:
    """Runs on every rank of a worker pool: ``steps`` training steps, recording what to compare.
    ``device``: ``cuda`` runs on the rank's GPU (TF32 off); ``precision``: the layout run's
    (bf16 takes the GPU fast paths); a reference (one process) runs fp32 or fp64."""
    from mimo.training.run import build_run
    from mimo.training.step import train_step
    from mimo.core.testing import rank_device

    config = load_config(config_path, overrides)
    if reference:
        if precision not in REFERENCE_PRECISIONS:
            raise ValueError(f"a reference runs {' or '.join(REFERENCE_PRECISIONS)}, not {precision!r}")
        config = one_process(config)
    # `mimo train`'s assembly
    run = build_run(config, dist.get_rank(), policy=policy_for(precision), device=rank_device(device))
    model, pipeline, optimizers = run.model, run.pipeline, run.optimizers
    if not reference:
        pipeline = _CheckedPipeline(pipeline)
    for opt in optimizers.values():
        for group in opt.param_groups:
            group["eps"] = VERIFY_ADAM_EPS
    record = {"steps": []}
    moe = dispatchers(model.llm.module) if model.llm.module is not None else []
    for d in moe:  # count the independent minimum of every EP / ETP exchange beside what is sent
        d.audit = not reference

    def grab(model, norm):
        model.grad_sync.gather_shards()  # (a sharded optimizer's ranks hold only their shard of the sums)
        full = model.full_grads()  # collective over each TP group
        mine = {}
        for name, tensors in full.items():
            if _reporter(model, model.part(name).grid):
                mine[name] = tensors
        record["steps"][-1].update(grad_norm=norm, grads=_to_cpu(mine))

    pipeline.last_step = steps
    for step in range(1, steps + 1):
        record["steps"].append({})
        result = train_step(model, pipeline, step, optimizers, run.policy, on_grads=grab)
        record["steps"][-1].update(loss=result.loss, loss_tokens=result.loss_tokens, mtp=dict(result.mtp),
                                   dsa=dict(result.dsa))
    finish_updates(optimizers)  # weights a sharded optimizer is still gathering
    full = model.full_params()
    record["params"] = _to_cpu({
        name: tensors for name, tensors in full.items()
        if _reporter(model, model.part(name).grid)
    })
    pipeline.close()
    record["moe_dispatch"] = {k: sum(getattr(d.stats, k) for d in moe if getattr(d, "audit", False))
                              for k in ("forward_bytes", "backward_bytes", "min_forward_bytes")}
    if not reference:
        record["bridge_plans"] = {"checked": pipeline.checked, "problems": pipeline.problems, **pipeline.numel}
    return record


def _to_cpu(by_module: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """fp32 CPU copies (fp64 ones of an fp64 run): results travel back to the launcher, which
    must not touch a GPU."""
    def wide(t):
        return t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32).cpu()

    return {m: {n: wide(t) for n, t in tensors.items()} for m, tensors in by_module.items()}


def references(pool, config_path: str, overrides: list[str], steps: int, device: str = "cpu") -> tuple[list[dict], list[dict]]:
    """The one-process reference in fp32 and in fp64, on ``pool`` (one rank), one after the other."""
    return tuple(pool.run(train_case, config_path, overrides, steps, True, device, p) for p in REFERENCE_PRECISIONS)


def _merge(per_rank: list[dict], key) -> dict[str, dict[str, torch.Tensor]]:
    """Union over reporting ranks (pipeline stages hold different layers)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for r in per_rank:
        for module, tensors in key(r).items():
            out.setdefault(module, {}).update(tensors)
    return out


def compare(layout: list[dict], reference: list[dict], tol: float, per_module: bool = False, *,
            fp64: list[dict]) -> dict:
    """The layout against the one-process reference: ``reference`` in fp32, ``fp64`` the same
    run in fp64 (module doc). ``per_module``: gradients and parameters are compared as one
    vector per module (bf16 checks: a tensor whose reference is near zero, a norm bias after
    two Adam steps, has a large error of its own in bf16 that says nothing about the layout);
    the per-tensor maxima against fp32 are still reported, as ``max_tensor_*``."""
    ref, ref64 = reference[0], fp64[0]
    ys = Yardstick(tol)
    worst = dict.fromkeys(KINDS, 0.0)
    tensor_worst = {"grads": 0.0, "params": 0.0}
    where = {}

    def bump(kind, err, name, table=worst, prefix=""):
        if err > table[kind] or prefix + kind not in where:
            table[kind] = max(table[kind], err)
            if err >= table[kind]:
                where[prefix + kind] = name

    def scalar(kind, got, want, want64, label):
        bump(kind, abs(got - want) / max(abs(want), 1e-30), label)
        ys.check(f"{kind}: {label}", got, want, want64)

    def tensors(kind, got, want, want64, label):
        for module, ts in want.items():
            if set(got.get(module, {})) != set(ts) or set(want64.get(module, {})) != set(ts):
                raise ValueError(f"{label}{module}: the layout, fp32 and fp64 runs report different tensors")
            for name, t in ts.items():
                args = (got[module][name], t, want64[module][name])
                bump(kind, rel_err(*args[:2]), f"{label}{module}.{name}", *((tensor_worst, "tensor_") if per_module else ()))
                if not per_module:
                    ys.check(f"{kind}: {label}{module}.{name}", *args)
            if per_module:
                flat = lambda d: torch.cat([d[n].reshape(-1) for n in sorted(ts)])  # noqa: E731
                bump(kind, rel_err(flat(got[module]), flat(ts)), f"{label}{module}")
                ys.check(f"{kind}: {label}{module}", flat(got[module]), flat(ts), flat(want64[module]))

    for i, want in enumerate(ref["steps"]):
        got, want64, label = layout[0]["steps"][i], ref64["steps"][i], f"step {i + 1}"
        scalar("loss", got["loss"], want["loss"], want64["loss"], label)
        for part in ("mtp", "dsa"):  # arch.mtp's losses and the DSA indexers' KL, reported apart
            for key, value in want.get(part, {}).items():
                scalar("loss", got[part][key], value, want64[part][key], f"{label} {key}")
        scalar("grad_norm", got["grad_norm"], want["grad_norm"], want64["grad_norm"], label)
        tensors("grads", _merge(layout, lambda r: r["steps"][i].get("grads", {})), want["grads"], want64["grads"], f"{label} ")
    tensors("params", _merge(layout, lambda r: r["params"]), ref["params"], ref64["params"], "")
    report = {f"max_{k}_rel_err": v for k, v in worst.items()}
    if per_module:
        report.update({f"max_tensor_{k}_rel_err": v for k, v in tensor_worst.items()})
    report["worst"] = where
    for k in KINDS:  # the verdict's numbers, beside: the layout and the fp32 reference against fp64
        ms = ys.worst(len(ys.measures), startswith=f"{k}: ")
        report[f"max_{k}_rel_err_vs_fp64"] = max((m.err for m in ms), default=0.0)
        report[f"max_{k}_reference_rel_err_vs_fp64"] = max((m.e1 for m in ms), default=0.0)
    report["yardstick"] = {**ys.summary(8), "tightest": {k: m[0].as_dict() for k in KINDS if (m := ys.worst(1, f"{k}: "))}}
    report["losses"] = [s["loss"] for s in layout[0]["steps"]]
    report["reference_losses"] = [s["loss"] for s in ref["steps"]]
    report["reference_fp64_losses"] = [s["loss"] for s in ref64["steps"]]
    report["ok"] = ys.ok
    if "bridge_plans" in layout[0]:  # training's bridge plans, every rank's, against the reference builders
        problems = [p for r in layout for p in r["bridge_plans"]["problems"]]
        plans = {k: sum(r["bridge_plans"][k] for r in layout) for k in ("checked", "sent", "minimum", "gathered", "gather_minimum")}
        report["bridge_plans"] = {**plans, "problems": len(problems), "first_problems": problems[:4]}
        # every element crosses between ranks, and is all-gathered, exactly as often as it must
        report["ok"] = (report["ok"] and not problems and plans["sent"] == plans["minimum"]
                        and plans["gathered"] == plans["gather_minimum"])
    moe = {k: sum(r.get("moe_dispatch", {}).get(k, 0) for r in layout) for k in ("forward_bytes", "backward_bytes", "min_forward_bytes")}
    if moe["min_forward_bytes"] or moe["forward_bytes"]:
        # MoE dispatch (EP / ETP): bytes sent over the minimum, forward and backward (1.0: each
        # (token, rank) pair crossed once); anything more is a failure like a wrong gradient
        moe["bytes_ratio"] = (moe["forward_bytes"] + moe["backward_bytes"]) / max(2 * moe["min_forward_bytes"], 1)
        report["moe_dispatch"] = moe
        report["ok"] = report["ok"] and moe["bytes_ratio"] == 1.0
    return report


def verify_train(config_path: str, overrides: list[str], steps: int, device: str = "cpu", precision: str = "fp32",
                 tol: float = 1e-5, timeout_s: float = 900.0) -> dict:
    """``mimo verify-train``'s runs: the layout on ``world_size`` processes, then the reference
    on one process, in fp32 and fp64 (the same device kind), and ``compare``."""
    from mimo.training.launch import WorkerPool

    world = load_config(config_path, overrides).world_size
    with WorkerPool(world, timeout_s=timeout_s, device=device) as pool:
        layout = pool.run(train_case, config_path, overrides, steps, False, device, precision)
    with WorkerPool(1, timeout_s=timeout_s, device=device) as pool:
        ref32, ref64 = references(pool, config_path, overrides, steps, device)
    return compare(layout, ref32, tol, per_module=precision == "bf16", fp64=ref64)


def report_lines(report: dict) -> list[str]:
    """Per kind: the largest error against the fp32 reference, and the yardstick's tightest
    tensor (its error against fp64, the fp32 reference's own, the bound)."""
    lines = []
    for k in KINDS:
        lines.append(f"  max {k} rel err {report[f'max_{k}_rel_err']:.2e} ({report['worst'].get(k, '-')})")
        m = report["yardstick"]["tightest"].get(k)
        if m:
            lines.append(f"    vs fp64 {m['err_vs_fp64']:.2e}, one-process fp32 vs fp64 {m['one_process_fp32_vs_fp64']:.2e}, "
                         f"bound {m['bound']:.2e} ({m['name'].partition(': ')[2]})" + ("" if m["ok"] else " FAIL"))
    moe = report.get("moe_dispatch")
    if moe:
        lines.append(f"  moe dispatch bytes_ratio {moe['bytes_ratio']:.6f} (sent {moe['forward_bytes']} + {moe['backward_bytes']} B "
                     f"forward + backward, minimum {moe['min_forward_bytes']} B each way)")
    plans = report.get("bridge_plans")
    if plans:
        lines.append(f"  bridge plans: {plans['checked']} checked against the reference builders, {plans['problems']} problems; "
                     f"elements sent {plans['sent']} (minimum {plans['minimum']}), all-gathered {plans['gathered']} "
                     f"(minimum {plans['gather_minimum']})" + "".join(f"\n    {p}" for p in plans["first_problems"]))
    ys = report["yardstick"]
    lines.append(f"  yardstick: max(tol {ys['tol']:g}, {ys['k']:g} x one-process fp32 err vs fp64); "
                 f"{ys['failed']} of {ys['checked']} failed")
    return lines
